// GGUF reader (format versions 2 and 3) over a read-only mmap.
//
// Everything is validated against the file size before it is used: counts, string and array
// lengths, value types, tensor ranks, shapes, types, offsets and the alignment. A failure throws
// GgufError whose message names the file, the field and what was wrong. After open() succeeds,
// every accessor is safe: tensor data pointers lie inside the mapping, metadata is parsed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "quant/formats.h"

namespace ringlm {

class GgufCursor;  // bounds-checked reader, internal to gguf.cpp

class GgufError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

std::string_view gguf_value_type_name(GgufValueType t);
// The scalar kinds a value or an array's elements can be read as (bool counts as an integer).
bool is_integer_type(GgufValueType t);
bool is_float_type(GgufValueType t);

// One metadata value. Scalars are widened (integers to int64/uint64, floats to double);
// strings point into the mapping. Arrays of scalars and strings are fully parsed;
// nested arrays are validated and skipped (only their length is kept).
struct GgufValue {
  GgufValueType type = GgufValueType::UINT8;
  GgufValueType array_type = GgufValueType::UINT8;  // element type when type == ARRAY
  uint64_t array_length = 0;
  int64_t i = 0;      // integer and bool scalars (uint64 values above INT64_MAX are kept in u)
  uint64_t u = 0;
  double f = 0;       // float scalars
  std::string_view str;
  std::vector<int64_t> ints;             // integer/bool array elements
  std::vector<double> floats;            // float array elements
  std::vector<std::string_view> strings; // string array elements

  bool is_integer() const;
  bool is_float() const;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // GGML order: shape[0] is the contiguous (row) dimension
  TensorType type = TensorType::F32;
  uint64_t offset = 0;         // relative to the data section
  size_t n_bytes = 0;
  const uint8_t* data = nullptr;  // inside the mapping

  int64_t n_elements() const;
  int64_t rows() const;  // product of shape[1..]
  int64_t cols() const { return shape.empty() ? 1 : shape[0]; }
};

class GgufFile {
 public:
  // Maps and validates the file. Throws GgufError.
  static std::unique_ptr<GgufFile> open(const std::string& path);
  // Parses an in-memory image (the fuzzer and tests use it). `label` stands for the file name
  // in errors. The buffer must outlive the returned object.
  static std::unique_ptr<GgufFile> parse(const uint8_t* bytes, size_t size, std::string label);

  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t file_size() const { return size_; }
  size_t alignment() const { return alignment_; }

  const GgufValue* find(std::string_view key) const;
  const std::vector<std::string>& keys() const { return key_order_; }

  // Typed getters: nullopt when the key is absent; GgufError when present with the wrong type.
  std::optional<uint64_t> get_uint(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;  // accepts integer values too
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string_view> get_string(std::string_view key) const;
  // Array getters: nullptr when absent; GgufError when present with the wrong element type.
  const std::vector<std::string_view>* get_string_array(std::string_view key) const;
  const std::vector<int64_t>* get_int_array(std::string_view key) const;
  const std::vector<double>* get_float_array(std::string_view key) const;

  // Required variants: GgufError naming the key when it is absent.
  uint64_t require_uint(std::string_view key) const;
  double require_float(std::string_view key) const;
  std::string_view require_string(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;

  // "FILE: message" — the prefix every error of this file carries.
  [[noreturn]] void fail(const std::string& message) const;

 private:
  GgufFile() = default;
  void parse_all();
  void read_array_elements(GgufCursor& c, GgufValue& value, const std::string& field);
  void skip_value(GgufCursor& c, GgufValueType t, const std::string& field, int depth);
  void read_tensor_info(GgufCursor& c, uint64_t index);
  // The array at `key` (null if absent) when element_ok accepts its elements' type; else fails
  // saying it wanted `wanted`.
  const GgufValue* find_array(std::string_view key, bool (*element_ok)(GgufValueType), std::string_view wanted) const;

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* mapping_ = nullptr;  // owned mmap, or nullptr for parse()
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  std::unordered_map<std::string, GgufValue> kv_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace ringlm
