// Builds GGUF byte images in memory for tests.
//
// Two layers. ByteWriter writes little-endian primitives and GGUF strings one by one, so a test
// can hand-make any structure, including ones no valid writer would produce (absurd lengths,
// unknown type ids, nested arrays). GgufBuilder lays out a whole file — header, metadata,
// tensor infos, padding, data — and lets each part be overridden or replaced with raw bytes,
// so a test states only the one thing it breaks.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace ringlm::test {

static_assert(std::endian::native == std::endian::little, "GGUF images are written with host byte order");

// GGUF metadata value type ids, as numbers: tests must be able to write ids the reader rejects.
namespace gguf_type {
inline constexpr uint32_t kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
                          kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12;
}  // namespace gguf_type

// GGML tensor type ids the tests use.
namespace ggml_type {
inline constexpr uint32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                          kBF16 = 30;
// A known GGML type that ringlm does not read (256 weights in 66 bytes): the tests' "unsupported type".
inline constexpr uint32_t kIQ2_XXS = 16;
}  // namespace ggml_type

inline constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32

// The GGUF value type id of a C++ scalar type.
template <typename T>
constexpr uint32_t gguf_type_of() {
  using namespace gguf_type;
  if constexpr (std::is_same_v<T, uint8_t>) return kU8;
  else if constexpr (std::is_same_v<T, int8_t>) return kI8;
  else if constexpr (std::is_same_v<T, uint16_t>) return kU16;
  else if constexpr (std::is_same_v<T, int16_t>) return kI16;
  else if constexpr (std::is_same_v<T, uint32_t>) return kU32;
  else if constexpr (std::is_same_v<T, int32_t>) return kI32;
  else if constexpr (std::is_same_v<T, uint64_t>) return kU64;
  else if constexpr (std::is_same_v<T, int64_t>) return kI64;
  else if constexpr (std::is_same_v<T, float>) return kF32;
  else if constexpr (std::is_same_v<T, double>) return kF64;
  else static_assert(sizeof(T) == 0, "no GGUF value type for this C++ type");
}

class ByteWriter {
 public:
  ByteWriter& raw(const void* p, size_t n) {
    if (n == 0) return *this;  // p may be null for empty data
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  ByteWriter& bytes(const std::vector<uint8_t>& b) { return raw(b.data(), b.size()); }

  // Any arithmetic scalar, in its natural width.
  template <typename T>
  ByteWriter& put(T v) {
    static_assert(std::is_arithmetic_v<T>);
    return raw(&v, sizeof(T));
  }
  ByteWriter& u8(uint8_t v) { return put(v); }
  ByteWriter& u32(uint32_t v) { return put(v); }
  ByteWriter& u64(uint64_t v) { return put(v); }
  ByteWriter& i32(int32_t v) { return put(v); }
  ByteWriter& f32(float v) { return put(v); }

  // A GGUF string: u64 length, then the bytes (no terminator).
  ByteWriter& str(std::string_view s) { return u64(s.size()).raw(s.data(), s.size()); }

  // Zero bytes up to the next multiple of `alignment`.
  ByteWriter& pad_to(size_t alignment) {
    while (buf_.size() % alignment != 0) buf_.push_back(0);
    return *this;
  }

  size_t size() const { return buf_.size(); }
  const std::vector<uint8_t>& data() const { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

// Payload of an array value (element type, count, elements): what follows the ARRAY type id.
template <typename T>
std::vector<uint8_t> array_payload(const std::vector<T>& values) {
  ByteWriter w;
  w.u32(gguf_type_of<T>()).u64(values.size());
  for (T v : values) w.put(v);
  return w.data();
}

inline std::vector<uint8_t> string_array_payload(const std::vector<std::string>& values) {
  ByteWriter w;
  w.u32(gguf_type::kString).u64(values.size());
  for (const std::string& s : values) w.str(s);
  return w.data();
}

// A tensor info plus the bytes laid out for it in the data section.
struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;      // written as n_dims = dims.size(), then each dimension
  uint32_t type = ggml_type::kF32;
  std::vector<uint8_t> data;       // need not match the shape: tests write short data on purpose
  std::optional<uint64_t> offset;  // written instead of the offset the builder laid out
};

class GgufBuilder {
 public:
  GgufBuilder& magic(uint32_t m) { magic_ = m; return *this; }
  GgufBuilder& version(uint32_t v) { version_ = v; return *this; }
  // Counts written in the header instead of the real number of entries.
  GgufBuilder& tensor_count(uint64_t n) { tensor_count_ = n; return *this; }
  GgufBuilder& kv_count(uint64_t n) { kv_count_ = n; return *this; }
  // How the builder pads the data section. Independent of any general.alignment key, so a test
  // can make the two disagree.
  GgufBuilder& data_alignment(size_t a) { alignment_ = a; return *this; }

  // One metadata entry from its key, type id and the raw bytes of its value.
  GgufBuilder& kv_raw(std::string_view key, uint32_t type, const std::vector<uint8_t>& payload) {
    ByteWriter w;
    w.str(key).u32(type).bytes(payload);
    kvs_.push_back(w.data());
    return *this;
  }
  // One metadata entry written entirely by the caller (key length included).
  GgufBuilder& kv_entry_raw(const std::vector<uint8_t>& entry) {
    kvs_.push_back(entry);
    return *this;
  }
  template <typename T>
  GgufBuilder& kv(std::string_view key, T value) {
    ByteWriter w;
    w.put(value);
    return kv_raw(key, gguf_type_of<T>(), w.data());
  }
  GgufBuilder& kv_bool(std::string_view key, bool value) {
    return kv_raw(key, gguf_type::kBool, {static_cast<uint8_t>(value ? 1 : 0)});
  }
  GgufBuilder& kv_string(std::string_view key, std::string_view value) {
    ByteWriter w;
    w.str(value);
    return kv_raw(key, gguf_type::kString, w.data());
  }
  template <typename T>
  GgufBuilder& kv_array(std::string_view key, const std::vector<T>& values) {
    return kv_raw(key, gguf_type::kArray, array_payload(values));
  }
  GgufBuilder& kv_strings(std::string_view key, const std::vector<std::string>& values) {
    return kv_raw(key, gguf_type::kArray, string_array_payload(values));
  }

  GgufBuilder& tensor(TensorSpec spec) {
    tensors_.push_back(std::move(spec));
    return *this;
  }
  GgufBuilder& tensor(std::string name, std::vector<uint64_t> dims, uint32_t type, std::vector<uint8_t> data) {
    return tensor(TensorSpec{std::move(name), std::move(dims), type, std::move(data), std::nullopt});
  }
  GgufBuilder& tensor_f32(std::string name, std::vector<uint64_t> dims, const std::vector<float>& values) {
    std::vector<uint8_t> data(values.size() * sizeof(float));
    std::memcpy(data.data(), values.data(), data.size());
    return tensor(std::move(name), std::move(dims), ggml_type::kF32, std::move(data));
  }

  // Offset of the data section in the image build() returns.
  size_t data_start() const { return layout().data_start; }

  std::vector<uint8_t> build() const {
    const Layout l = layout();
    ByteWriter w;
    write_head(w, l);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      while (w.size() < l.data_start + l.offsets[i]) w.u8(0);
      w.bytes(tensors_[i].data);
    }
    // No padding after the last tensor (nor after the metadata when there are no tensors): then
    // every strict prefix of the image is truncated.
    return w.data();
  }

 private:
  struct Layout {
    std::vector<uint64_t> offsets;  // of each tensor's data, relative to the data section
    size_t data_start = 0;
  };

  Layout layout() const {
    Layout l;
    uint64_t pos = 0;
    for (const TensorSpec& t : tensors_) {
      pos = (pos + alignment_ - 1) / alignment_ * alignment_;
      l.offsets.push_back(pos);
      pos += t.data.size();
    }
    ByteWriter head;
    write_head(head, l);
    // Without tensors nothing follows the metadata: the file ends at its last byte.
    l.data_start = tensors_.empty() ? head.size() : (head.size() + alignment_ - 1) / alignment_ * alignment_;
    return l;
  }

  // Header, metadata and tensor infos: everything before the data section's padding.
  void write_head(ByteWriter& w, const Layout& l) const {
    w.u32(magic_).u32(version_);
    w.u64(tensor_count_.value_or(tensors_.size())).u64(kv_count_.value_or(kvs_.size()));
    for (const std::vector<uint8_t>& kv : kvs_) w.bytes(kv);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const TensorSpec& t = tensors_[i];
      w.str(t.name).u32(static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) w.u64(d);
      w.u32(t.type).u64(t.offset.value_or(l.offsets.empty() ? 0 : l.offsets[i]));
    }
  }

  uint32_t magic_ = kGgufMagic;
  uint32_t version_ = 3;
  std::optional<uint64_t> tensor_count_;
  std::optional<uint64_t> kv_count_;
  size_t alignment_ = 32;
  std::vector<std::vector<uint8_t>> kvs_;
  std::vector<TensorSpec> tensors_;
};

}  // namespace ringlm::test
