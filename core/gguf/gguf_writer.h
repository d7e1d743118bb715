// GGUF v3 writer, streaming: metadata and tensor infos are collected first, the header goes out
// in one piece, then each tensor's data is appended in the order the tensors were added (in as
// many pieces as the caller likes), so a model never has to be held in memory whole.
//
//   GgufWriter w(path);
//   w.set_string("general.architecture", "llama");
//   w.add_tensor("token_embd.weight", {n_embd, n_vocab}, TensorType::Q8_0);
//   w.write_header();
//   w.write_data(bytes, n);  // ... until every tensor is complete
//   w.finish();              // flushes and closes; throws on any I/O error
//
// The data alignment is `general.alignment` when set (a power of two), else 32, as GGUF says.
// Every error throws GgufError naming the file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/gguf/gguf.h"
#include "quant/formats.h"

namespace ringlm {

class GgufWriter {
 public:
  // Creates (truncates) the file at once, so an unwritable path fails before any work is done.
  explicit GgufWriter(std::string path);
  ~GgufWriter();  // closes the file if finish() was not reached; the partial file stays
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  // --- Metadata (before write_header). Setting an existing key replaces its value in place.
  // Integer scalars of any integer type (and BOOL): the low bytes of v are stored.
  void set_integer(std::string_view key, GgufValueType type, int64_t v);
  void set_float(std::string_view key, GgufValueType type, double v);  // FLOAT32 or FLOAT64
  void set_uint32(std::string_view key, uint32_t v) { set_integer(key, GgufValueType::UINT32, v); }
  void set_bool(std::string_view key, bool v) { set_integer(key, GgufValueType::BOOL, v); }
  void set_string(std::string_view key, std::string_view v);
  void set_integer_array(std::string_view key, GgufValueType element, std::span<const int64_t> values);
  void set_float_array(std::string_view key, GgufValueType element, std::span<const double> values);
  void set_string_array(std::string_view key, std::span<const std::string_view> values);
  // A value as GgufFile parsed it (every type but nested arrays, whose contents the reader skips).
  void set_value(std::string_view key, const GgufValue& value);
  void remove(std::string_view key);

  // --- Tensors (before write_header), in data order. Shape in GGML order (shape[0] = row length).
  void add_tensor(std::string name, std::vector<int64_t> shape, TensorType type);
  size_t tensor_bytes(size_t index) const { return tensors_[index].n_bytes; }

  void write_header();
  // Appends the next bytes of tensor data; a tensor's padding follows once its last byte is in.
  void write_data(const void* data, size_t n);
  // Checks that every tensor is complete, then flushes and closes the file.
  void finish();

  const std::string& path() const { return path_; }
  size_t alignment() const { return alignment_; }
  uint64_t bytes_written() const { return written_; }

 private:
  struct Entry {
    std::string key;
    std::vector<uint8_t> encoded;  // value type id and value, as they appear in the file
  };
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    TensorType type;
    size_t n_bytes;
    uint64_t offset;
  };

  [[noreturn]] void fail(const std::string& message) const;
  void put(std::string_view key, std::vector<uint8_t> encoded);
  void check_not_started(const char* what) const;
  void write_raw(const void* data, size_t n);
  void write_padding();

  std::string path_;
  std::FILE* file_ = nullptr;
  std::vector<Entry> entries_;
  std::vector<Tensor> tensors_;
  size_t alignment_ = 32;
  bool header_written_ = false;
  size_t current_ = 0;         // the tensor write_data() is filling
  size_t current_filled_ = 0;  // bytes of it written so far
  uint64_t written_ = 0;
};

}  // namespace ringlm
