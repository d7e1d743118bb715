#include "core/gguf/gguf_writer.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

namespace ringlm {

static_assert(std::endian::native == std::endian::little, "GGUF is written in host byte order");

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint32_t kVersion = 3;
constexpr size_t kDefaultAlignment = 32;
constexpr size_t kMaxAlignment = 1 << 20;  // the reader's limit
constexpr size_t kMaxDims = 4;

// Appends values in their file encoding.
struct Encoder {
  std::vector<uint8_t> bytes;

  void raw(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = bytes.size();
    bytes.resize(at + n);
    std::memcpy(bytes.data() + at, p, n);
  }
  template <typename T>
  void put(T v) {
    raw(&v, sizeof(T));
  }
  void type(GgufValueType t) { put(static_cast<uint32_t>(t)); }
  // What comes before an array's elements: the array type, the elements' type, their count.
  void array_header(GgufValueType element, size_t count) {
    type(GgufValueType::ARRAY);
    type(element);
    put(static_cast<uint64_t>(count));
  }
  void string(std::string_view s) {
    put(static_cast<uint64_t>(s.size()));
    raw(s.data(), s.size());
  }
  // An integer of the given type from its int64 bits (uint64 values above INT64_MAX arrive
  // as their two's complement, as GgufValue keeps them).
  void integer(GgufValueType t, int64_t v) {
    switch (t) {
      case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return put(static_cast<uint8_t>(v));
      case GgufValueType::UINT16: case GgufValueType::INT16: return put(static_cast<uint16_t>(v));
      case GgufValueType::UINT32: case GgufValueType::INT32: return put(static_cast<uint32_t>(v));
      case GgufValueType::UINT64: case GgufValueType::INT64: return put(static_cast<uint64_t>(v));
      default: break;
    }
  }
  void floating(GgufValueType t, double v) {
    if (t == GgufValueType::FLOAT32) return put(static_cast<float>(v));
    put(v);
  }
};

uint64_t align_up(uint64_t n, size_t alignment) { return (n + alignment - 1) / alignment * alignment; }

}  // namespace

GgufWriter::GgufWriter(std::string path) : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "wb");
  if (file_ == nullptr) throw GgufError(path_ + ": cannot create: " + std::strerror(errno));
  // Large writes go straight through; the buffer only gathers the header and padding.
  std::setvbuf(file_, nullptr, _IOFBF, 1 << 20);
}

GgufWriter::~GgufWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void GgufWriter::fail(const std::string& message) const { throw GgufError(path_ + ": " + message); }

void GgufWriter::check_not_started(const char* what) const {
  if (header_written_) fail(std::string(what) + " after the header was written");
}

void GgufWriter::put(std::string_view key, std::vector<uint8_t> encoded) {
  check_not_started("metadata change");
  if (key.empty()) fail("metadata: empty key");
  auto it = std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
  if (it != entries_.end()) {
    it->encoded = std::move(encoded);
  } else {
    entries_.push_back({std::string(key), std::move(encoded)});
  }
}

void GgufWriter::set_integer(std::string_view key, GgufValueType type, int64_t v) {
  if (!is_integer_type(type)) fail("metadata '" + std::string(key) + "': " + std::string(gguf_value_type_name(type)) + " is not an integer type");
  if (key == "general.alignment") {
    const auto a = static_cast<uint64_t>(v);
    if (type == GgufValueType::BOOL || a == 0 || (a & (a - 1)) != 0 || a > kMaxAlignment) {
      fail("metadata 'general.alignment': " + std::to_string(v) + " is not a power of two up to 1 MiB");
    }
    alignment_ = static_cast<size_t>(a);
  }
  Encoder e;
  e.type(type);
  e.integer(type, v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_float(std::string_view key, GgufValueType type, double v) {
  if (!is_float_type(type)) fail("metadata '" + std::string(key) + "': " + std::string(gguf_value_type_name(type)) + " is not a float type");
  Encoder e;
  e.type(type);
  e.floating(type, v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_string(std::string_view key, std::string_view v) {
  Encoder e;
  e.type(GgufValueType::STRING);
  e.string(v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_integer_array(std::string_view key, GgufValueType element, std::span<const int64_t> values) {
  if (!is_integer_type(element)) fail("metadata '" + std::string(key) + "': array of " + std::string(gguf_value_type_name(element)) + " given integers");
  Encoder e;
  e.array_header(element, values.size());
  for (const int64_t v : values) e.integer(element, v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_float_array(std::string_view key, GgufValueType element, std::span<const double> values) {
  if (!is_float_type(element)) fail("metadata '" + std::string(key) + "': array of " + std::string(gguf_value_type_name(element)) + " given floats");
  Encoder e;
  e.array_header(element, values.size());
  for (const double v : values) e.floating(element, v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_string_array(std::string_view key, std::span<const std::string_view> values) {
  Encoder e;
  e.array_header(GgufValueType::STRING, values.size());
  for (const std::string_view v : values) e.string(v);
  put(key, std::move(e.bytes));
}

void GgufWriter::set_value(std::string_view key, const GgufValue& value) {
  if (value.type == GgufValueType::STRING) return set_string(key, value.str);
  if (is_float_type(value.type)) return set_float(key, value.type, value.f);
  if (is_integer_type(value.type)) return set_integer(key, value.type, value.i);
  // An array.
  if (value.array_type == GgufValueType::STRING) return set_string_array(key, value.strings);
  if (is_float_type(value.array_type)) return set_float_array(key, value.array_type, value.floats);
  if (is_integer_type(value.array_type)) return set_integer_array(key, value.array_type, value.ints);
  fail("metadata '" + std::string(key) + "': nested arrays cannot be copied (the reader keeps only their length)");
}

void GgufWriter::remove(std::string_view key) {
  check_not_started("metadata change");
  std::erase_if(entries_, [&](const Entry& e) { return e.key == key; });
  if (key == "general.alignment") alignment_ = kDefaultAlignment;
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> shape, TensorType type) {
  check_not_started("add_tensor");
  const std::string field = "tensor '" + name + "'";
  if (name.empty()) fail("tensor: empty name");
  if (std::any_of(tensors_.begin(), tensors_.end(), [&](const Tensor& t) { return t.name == name; })) {
    fail(field + ": duplicate tensor name");
  }
  if (shape.empty() || shape.size() > kMaxDims) fail(field + ": must have 1 to 4 dimensions");
  if (std::any_of(shape.begin(), shape.end(), [](int64_t d) { return d <= 0; })) fail(field + ": a dimension is not positive");
  const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(type));
  if (!traits) fail(field + ": unknown tensor type id " + std::to_string(static_cast<uint32_t>(type)));
  if (shape[0] % traits->block_elems != 0) {
    fail(field + ": row length " + std::to_string(shape[0]) + " is not a multiple of the " + std::string(traits->name) +
         " block size " + std::to_string(traits->block_elems));
  }
  int64_t n_elements = 1;
  for (const int64_t d : shape) n_elements *= d;
  const size_t n_bytes = static_cast<size_t>(n_elements / traits->block_elems) * traits->block_bytes;
  tensors_.push_back({std::move(name), std::move(shape), type, n_bytes, 0});
}

void GgufWriter::write_header() {
  check_not_started("write_header");
  Encoder e;
  e.put(kMagic);
  e.put(kVersion);
  e.put(static_cast<uint64_t>(tensors_.size()));
  e.put(static_cast<uint64_t>(entries_.size()));
  for (const Entry& entry : entries_) {
    e.string(entry.key);
    e.raw(entry.encoded.data(), entry.encoded.size());
  }
  // Offsets are relative to the data section; each tensor starts on the alignment.
  uint64_t offset = 0;
  for (Tensor& t : tensors_) {
    t.offset = offset;
    offset = align_up(offset + t.n_bytes, alignment_);
    e.string(t.name);
    e.put(static_cast<uint32_t>(t.shape.size()));
    for (const int64_t d : t.shape) e.put(static_cast<uint64_t>(d));
    e.put(static_cast<uint32_t>(t.type));
    e.put(t.offset);
  }
  header_written_ = true;
  write_raw(e.bytes.data(), e.bytes.size());
  write_padding();
  // Zero-byte tensors cannot exist (every dimension is positive), so tensor 0 is the one to fill.
}

void GgufWriter::write_data(const void* data, size_t n) {
  if (!header_written_) fail("tensor data written before the header");
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    if (current_ >= tensors_.size()) fail("more tensor data than the tensor infos declare");
    const Tensor& t = tensors_[current_];
    const size_t take = std::min(n, t.n_bytes - current_filled_);
    write_raw(p, take);
    p += take;
    n -= take;
    current_filled_ += take;
    if (current_filled_ == t.n_bytes) {
      write_padding();
      ++current_;
      current_filled_ = 0;
    }
  }
}

void GgufWriter::finish() {
  if (!header_written_) write_header();
  if (current_ < tensors_.size()) {
    fail("tensor '" + tensors_[current_].name + "' is incomplete (" + std::to_string(current_filled_) + " of " +
         std::to_string(tensors_[current_].n_bytes) + " bytes written)");
  }
  std::FILE* f = file_;
  file_ = nullptr;
  const bool flushed = std::fflush(f) == 0;
  const int err = errno;
  if (std::fclose(f) != 0 || !flushed) fail(std::string("cannot write: ") + std::strerror(flushed ? errno : err));
}

void GgufWriter::write_raw(const void* data, size_t n) {
  if (file_ == nullptr) fail("write after finish()");
  if (n > 0 && std::fwrite(data, 1, n, file_) != n) fail(std::string("cannot write: ") + std::strerror(errno));
  written_ += n;
}

// Zeros up to the next multiple of the alignment (the header's end, then each tensor's).
void GgufWriter::write_padding() {
  static constexpr uint8_t kZeros[64] = {};
  uint64_t pad = align_up(written_, alignment_) - written_;
  while (pad > 0) {
    const size_t n = std::min<uint64_t>(pad, sizeof(kZeros));
    write_raw(kZeros, n);
    pad -= n;
  }
}

}  // namespace ringlm
