#include "core/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

namespace ringlm {

// A bounds-checked cursor over the mapped bytes. Every read checks the remaining size first,
// so no malformed count or length can make it read past the end.
class GgufCursor {
 public:
  GgufCursor(const GgufFile& file, const uint8_t* base, size_t size) : file_(file), base_(base), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <typename T>
  T read(const char* field) {
    need(sizeof(T), field);
    T value;
    std::memcpy(&value, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  std::string_view read_string(const std::string& field) {
    const uint64_t len = read<uint64_t>(field.c_str());
    if (len > remaining()) {
      file_.fail(field + ": string length " + std::to_string(len) + " runs past the end of the file (" +
                 std::to_string(remaining()) + " bytes left)");
    }
    std::string_view s(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return s;
  }

  void skip(uint64_t n, const std::string& field) {
    need(n, field.c_str());
    pos_ += n;
  }

  void need(uint64_t n, const char* field) const {
    if (n > remaining()) {
      file_.fail(std::string(field) + ": truncated file (needs " + std::to_string(n) + " bytes at offset " +
                 std::to_string(pos_) + ", " + std::to_string(remaining()) + " left)");
    }
  }

 private:
  const GgufFile& file_;
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr int kMaxDims = 4;               // GGML_MAX_DIMS
constexpr size_t kMaxAlignment = 1 << 20;

// Smallest encoded size of one value of a type: lets us reject absurd counts before looping.
uint64_t min_encoded_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    case GgufValueType::STRING: return 8;              // the length prefix
    case GgufValueType::ARRAY: return 4 + 8;           // element type + length
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::FLOAT64); }

// Reads one integer/bool/float scalar of the given type into `out`.
void read_scalar(GgufCursor& c, GgufValueType t, GgufValue& out, const char* field) {
  switch (t) {
    case GgufValueType::UINT8: out.u = c.read<uint8_t>(field); out.i = static_cast<int64_t>(out.u); break;
    case GgufValueType::BOOL: out.u = c.read<uint8_t>(field) != 0; out.i = static_cast<int64_t>(out.u); break;
    case GgufValueType::INT8: out.i = c.read<int8_t>(field); out.u = static_cast<uint64_t>(out.i); break;
    case GgufValueType::UINT16: out.u = c.read<uint16_t>(field); out.i = static_cast<int64_t>(out.u); break;
    case GgufValueType::INT16: out.i = c.read<int16_t>(field); out.u = static_cast<uint64_t>(out.i); break;
    case GgufValueType::UINT32: out.u = c.read<uint32_t>(field); out.i = static_cast<int64_t>(out.u); break;
    case GgufValueType::INT32: out.i = c.read<int32_t>(field); out.u = static_cast<uint64_t>(out.i); break;
    case GgufValueType::UINT64: out.u = c.read<uint64_t>(field); out.i = static_cast<int64_t>(out.u); break;
    case GgufValueType::INT64: out.i = c.read<int64_t>(field); out.u = static_cast<uint64_t>(out.i); break;
    case GgufValueType::FLOAT32: out.f = c.read<float>(field); break;
    case GgufValueType::FLOAT64: out.f = c.read<double>(field); break;
    default: break;
  }
}

}  // namespace

std::string_view gguf_value_type_name(GgufValueType t) {
  static constexpr std::string_view kNames[] = {"uint8", "int8",  "uint16", "int16", "uint32", "int32", "float32",
                                                "bool",  "string", "array", "uint64", "int64", "float64"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : std::string_view("unknown");
}

bool is_integer_type(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::UINT16: case GgufValueType::INT16:
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::UINT64: case GgufValueType::INT64:
    case GgufValueType::BOOL:
      return true;
    default:
      return false;
  }
}

bool is_float_type(GgufValueType t) { return t == GgufValueType::FLOAT32 || t == GgufValueType::FLOAT64; }

bool GgufValue::is_integer() const { return is_integer_type(type); }
bool GgufValue::is_float() const { return is_float_type(type); }

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t GgufTensorInfo::rows() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

void GgufFile::fail(const std::string& message) const { throw GgufError(path_ + ": " + message); }

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw GgufError(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw GgufError(path + ": cannot stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GgufError(path + ": not a regular file");
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    throw GgufError(path + ": empty file (expected a GGUF header)");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) throw GgufError(path + ": mmap failed: " + std::strerror(map_err));

  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->mapping_ = map;
  file->base_ = static_cast<const uint8_t*>(map);
  file->size_ = size;
  file->parse_all();  // on throw, the destructor unmaps
  return file;
}

std::unique_ptr<GgufFile> GgufFile::parse(const uint8_t* bytes, size_t size, std::string label) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = std::move(label);
  file->base_ = bytes;
  file->size_ = size;
  file->parse_all();
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

void GgufFile::parse_all() {
  GgufCursor c(*this, base_, size_);
  if (c.remaining() < 4) fail("header: file is " + std::to_string(size_) + " bytes, too small to be GGUF");
  const auto magic = c.read<uint32_t>("header.magic");
  if (magic != kMagic) fail("header.magic: not a GGUF file (magic bytes do not read \"GGUF\")");
  version_ = c.read<uint32_t>("header.version");
  if (version_ == 1) fail("header.version: GGUF v1 is not supported (only v2 and v3); re-convert the model");
  if (version_ != 2 && version_ != 3) {
    fail("header.version: unsupported GGUF version " + std::to_string(version_) + " (supported: 2, 3)");
  }
  const auto n_tensors = c.read<uint64_t>("header.tensor_count");
  const auto n_kv = c.read<uint64_t>("header.metadata_kv_count");
  // Each KV needs at least a key length, a type and one byte; each tensor info at least 8+4+4+8 bytes.
  if (n_kv > c.remaining() / (8 + 4 + 1)) {
    fail("header.metadata_kv_count: " + std::to_string(n_kv) + " entries cannot fit in the file");
  }
  if (n_tensors > c.remaining() / (8 + 4 + 4 + 8)) {
    fail("header.tensor_count: " + std::to_string(n_tensors) + " tensors cannot fit in the file");
  }

  for (uint64_t k = 0; k < n_kv; ++k) {
    const std::string key_field = "metadata[" + std::to_string(k) + "].key";
    const std::string key(c.read_string(key_field));
    if (key.empty()) fail(key_field + ": empty key");
    const std::string field = "metadata '" + key + "'";
    const auto type_id = c.read<uint32_t>((field + " type").c_str());
    if (!valid_value_type(type_id)) fail(field + ": unknown value type " + std::to_string(type_id));
    GgufValue value;
    value.type = static_cast<GgufValueType>(type_id);
    if (value.type == GgufValueType::STRING) {
      value.str = c.read_string(field);
    } else if (value.type == GgufValueType::ARRAY) {
      const auto elem_id = c.read<uint32_t>((field + " array type").c_str());
      if (!valid_value_type(elem_id)) fail(field + ": unknown array element type " + std::to_string(elem_id));
      value.array_type = static_cast<GgufValueType>(elem_id);
      value.array_length = c.read<uint64_t>((field + " array length").c_str());
      if (value.array_length > c.remaining() / min_encoded_size(value.array_type)) {
        fail(field + ": array length " + std::to_string(value.array_length) + " runs past the end of the file");
      }
      read_array_elements(c, value, field);
    } else {
      read_scalar(c, value.type, value, field.c_str());
    }
    if (kv_.count(key) != 0) fail(field + ": duplicate key");
    key_order_.push_back(key);
    kv_.emplace(key, std::move(value));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_integer() || a->type == GgufValueType::BOOL) fail("metadata 'general.alignment': must be an integer");
    if (a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > kMaxAlignment) {
      fail("metadata 'general.alignment': " + std::to_string(a->u) + " is not a power of two up to 1 MiB");
    }
    alignment_ = static_cast<size_t>(a->u);
  }

  for (uint64_t t = 0; t < n_tensors; ++t) read_tensor_info(c, t);

  // The data section starts at the next multiple of the alignment after the tensor infos.
  const size_t data_start = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  if (!tensors_.empty() && data_start > size_) fail("data section: starts past the end of the file");
  const size_t data_size = data_start <= size_ ? size_ - data_start : 0;
  for (GgufTensorInfo& info : tensors_) {
    const std::string field = "tensor '" + info.name + "'";
    if (info.offset % alignment_ != 0) {
      fail(field + ": data offset " + std::to_string(info.offset) + " is not a multiple of the alignment " +
           std::to_string(alignment_));
    }
    if (info.offset > data_size || info.n_bytes > data_size - info.offset) {
      fail(field + ": data [" + std::to_string(info.offset) + ", +" + std::to_string(info.n_bytes) +
           ") lies past the end of the file (data section is " + std::to_string(data_size) + " bytes)");
    }
    info.data = base_ + data_start + info.offset;
  }
}

void GgufFile::read_array_elements(GgufCursor& c, GgufValue& value, const std::string& field) {
  const uint64_t n = value.array_length;
  const GgufValueType t = value.array_type;
  if (t == GgufValueType::STRING) {
    for (uint64_t i = 0; i < n; ++i) value.strings.push_back(c.read_string(field + "[" + std::to_string(i) + "]"));
  } else if (t == GgufValueType::ARRAY) {
    // Nested arrays are legal GGUF but no model metadata ringlm reads uses them: validate and skip.
    for (uint64_t i = 0; i < n; ++i) skip_value(c, GgufValueType::ARRAY, field + "[" + std::to_string(i) + "]", 1);
  } else if (is_float_type(t)) {
    GgufValue tmp;
    for (uint64_t i = 0; i < n; ++i) {
      read_scalar(c, t, tmp, field.c_str());
      value.floats.push_back(tmp.f);
    }
  } else {
    GgufValue tmp;
    for (uint64_t i = 0; i < n; ++i) {
      read_scalar(c, t, tmp, field.c_str());
      value.ints.push_back(tmp.i);
    }
  }
}

void GgufFile::skip_value(GgufCursor& c, GgufValueType t, const std::string& field, int depth) {
  if (depth > 8) fail(field + ": arrays nested too deeply");
  if (t == GgufValueType::STRING) {
    c.read_string(field);
  } else if (t == GgufValueType::ARRAY) {
    const auto elem_id = c.read<uint32_t>((field + " array type").c_str());
    if (!valid_value_type(elem_id)) fail(field + ": unknown array element type " + std::to_string(elem_id));
    const auto elem = static_cast<GgufValueType>(elem_id);
    const auto n = c.read<uint64_t>((field + " array length").c_str());
    if (n > c.remaining() / min_encoded_size(elem)) fail(field + ": array length runs past the end of the file");
    if (elem == GgufValueType::STRING || elem == GgufValueType::ARRAY) {
      for (uint64_t i = 0; i < n; ++i) skip_value(c, elem, field, depth + 1);
    } else {
      c.skip(n * min_encoded_size(elem), field);
    }
  } else {
    c.skip(min_encoded_size(t), field);
  }
}

void GgufFile::read_tensor_info(GgufCursor& c, uint64_t index) {
  GgufTensorInfo info;
  info.name = std::string(c.read_string("tensor[" + std::to_string(index) + "].name"));
  const std::string field = "tensor '" + info.name + "'";
  if (info.name.empty()) fail("tensor[" + std::to_string(index) + "]: empty name");
  if (tensor_index_.count(info.name) != 0) fail(field + ": duplicate tensor name");

  const auto n_dims = c.read<uint32_t>((field + " n_dims").c_str());
  if (n_dims == 0 || n_dims > kMaxDims) {
    fail(field + ": " + std::to_string(n_dims) + " dimensions (must be 1 to " + std::to_string(kMaxDims) + ")");
  }
  int64_t n_elements = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    const auto dim = c.read<uint64_t>((field + " shape").c_str());
    // Dimensions beyond 2^40 elements are absurd for any model and would overflow size arithmetic.
    if (dim == 0 || dim > (uint64_t{1} << 40)) {
      fail(field + ": dimension " + std::to_string(d) + " is " + std::to_string(dim) + " (must be 1 to 2^40)");
    }
    if (n_elements > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dim) ||
        n_elements * static_cast<int64_t>(dim) > (int64_t{1} << 42)) {
      fail(field + ": element count overflows (shape too large)");
    }
    n_elements *= static_cast<int64_t>(dim);
    info.shape.push_back(static_cast<int64_t>(dim));
  }

  const auto type_id = c.read<uint32_t>((field + " type").c_str());
  const std::optional<TypeTraits> traits = type_traits(type_id);
  if (!traits) fail(field + ": unknown tensor type id " + std::to_string(type_id));
  info.type = static_cast<TensorType>(type_id);
  if (info.shape[0] % traits->block_elems != 0) {
    fail(field + ": row length " + std::to_string(info.shape[0]) + " is not a multiple of the " +
         std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
  }
  info.n_bytes = static_cast<size_t>(n_elements / traits->block_elems) * traits->block_bytes;
  info.offset = c.read<uint64_t>((field + " offset").c_str());

  tensor_index_.emplace(info.name, tensors_.size());
  tensors_.push_back(std::move(info));
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
std::string type_mismatch(std::string_view key, const GgufValue& v, std::string_view wanted) {
  std::string got(gguf_value_type_name(v.type));
  if (v.type == GgufValueType::ARRAY) got = "array of " + std::string(gguf_value_type_name(v.array_type));
  return "metadata '" + std::string(key) + "': expected " + std::string(wanted) + ", found " + got;
}
}  // namespace

std::optional<uint64_t> GgufFile::get_uint(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_integer() || v->type == GgufValueType::BOOL) fail(type_mismatch(key, *v, "an integer"));
  if (v->i < 0 && v->type != GgufValueType::UINT64) {
    fail("metadata '" + std::string(key) + "': negative value " + std::to_string(v->i));
  }
  return v->u;
}

std::optional<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_float()) return v->f;
  if (v->type == GgufValueType::UINT64) return static_cast<double>(v->u);
  if (v->is_integer() && v->type != GgufValueType::BOOL) return static_cast<double>(v->i);
  fail(type_mismatch(key, *v, "a number"));
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_integer()) fail(type_mismatch(key, *v, "a bool"));
  return v->u != 0;
}

std::optional<std::string_view> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufValueType::STRING) fail(type_mismatch(key, *v, "a string"));
  return v->str;
}

const GgufValue* GgufFile::find_array(std::string_view key, bool (*element_ok)(GgufValueType),
                                     std::string_view wanted) const {
  const GgufValue* v = find(key);
  if (v != nullptr && (v->type != GgufValueType::ARRAY || !element_ok(v->array_type))) {
    fail(type_mismatch(key, *v, wanted));
  }
  return v;
}

const std::vector<std::string_view>* GgufFile::get_string_array(std::string_view key) const {
  const auto is_string = [](GgufValueType t) { return t == GgufValueType::STRING; };
  const GgufValue* v = find_array(key, is_string, "an array of strings");
  return v != nullptr ? &v->strings : nullptr;
}

const std::vector<int64_t>* GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find_array(key, is_integer_type, "an array of integers");
  return v != nullptr ? &v->ints : nullptr;
}

const std::vector<double>* GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find_array(key, is_float_type, "an array of floats");
  return v != nullptr ? &v->floats : nullptr;
}

uint64_t GgufFile::require_uint(std::string_view key) const {
  if (auto v = get_uint(key)) return *v;
  fail("missing required metadata '" + std::string(key) + "'");
}

double GgufFile::require_float(std::string_view key) const {
  if (auto v = get_float(key)) return *v;
  fail("missing required metadata '" + std::string(key) + "'");
}

std::string_view GgufFile::require_string(std::string_view key) const {
  if (auto v = get_string(key)) return *v;
  fail("missing required metadata '" + std::string(key) + "'");
}

}  // namespace ringlm
