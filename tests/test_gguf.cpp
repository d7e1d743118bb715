// The GGUF reader against valid files and against every kind of malformed one.
//
// Images come from gguf_test_builder.h. Each rejection test checks that the error is a
// GgufError whose message starts with the file label and names the offending field, so a test
// fails if the reader rejects the file for the wrong reason (or for no stated reason).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "tests/gguf_test_builder.h"

namespace ringlm {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using test::GgufBuilder;
using test::TensorSpec;
namespace gt = test::gguf_type;
namespace tt = test::ggml_type;

constexpr char kLabel[] = "test.gguf";
constexpr uint64_t kHuge = uint64_t{1} << 60;

// A parsed image together with the bytes it points into.
struct Parsed {
  std::unique_ptr<uint8_t[]> bytes;
  std::unique_ptr<GgufFile> file;
};

// The image is copied into a heap block of exactly its size, so that AddressSanitizer reports
// any read past the end (a std::vector's spare capacity would hide one).
std::unique_ptr<uint8_t[]> exact_copy(const uint8_t* data, size_t size) {
  auto copy = std::make_unique<uint8_t[]>(size);
  if (size != 0) std::memcpy(copy.get(), data, size);
  return copy;
}

Parsed parse(const std::vector<uint8_t>& image) {
  Parsed p;
  p.bytes = exact_copy(image.data(), image.size());
  p.file = GgufFile::parse(p.bytes.get(), image.size(), kLabel);
  return p;
}

// The GgufError message of parsing `image`, or "(parsed)" when it parses. Any other exception
// propagates and fails the test.
std::string parse_error(const std::vector<uint8_t>& image) {
  try {
    parse(image);
  } catch (const GgufError& e) {
    return e.what();
  }
  return "(parsed)";
}

// Matches an error message of this file that contains every one of `parts`.
template <typename... Parts>
auto ErrorNaming(Parts... parts) {
  return AllOf(StartsWith(std::string(kLabel) + ": "), HasSubstr(parts)...);
}

// The GgufError message of `call()`, or "(no error)".
template <typename Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const GgufError& e) {
    return e.what();
  }
  return "(no error)";
}

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 7 * i);
  return b;
}

// Array of arrays, `levels` deep, each holding `width` copies of the level below and ending in
// arrays of two int32: the payload of an ARRAY value. (Its size grows as width^levels.)
std::vector<uint8_t> nested_array_payload(int levels, int width = 2) {
  if (levels == 0) return test::array_payload(std::vector<int32_t>{1, 2});
  test::ByteWriter w;
  w.u32(gt::kArray).u64(static_cast<uint64_t>(width));
  const std::vector<uint8_t> inner = nested_array_payload(levels - 1, width);
  for (int i = 0; i < width; ++i) w.bytes(inner);
  return w.data();
}

// A file with one of every metadata type and three tensors of different types.
GgufBuilder full_builder(uint32_t version) {
  GgufBuilder b;
  b.version(version)
      .kv_string("general.architecture", "llama")
      .kv<uint8_t>("t.u8", 200)
      .kv<int8_t>("t.i8", -100)
      .kv<uint16_t>("t.u16", 60000)
      .kv<int16_t>("t.i16", -30000)
      .kv<uint32_t>("t.u32", 4000000000u)
      .kv<int32_t>("t.i32", -2000000000)
      .kv<float>("t.f32", 1.5f)
      .kv_bool("t.bool_true", true)
      .kv_bool("t.bool_false", false)
      .kv<uint64_t>("t.u64", 0xFFFFFFFFFFFFFFF0ull)
      .kv<int64_t>("t.i64", -(int64_t{1} << 40))
      .kv<double>("t.f64", -2.25)
      .kv_strings("t.strings", {"a", "", "h\xc3\xa9llo"})
      .kv_array<int32_t>("t.ints", {1, -2, 3})
      .kv_array<uint8_t>("t.u8s", {0, 255})
      .kv_array<float>("t.floats", {0.5f, -1.25f})
      .kv_array<double>("t.doubles", {1e300})
      .kv_raw("t.nested", gt::kArray, nested_array_payload(2))
      .kv<uint32_t>("t.after_nested", 7)
      .tensor("a", {4, 2}, tt::kF32, f32_bytes({0, 1, 2, 3, 4, 5, 6, 7}))
      .tensor("b", {32, 1}, tt::kQ4_0, pattern(18, 1))
      .tensor("c", {3}, tt::kF16, pattern(6, 2));
  return b;
}

std::vector<uint8_t> full_image(uint32_t version = 3) { return full_builder(version).build(); }

// A file with no tensors and the given metadata, for tests about one key.
GgufBuilder meta_only() { return GgufBuilder().kv_string("general.name", "meta"); }

// A file with one tensor as specified, for tests about tensor infos.
std::vector<uint8_t> one_tensor(TensorSpec spec) { return GgufBuilder().tensor(std::move(spec)).build(); }

// ---------------------------------------------------------------------------------------------
// Valid files

void check_full_file(const GgufFile& f, uint32_t version, const uint8_t* base, size_t data_start) {
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.path(), kLabel);
  ASSERT_EQ(f.keys().size(), 20u);
  EXPECT_EQ(f.keys().front(), "general.architecture");
  EXPECT_EQ(f.keys().back(), "t.after_nested");

  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_uint("t.u8"), 200u);
  EXPECT_EQ(f.find("t.i8")->i, -100);
  EXPECT_EQ(f.find("t.i8")->type, GgufValueType::INT8);
  EXPECT_EQ(f.get_uint("t.u16"), 60000u);
  EXPECT_EQ(f.find("t.i16")->i, -30000);
  EXPECT_EQ(f.get_uint("t.u32"), 4000000000u);
  EXPECT_EQ(f.find("t.i32")->i, -2000000000);
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_bool("t.bool_true"), true);
  EXPECT_EQ(f.get_bool("t.bool_false"), false);
  EXPECT_EQ(f.get_uint("t.u64"), 0xFFFFFFFFFFFFFFF0ull);  // above INT64_MAX: kept unsigned
  EXPECT_EQ(f.find("t.i64")->i, -(int64_t{1} << 40));
  EXPECT_EQ(f.get_float("t.f64"), -2.25);
  EXPECT_EQ(f.get_float("t.u32"), 4000000000.0);  // integers are accepted as numbers

  const auto* strings = f.get_string_array("t.strings");
  ASSERT_NE(strings, nullptr);
  EXPECT_THAT(*strings, ::testing::ElementsAre("a", "", "h\xc3\xa9llo"));
  const auto* ints = f.get_int_array("t.ints");
  ASSERT_NE(ints, nullptr);
  EXPECT_THAT(*ints, ::testing::ElementsAre(1, -2, 3));
  EXPECT_THAT(*f.get_int_array("t.u8s"), ::testing::ElementsAre(0, 255));
  const auto* floats = f.get_float_array("t.floats");
  ASSERT_NE(floats, nullptr);
  EXPECT_THAT(*floats, ::testing::ElementsAre(0.5, -1.25));
  EXPECT_THAT(*f.get_float_array("t.doubles"), ::testing::ElementsAre(1e300));

  // Nested arrays are skipped, not lost: the entry exists with its length, and the key after
  // it was read from the right place.
  const GgufValue* nested = f.find("t.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->type, GgufValueType::ARRAY);
  EXPECT_EQ(nested->array_type, GgufValueType::ARRAY);
  EXPECT_EQ(nested->array_length, 2u);
  EXPECT_EQ(f.get_uint("t.after_nested"), 7u);

  EXPECT_EQ(f.find("absent"), nullptr);
  EXPECT_EQ(f.get_uint("absent"), std::nullopt);
  EXPECT_EQ(f.get_string_array("absent"), nullptr);

  ASSERT_EQ(f.tensors().size(), 3u);
  const GgufTensorInfo* a = f.find_tensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a->type, TensorType::F32);
  EXPECT_EQ(a->n_elements(), 8);
  EXPECT_EQ(a->rows(), 2);
  EXPECT_EQ(a->cols(), 4);
  EXPECT_EQ(a->n_bytes, 32u);
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(a->data, base + data_start);
  float values[8];
  std::memcpy(values, a->data, sizeof(values));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(values[i], static_cast<float>(i));

  const GgufTensorInfo* b = f.find_tensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->type, TensorType::Q4_0);
  EXPECT_EQ(b->n_bytes, 18u);
  EXPECT_EQ(b->offset, 32u);
  EXPECT_EQ(std::vector<uint8_t>(b->data, b->data + 18), pattern(18, 1));

  const GgufTensorInfo* c = f.find_tensor("c");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(c->type, TensorType::F16);
  EXPECT_EQ(c->offset, 64u);
  EXPECT_EQ(std::vector<uint8_t>(c->data, c->data + 6), pattern(6, 2));
  EXPECT_EQ(c->data + c->n_bytes, base + f.file_size());  // the image ends with c's data
  EXPECT_EQ(f.find_tensor("d"), nullptr);
}

TEST(GgufValid, Version3ParsesEveryValueType) {
  const GgufBuilder b = full_builder(3);
  const Parsed p = parse(b.build());
  check_full_file(*p.file, 3, p.bytes.get(), b.data_start());
}

TEST(GgufValid, Version2ParsesEveryValueType) {
  const GgufBuilder b = full_builder(2);
  const Parsed p = parse(b.build());
  check_full_file(*p.file, 2, p.bytes.get(), b.data_start());
}

TEST(GgufValid, EmptyFileWithOnlyAHeader) {
  const Parsed p = parse(GgufBuilder().build());
  EXPECT_TRUE(p.file->keys().empty());
  EXPECT_TRUE(p.file->tensors().empty());
}

TEST(GgufValid, StringRunningExactlyToTheEndOfTheFile) {
  // Boundary of the string length check: a string that ends at the last byte is fine.
  const Parsed p = parse(GgufBuilder().kv_string("k", "tail").build());
  EXPECT_EQ(p.file->get_string("k"), "tail");
}

TEST(GgufValid, RealVocabularyFileOpens) {
  const std::string path = std::string(RINGLM_SHARED_DATA) + "/vocab/ggml-vocab-llama-spm.gguf";
  const auto f = GgufFile::open(path);
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "llama");
  const auto* tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_NE(tokens, nullptr);
  EXPECT_GT(tokens->size(), 1000u);
  ASSERT_NE(f->get_float_array("tokenizer.ggml.scores"), nullptr);
  EXPECT_EQ(f->get_float_array("tokenizer.ggml.scores")->size(), tokens->size());
}

// ---------------------------------------------------------------------------------------------
// Header

TEST(GgufHeader, WrongMagic) {
  EXPECT_THAT(parse_error(GgufBuilder().magic(0x4C4D4747).build()), ErrorNaming("header.magic", "not a GGUF file"));
  // "GGUF" written as a big-endian number.
  EXPECT_THAT(parse_error(GgufBuilder().magic(0x47475546).build()), ErrorNaming("header.magic"));
}

TEST(GgufHeader, TooSmallForAMagic) {
  EXPECT_THAT(parse_error({}), ErrorNaming("header", "0 bytes"));
  EXPECT_THAT(parse_error({'G', 'G', 'U'}), ErrorNaming("header", "3 bytes"));
}

TEST(GgufHeader, UnsupportedVersions) {
  EXPECT_THAT(parse_error(GgufBuilder().version(1).build()), ErrorNaming("header.version", "v1"));
  for (uint32_t v : {0u, 4u, 0xFFFFFFFFu}) {
    EXPECT_THAT(parse_error(GgufBuilder().version(v).build()),
                ErrorNaming("header.version", "unsupported GGUF version " + std::to_string(v)))
        << "version " << v;
  }
}

TEST(GgufHeader, AbsurdTensorCount) {
  EXPECT_THAT(parse_error(full_builder(3).tensor_count(kHuge).build()),
              ErrorNaming("header.tensor_count", std::to_string(kHuge)));
  EXPECT_THAT(parse_error(full_builder(3).tensor_count(~uint64_t{0}).build()), ErrorNaming("header.tensor_count"));
}

TEST(GgufHeader, AbsurdMetadataCount) {
  EXPECT_THAT(parse_error(full_builder(3).kv_count(kHuge).build()),
              ErrorNaming("header.metadata_kv_count", std::to_string(kHuge)));
  EXPECT_THAT(parse_error(full_builder(3).kv_count(~uint64_t{0}).build()), ErrorNaming("header.metadata_kv_count"));
}

TEST(GgufHeader, CountsSlightlyTooLargeRunIntoTheNextSection) {
  // One more KV than written: the first tensor info is read as a KV (name "a", type 2 = uint16
  // taken from n_dims), which shifts the tensor infos so that the first name length is garbage.
  EXPECT_THAT(parse_error(full_builder(3).kv_count(21).build()), ErrorNaming("tensor[0].name", "string length"));
  // One more tensor than written: the padding and data are read as a tensor info.
  EXPECT_THAT(parse_error(full_builder(3).tensor_count(4).build()), ErrorNaming("tensor"));
}

// ---------------------------------------------------------------------------------------------
// Truncation

TEST(GgufTruncation, EveryPrefixOfAValidFileIsRejected) {
  const std::vector<uint8_t> image = full_image();
  ASSERT_EQ(parse_error(image), "(parsed)");
  int failures = 0;
  for (size_t n = 0; n < image.size(); ++n) {
    const std::string err = parse_error(std::vector<uint8_t>(image.begin(), image.begin() + static_cast<ptrdiff_t>(n)));
    if (err.rfind(std::string(kLabel) + ": ", 0) != 0 && ++failures <= 10) {
      ADD_FAILURE() << "prefix of " << n << " of " << image.size() << " bytes: " << err;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(GgufTruncation, PrefixesOfARealFileAreRejected) {
  const std::string path = std::string(RINGLM_SHARED_DATA) + "/vocab/ggml-vocab-llama-spm.gguf";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  const std::vector<uint8_t> image((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(image.size(), 1000u);
  // The first 300 bytes (header and first keys) one by one, then a fixed sample of the rest.
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 300; ++n) lengths.push_back(n);
  std::mt19937_64 rng(42);
  for (int i = 0; i < 60; ++i) lengths.push_back(300 + rng() % (image.size() - 300));
  lengths.push_back(image.size() - 1);
  for (size_t n : lengths) {
    EXPECT_THAT(parse_error(std::vector<uint8_t>(image.begin(), image.begin() + static_cast<ptrdiff_t>(n))),
                ErrorNaming(""))
        << "prefix of " << n << " bytes";
  }
}

// ---------------------------------------------------------------------------------------------
// Metadata

TEST(GgufMetadata, AbsurdKeyLength) {
  test::ByteWriter entry;
  entry.u64(kHuge).raw("key", 3);
  EXPECT_THAT(parse_error(meta_only().kv_entry_raw(entry.data()).build()),
              ErrorNaming("metadata[1].key", "string length " + std::to_string(kHuge)));
}

TEST(GgufMetadata, AbsurdStringValueLength) {
  test::ByteWriter value;
  value.u64(kHuge).raw("abc", 3);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.str", gt::kString, value.data()).build()),
              ErrorNaming("metadata 'k.str'", "string length"));
}

TEST(GgufMetadata, StringOneByteLongerThanTheFile) {
  test::ByteWriter value;
  value.u64(5).raw("tail", 4);
  EXPECT_THAT(parse_error(GgufBuilder().kv_raw("k", gt::kString, value.data()).build()),
              ErrorNaming("metadata 'k'", "string length 5", "4 bytes left"));
}

TEST(GgufMetadata, AbsurdStringLengthInsideAStringArray) {
  test::ByteWriter value;
  value.u32(gt::kString).u64(2).str("ok").u64(kHuge);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.arr", gt::kArray, value.data()).build()),
              ErrorNaming("metadata 'k.arr'[1]", "string length"));
}

TEST(GgufMetadata, AbsurdArrayLength) {
  for (uint32_t elem : {gt::kU8, gt::kU64, gt::kString, gt::kArray}) {
    test::ByteWriter value;
    value.u32(elem).u64(kHuge).u64(0);
    EXPECT_THAT(parse_error(meta_only().kv_raw("k.arr", gt::kArray, value.data()).build()),
                ErrorNaming("metadata 'k.arr'", "array length " + std::to_string(kHuge)))
        << "element type " << elem;
  }
}

TEST(GgufMetadata, ArrayOneElementLongerThanTheFile) {
  test::ByteWriter value;
  value.u32(gt::kU32).u64(3).u32(1).u32(2);
  EXPECT_THAT(parse_error(GgufBuilder().kv_raw("k", gt::kArray, value.data()).build()),
              ErrorNaming("metadata 'k'", "array length 3"));
}

TEST(GgufMetadata, UnknownValueType) {
  for (uint32_t type : {13u, 100u, 0xFFFFFFFFu}) {
    EXPECT_THAT(parse_error(meta_only().kv_raw("k.bad", type, {0, 0, 0, 0}).build()),
                ErrorNaming("metadata 'k.bad'", "unknown value type " + std::to_string(type)));
  }
}

TEST(GgufMetadata, UnknownArrayElementType) {
  test::ByteWriter value;
  value.u32(13).u64(1).u32(0);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.arr", gt::kArray, value.data()).build()),
              ErrorNaming("metadata 'k.arr'", "unknown array element type 13"));
}

TEST(GgufMetadata, UnknownElementTypeInsideANestedArray) {
  test::ByteWriter value;
  value.u32(gt::kArray).u64(1).u32(99).u64(0);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.nest", gt::kArray, value.data()).build()),
              ErrorNaming("metadata 'k.nest'[0]", "unknown array element type 99"));
}

TEST(GgufMetadata, NestedArraysAreSkipped) {
  for (int levels : {1, 3}) {
    const Parsed p = parse(meta_only().kv_raw("k.nest", gt::kArray, nested_array_payload(levels)).kv<uint32_t>("k.next", 5).build());
    EXPECT_EQ(p.file->find("k.nest")->array_length, 2u);
    EXPECT_EQ(p.file->get_uint("k.next"), 5u) << levels << " levels";
  }
  // Nested arrays of strings are validated as they are skipped.
  test::ByteWriter strings;
  strings.u32(gt::kArray).u64(1).u32(gt::kString).u64(2).str("x").str("yz");
  const Parsed p = parse(meta_only().kv_raw("k.s", gt::kArray, strings.data()).kv<uint32_t>("k.next", 6).build());
  EXPECT_EQ(p.file->get_uint("k.next"), 6u);
}

TEST(GgufMetadata, NestedArraysTooDeep) {
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.deep", gt::kArray, nested_array_payload(64, 1)).build()),
              ErrorNaming("metadata 'k.deep'", "nested too deeply"));
}

TEST(GgufMetadata, AbsurdLengthInsideANestedArray) {
  test::ByteWriter value;
  value.u32(gt::kArray).u64(1).u32(gt::kI32).u64(kHuge);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.nest", gt::kArray, value.data()).build()),
              ErrorNaming("metadata 'k.nest'[0]", "array length"));
  test::ByteWriter strings;
  strings.u32(gt::kArray).u64(1).u32(gt::kString).u64(1).u64(kHuge);
  EXPECT_THAT(parse_error(meta_only().kv_raw("k.nest", gt::kArray, strings.data()).build()),
              ErrorNaming("metadata 'k.nest'[0]", "string length"));
}

TEST(GgufMetadata, DuplicateKey) {
  EXPECT_THAT(parse_error(meta_only().kv<uint32_t>("k.dup", 1).kv<uint32_t>("k.dup", 2).build()),
              ErrorNaming("metadata 'k.dup'", "duplicate key"));
}

TEST(GgufMetadata, EmptyKey) {
  EXPECT_THAT(parse_error(meta_only().kv<uint32_t>("", 1).build()), ErrorNaming("metadata[1].key", "empty key"));
}

TEST(GgufMetadata, TypedGettersNameTheKeyOnAWrongType) {
  const Parsed p = parse(full_image());
  const GgufFile& f = *p.file;
  EXPECT_THAT(error_of([&] { f.get_uint("general.architecture"); }),
              ErrorNaming("metadata 'general.architecture'", "expected an integer", "found string"));
  EXPECT_THAT(error_of([&] { f.get_uint("t.f32"); }), ErrorNaming("'t.f32'", "found float32"));
  EXPECT_THAT(error_of([&] { f.get_uint("t.bool_true"); }), ErrorNaming("'t.bool_true'", "found bool"));
  EXPECT_THAT(error_of([&] { f.get_uint("t.i32"); }), ErrorNaming("'t.i32'", "negative value"));
  EXPECT_THAT(error_of([&] { f.get_uint("t.ints"); }), ErrorNaming("'t.ints'", "found array of int32"));
  EXPECT_THAT(error_of([&] { f.get_float("t.strings"); }), ErrorNaming("'t.strings'", "expected a number"));
  EXPECT_THAT(error_of([&] { f.get_bool("general.architecture"); }), ErrorNaming("'general.architecture'", "a bool"));
  EXPECT_THAT(error_of([&] { f.get_string("t.u32"); }), ErrorNaming("'t.u32'", "expected a string", "found uint32"));
  EXPECT_THAT(error_of([&] { f.get_string_array("t.ints"); }), ErrorNaming("'t.ints'", "an array of strings"));
  EXPECT_THAT(error_of([&] { f.get_string_array("t.u32"); }), ErrorNaming("'t.u32'", "an array of strings"));
  EXPECT_THAT(error_of([&] { f.get_int_array("t.floats"); }), ErrorNaming("'t.floats'", "an array of integers"));
  EXPECT_THAT(error_of([&] { f.get_float_array("t.strings"); }), ErrorNaming("'t.strings'", "an array of floats"));
  EXPECT_THAT(error_of([&] { f.require_uint("general.architecture"); }), ErrorNaming("'general.architecture'"));
}

TEST(GgufMetadata, RequireOnAMissingKeyNamesIt) {
  const Parsed p = parse(full_image());
  EXPECT_THAT(error_of([&] { p.file->require_uint("llama.block_count"); }),
              ErrorNaming("missing", "'llama.block_count'"));
  EXPECT_THAT(error_of([&] { p.file->require_float("llama.rope.freq_base"); }),
              ErrorNaming("missing", "'llama.rope.freq_base'"));
  EXPECT_THAT(error_of([&] { p.file->require_string("general.name"); }), ErrorNaming("missing", "'general.name'"));
  EXPECT_EQ(p.file->require_uint("t.u16"), 60000u);
  EXPECT_EQ(p.file->require_float("t.f64"), -2.25);
  EXPECT_EQ(p.file->require_string("general.architecture"), "llama");
}

// ---------------------------------------------------------------------------------------------
// Tensor infos

TEST(GgufTensor, RankZeroAndRankFive) {
  EXPECT_THAT(parse_error(one_tensor({"w", {}, tt::kF32, {}, std::nullopt})),
              ErrorNaming("tensor 'w'", "0 dimensions"));
  EXPECT_THAT(parse_error(one_tensor({"w", {1, 1, 1, 1, 1}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "5 dimensions"));
}

TEST(GgufTensor, RankFourIsAccepted) {
  const Parsed p = parse(one_tensor({"w", {2, 1, 1, 2}, tt::kF32, f32_bytes({1, 2, 3, 4}), std::nullopt}));
  EXPECT_EQ(p.file->find_tensor("w")->n_elements(), 4);
}

TEST(GgufTensor, ZeroDimension) {
  EXPECT_THAT(parse_error(one_tensor({"w", {4, 0}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "dimension 1 is 0"));
}

TEST(GgufTensor, HugeDimension) {
  const uint64_t dim = uint64_t{1} << 50;
  EXPECT_THAT(parse_error(one_tensor({"w", {dim}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "dimension 0 is " + std::to_string(dim)));
  EXPECT_THAT(parse_error(one_tensor({"w", {~uint64_t{0}}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "dimension 0"));
}

TEST(GgufTensor, ElementCountOverflowAcrossDimensions) {
  const uint64_t m = uint64_t{1} << 20;
  EXPECT_THAT(parse_error(one_tensor({"w", {m, m, m}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "element count overflows"));
  const uint64_t g = uint64_t{1} << 40;  // each dimension allowed alone, the product overflows int64
  EXPECT_THAT(parse_error(one_tensor({"w", {g, g, g, g}, tt::kF32, f32_bytes({1}), std::nullopt})),
              ErrorNaming("tensor 'w'", "element count overflows"));
}

TEST(GgufTensor, UnknownTypeId) {
  for (uint32_t type : {999u, 4u, 0xFFFFFFFFu}) {  // 4 and 5 were Q4_2/Q4_3, removed from GGML
    EXPECT_THAT(parse_error(one_tensor({"w", {32}, type, pattern(64, 0), std::nullopt})),
                ErrorNaming("tensor 'w'", "unknown tensor type id " + std::to_string(type)));
  }
}

TEST(GgufTensor, KnownButUnsupportedTypeIsAcceptedByTheReader) {
  // The reader knows IQ2_XXS's block size, so it can check the data range; rejecting it is the
  // model's job (see test_model_load.cpp), which then names the tensor and the type.
  const Parsed p = parse(one_tensor({"w", {256, 2}, tt::kIQ2_XXS, pattern(2 * 66, 3), std::nullopt}));
  const GgufTensorInfo* w = p.file->find_tensor("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(static_cast<uint32_t>(w->type), tt::kIQ2_XXS);
  EXPECT_EQ(w->n_bytes, 2u * 66u);
  const auto traits = type_traits(tt::kIQ2_XXS);
  ASSERT_TRUE(traits.has_value());
  EXPECT_EQ(traits->name, "IQ2_XXS");
  EXPECT_FALSE(traits->readable);
  // The block size is still enforced for it.
  EXPECT_THAT(parse_error(one_tensor({"w", {128}, tt::kIQ2_XXS, pattern(66, 3), std::nullopt})),
              ErrorNaming("tensor 'w'", "IQ2_XXS block size 256"));
}

TEST(GgufTensor, RowLengthNotAMultipleOfTheBlockSize) {
  EXPECT_THAT(parse_error(one_tensor({"w", {33, 2}, tt::kQ4_0, pattern(2 * 18 * 2, 0), std::nullopt})),
              ErrorNaming("tensor 'w'", "row length 33", "Q4_0 block size 32"));
}

TEST(GgufTensor, OffsetNotAligned) {
  EXPECT_THAT(parse_error(one_tensor({"w", {4}, tt::kF32, pattern(64, 0), 4})),
              ErrorNaming("tensor 'w'", "data offset 4", "alignment 32"));
}

TEST(GgufTensor, OffsetPastTheEnd) {
  EXPECT_THAT(parse_error(one_tensor({"w", {4}, tt::kF32, pattern(16, 0), uint64_t{1} << 40})),
              ErrorNaming("tensor 'w'", "past the end"));
  // An aligned offset so large that offset + size wraps around 2^64.
  EXPECT_THAT(parse_error(one_tensor({"w", {4}, tt::kF32, pattern(16, 0), ~uint64_t{0} - 31})),
              ErrorNaming("tensor 'w'", "past the end"));
  // Just past: the data would start right at the end of the file.
  EXPECT_THAT(parse_error(one_tensor({"w", {4}, tt::kF32, pattern(16, 0), 32})), ErrorNaming("tensor 'w'", "past the end"));
}

TEST(GgufTensor, SizePastTheEnd) {
  // 1024 floats declared, 16 bytes present.
  EXPECT_THAT(parse_error(one_tensor({"w", {1024}, tt::kF32, pattern(16, 0), std::nullopt})),
              ErrorNaming("tensor 'w'", "past the end", "+4096"));
  // One byte short.
  EXPECT_THAT(parse_error(one_tensor({"w", {32}, tt::kQ4_0, pattern(17, 0), std::nullopt})),
              ErrorNaming("tensor 'w'", "past the end"));
}

TEST(GgufTensor, DuplicateName) {
  const std::vector<uint8_t> image =
      GgufBuilder().tensor("w", {4}, tt::kF32, pattern(16, 0)).tensor("w", {4}, tt::kF32, pattern(16, 1)).build();
  EXPECT_THAT(parse_error(image), ErrorNaming("tensor 'w'", "duplicate tensor name"));
}

TEST(GgufTensor, EmptyName) {
  EXPECT_THAT(parse_error(one_tensor({"", {4}, tt::kF32, pattern(16, 0), std::nullopt})),
              ErrorNaming("tensor[0]", "empty name"));
}

TEST(GgufTensor, AbsurdNameLength) {
  // Make the first tensor name's length field huge by patching the built image.
  GgufBuilder b = meta_only();
  b.tensor("w", {4}, tt::kF32, pattern(16, 0));
  std::vector<uint8_t> image = b.build();
  const std::vector<uint8_t> before = meta_only().build();  // header + metadata, same length
  ASSERT_GT(image.size(), before.size() + 8);
  std::memcpy(image.data() + before.size(), &kHuge, sizeof(kHuge));
  EXPECT_THAT(parse_error(image), ErrorNaming("tensor[0].name", "string length"));
}

// ---------------------------------------------------------------------------------------------
// Alignment

TEST(GgufAlignment, CustomAlignmentIsHonoured) {
  GgufBuilder b;
  b.data_alignment(64)
      .kv<uint32_t>("general.alignment", 64)
      .tensor("a", {3}, tt::kF32, f32_bytes({1, 2, 3}))
      .tensor("b", {2}, tt::kF32, f32_bytes({4, 5}));
  const std::vector<uint8_t> image = b.build();
  const Parsed p = parse(image);
  EXPECT_EQ(p.file->alignment(), 64u);
  const GgufTensorInfo* t = p.file->find_tensor("b");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->offset, 64u);
  EXPECT_EQ(t->data, p.bytes.get() + b.data_start() + 64);
  EXPECT_EQ((t->data - p.bytes.get()) % 64, 0);
  float v[2];
  std::memcpy(v, t->data, sizeof(v));
  EXPECT_EQ(v[0], 4.0f);
  EXPECT_EQ(v[1], 5.0f);
}

TEST(GgufAlignment, OffsetAlignedTo32ButNot64IsRejectedUnderAlignment64) {
  GgufBuilder b;
  b.data_alignment(32)
      .kv<uint64_t>("general.alignment", 64)
      .tensor("a", {3}, tt::kF32, f32_bytes({1, 2, 3}))
      .tensor("b", {2}, tt::kF32, f32_bytes({4, 5}));  // laid out at 32
  EXPECT_THAT(parse_error(b.build()), ErrorNaming("tensor 'b'", "data offset 32", "alignment 64"));
}

TEST(GgufAlignment, InvalidValues) {
  for (uint32_t a : {0u, 3u, 48u, 1u << 21}) {
    EXPECT_THAT(parse_error(meta_only().kv<uint32_t>("general.alignment", a).build()),
                ErrorNaming("metadata 'general.alignment'", std::to_string(a) + " is not a power of two"));
  }
  EXPECT_THAT(parse_error(meta_only().kv<int32_t>("general.alignment", -32).build()),
              ErrorNaming("metadata 'general.alignment'"));
  EXPECT_THAT(parse_error(meta_only().kv<float>("general.alignment", 32.0f).build()),
              ErrorNaming("metadata 'general.alignment'", "must be an integer"));
  EXPECT_THAT(parse_error(meta_only().kv_string("general.alignment", "32").build()),
              ErrorNaming("metadata 'general.alignment'", "must be an integer"));
  EXPECT_THAT(parse_error(meta_only().kv_bool("general.alignment", true).build()),
              ErrorNaming("metadata 'general.alignment'", "must be an integer"));
}

TEST(GgufMetadata, GetFloatOfAUint64AboveInt64Max) {
  // Known bug (reported to the lead): get_float converts the signed copy of a uint64, so
  // 0xFFFFFFFFFFFFFFF0 comes back as -16. Enable once gguf.cpp converts v->u for UINT64.
  const Parsed p = parse(full_image());
  EXPECT_EQ(p.file->get_float("t.u64"), static_cast<double>(0xFFFFFFFFFFFFFFF0ull));
}

// ---------------------------------------------------------------------------------------------
// Memory: a corrupt count must not make the reader allocate in proportion to it.

// Runs `body` in a child process whose address space is limited to its current size plus
// `headroom`, and returns the child's exit status (or 128 + signal).
template <typename Body>
int run_with_memory_limit(size_t headroom, Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    size_t vm_pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%zu", &vm_pages) != 1) vm_pages = 0;
      std::fclose(f);
    }
    const rlim_t limit = vm_pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE)) + headroom;
    const rlimit rl{limit, limit};
    if (vm_pages == 0 || ::setrlimit(RLIMIT_AS, &rl) != 0) _exit(99);
    _exit(body());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Parses `image` and says how it ended: 0 GgufError, 1 another exception, 2 parsed.
int parse_outcome(const std::vector<uint8_t>& image) {
  try {
    GgufFile::parse(image.data(), image.size(), kLabel);
    return 2;
  } catch (const GgufError&) {
    return 0;
  } catch (...) {
    return 1;
  }
}

bool sanitized_build() {
#if defined(__SANITIZE_ADDRESS__)
  return true;  // ASan reserves terabytes of address space: RLIMIT_AS cannot be used under it
#else
  return false;
#endif
}

// Known bug (reported to the lead): parse_all reserves tensors_ (88 bytes per entry) from the
// header's tensor_count, which is only bounded by the file size (24 bytes per entry). A 256 MiB file whose tensor_count reads 10 million asks for
// ~940 MB before reading a single tensor info, and throws std::bad_alloc, not GgufError, when
// that memory is not there. Enable once the reserves are capped or removed.
TEST(GgufLimits, CorruptTensorCountDoesNotAllocateInProportion) {
  if (sanitized_build()) GTEST_SKIP() << "needs RLIMIT_AS";
  const size_t size = size_t{256} << 20;
  std::vector<uint8_t> image = GgufBuilder().tensor_count(size / 25).build();
  image.resize(size);  // zeros: the first tensor info has an empty name
  EXPECT_EQ(run_with_memory_limit(size_t{600} << 20, [&] { return parse_outcome(image); }), 0)
      << "0: GgufError, 1: another exception (std::bad_alloc), 2: parsed";
}

// ---------------------------------------------------------------------------------------------
// Files on disk

std::string work_path(const std::string& name) {
  const std::string dir = std::string(RINGLM_TEST_WORK_DIR) + "/test_gguf";
  std::filesystem::create_directories(dir);
  return dir + "/" + name;
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string open_error(const std::string& path) {
  try {
    GgufFile::open(path);
  } catch (const GgufError& e) {
    return e.what();
  }
  return "(opened)";
}

TEST(GgufOpen, ValidFileFromDisk) {
  const std::string path = work_path("valid.gguf");
  const GgufBuilder b = full_builder(3);
  write_file(path, b.build());
  const auto f = GgufFile::open(path);
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->file_size(), b.build().size());
  const GgufTensorInfo* a = f->find_tensor("a");
  ASSERT_NE(a, nullptr);
  float v[8];
  std::memcpy(v, a->data, sizeof(v));
  EXPECT_EQ(v[7], 7.0f);
}

TEST(GgufOpen, MissingFileNamesThePath) {
  const std::string path = work_path("does/not/exist.gguf");
  EXPECT_THAT(open_error(path), AllOf(StartsWith(path + ": "), HasSubstr("cannot open"), HasSubstr("No such file")));
}

TEST(GgufOpen, DirectoryIsRejected) {
  const std::string path = std::string(RINGLM_TEST_WORK_DIR);
  EXPECT_THAT(open_error(path), AllOf(StartsWith(path + ": "), HasSubstr("not a regular file")));
}

TEST(GgufOpen, EmptyFileIsRejected) {
  const std::string path = work_path("empty.gguf");
  write_file(path, {});
  EXPECT_THAT(open_error(path), AllOf(StartsWith(path + ": "), HasSubstr("empty file")));
}

TEST(GgufOpen, ErrorsInsideTheFileNameThePath) {
  const std::string path = work_path("bad-magic.gguf");
  write_file(path, GgufBuilder().magic(0x12345678).build());
  EXPECT_THAT(open_error(path), AllOf(StartsWith(path + ": "), HasSubstr("header.magic")));
}

// ---------------------------------------------------------------------------------------------
// Random mutation: whatever the bytes, parse either succeeds or throws GgufError. Run under
// ASan/UBSan this also catches any out-of-bounds read or overflow on the way.

// Reads everything a caller could read after a successful parse, and checks that every tensor's
// data lies inside the image. Returns a checksum of what it read, so the reads are not elided.
size_t touch_everything(const GgufFile& f, const uint8_t* base, size_t size) {
  size_t sum = 0;
  for (const std::string& key : f.keys()) {
    const GgufValue* v = f.find(key);
    if (v == nullptr) {
      ADD_FAILURE() << "listed key not found: " << key;
      continue;
    }
    for (std::string_view s : v->strings) sum += s.empty() ? 0 : static_cast<uint8_t>(s.back());
    sum += v->str.size();
    // The typed getters may reject the type, but only with a GgufError.
    try { (void)f.get_uint(key); } catch (const GgufError&) {}
    try { (void)f.get_float(key); } catch (const GgufError&) {}
    try { (void)f.get_string(key); } catch (const GgufError&) {}
    try { (void)f.get_int_array(key); } catch (const GgufError&) {}
  }
  for (const GgufTensorInfo& t : f.tensors()) {
    const bool inside = t.data >= base && t.n_bytes <= size && static_cast<size_t>(t.data - base) <= size - t.n_bytes;
    if (!inside) {
      ADD_FAILURE() << "tensor '" << t.name << "' data lies outside the image";
      continue;
    }
    if (t.n_bytes > 0) sum += t.data[0] + t.data[t.n_bytes - 1];
  }
  return sum;
}

std::vector<uint8_t> mutate(std::vector<uint8_t> image, std::mt19937_64& rng) {
  static constexpr uint64_t kInteresting[] = {0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0xFFFFFFFF, uint64_t{1} << 32,
                                              uint64_t{1} << 40, uint64_t{1} << 62, ~uint64_t{0}};
  const int n_edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < n_edits && !image.empty(); ++e) {
    const size_t pos = rng() % image.size();
    switch (rng() % 5) {
      case 0:  // flip one bit
        image[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // random byte
        image[pos] = static_cast<uint8_t>(rng());
        break;
      case 2: {  // an interesting 4- or 8-byte little-endian value (counts, lengths, type ids)
        const uint64_t v = kInteresting[rng() % std::size(kInteresting)];
        const size_t width = rng() % 2 ? 8 : 4;
        for (size_t i = 0; i < width && pos + i < image.size(); ++i) image[pos + i] = static_cast<uint8_t>(v >> (8 * i));
        break;
      }
      case 3:  // truncate
        image.resize(pos);
        break;
      default:  // small type id (valid or just past the valid range)
        image[pos] = static_cast<uint8_t>(rng() % 16);
        break;
    }
  }
  return image;
}

TEST(GgufMutation, RandomMutationsParseOrThrowGgufError) {
  const std::vector<uint8_t> seeds[] = {
      full_image(3),
      full_image(2),
      GgufBuilder().data_alignment(64).kv<uint32_t>("general.alignment", 64).tensor("x", {32, 2}, tt::kQ8_0, pattern(68, 9)).build(),
  };
  std::mt19937_64 rng(20240611);
  int parsed = 0, rejected = 0;
  size_t checksum = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const std::vector<uint8_t> image = mutate(seeds[iter % std::size(seeds)], rng);
    try {
      const Parsed p = parse(image);
      checksum += touch_everything(*p.file, p.bytes.get(), image.size());
      ++parsed;
    } catch (const GgufError& e) {
      ASSERT_THAT(e.what(), StartsWith(std::string(kLabel) + ": ")) << "iteration " << iter;
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": parse threw a non-GgufError: " << e.what();
    }
  }
  // Both outcomes must occur, or the mutations are not exercising the reader.
  EXPECT_GT(parsed, 50);
  EXPECT_GT(rejected, 1000);
  RecordProperty("checksum", std::to_string(checksum));
}

}  // namespace
}  // namespace ringlm
