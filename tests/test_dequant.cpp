// Dequantization of every readable GGUF type, checked against the `gguf` Python package's own
// dequantizer (tests/reference/make_dequant_vectors.py writes both the raw blocks and its result),
// and the fp16/bf16 conversions checked exhaustively and against the CPU's F16C instructions.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/gguf/gguf.h"
#include "quant/formats.h"
#include "quant/int4.h"

namespace ringlm {
namespace {

const std::string kVectorsPath = std::string(RINGLM_TEST_WORK_DIR) + "/dequant_vectors.gguf";

// Every type ringlm reads, by its GGML name; each has vectors in the file.
const std::vector<std::string> kReadableTypes = {"F32",  "F16",  "BF16", "Q8_0", "Q4_0",   "Q4_1",   "Q5_0", "Q5_1",
                                                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"};

// The distance in representable floats (0 for equal values, +0 and -0 included).
int64_t ulps_apart(float a, float b) {
  auto ordered = [](float f) {
    const auto i = static_cast<int64_t>(std::bit_cast<int32_t>(f));
    return i < 0 ? std::numeric_limits<int32_t>::min() - i : i;
  };
  return std::abs(ordered(a) - ordered(b));
}

class DequantAgainstGguf : public ::testing::TestWithParam<std::string> {};

TEST_P(DequantAgainstGguf, MatchesPythonDequantizer) {
  const auto file = GgufFile::open(kVectorsPath);
  const std::string type = GetParam();
  const GgufTensorInfo* q = file->find_tensor(type + ".q");
  const GgufTensorInfo* ref = file->find_tensor(type + ".ref");
  ASSERT_NE(q, nullptr) << type;
  ASSERT_NE(ref, nullptr) << type;
  ASSERT_EQ(ref->type, TensorType::F32);
  ASSERT_EQ(q->n_elements(), ref->n_elements());
  EXPECT_EQ(type_traits(static_cast<uint32_t>(q->type))->name, type);

  // The results must be the same numbers, not merely close. dequantize_row() does gguf's float32
  // operations in gguf's order (make_dequant_vectors.py lists it and proves it), and the order of
  // the multiplications does not even matter: an fp16 scale has 11 significant bits and the
  // integers multiplying it at most 12 bits between them, so every product is exact in float32;
  // the one rounding is the final "+ m" / "- dmin * m", which an FMA would not change either.
  const int64_t cols = q->cols();
  const size_t stride = row_bytes(q->type, cols);
  std::vector<float> row(static_cast<size_t>(cols));
  const auto* expected = reinterpret_cast<const float*>(ref->data);
  int64_t mismatches = 0;
  for (int64_t r = 0; r < q->rows(); ++r) {
    dequantize_row(q->type, q->data + r * stride, row.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float got = row[static_cast<size_t>(c)], want = expected[r * cols + c];
      if (!(got == want) && mismatches++ < 5) {
        ADD_FAILURE() << type << " row " << r << " col " << c << ": got " << got << ", want " << want << " ("
                      << ulps_apart(got, want) << " ulp apart)";
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << type;
}

INSTANTIATE_TEST_SUITE_P(AllReadableTypes, DequantAgainstGguf, ::testing::ValuesIn(kReadableTypes));

TEST(Fp16, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(static_cast<f16_bits>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_fp16(f), h) << "half bits " << h;
  }
}

__attribute__((target("f16c"))) uint16_t hardware_fp32_to_fp16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hardware_fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

TEST(Fp16, MatchesF16cHardwareConversion) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C to compare with";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float want = hardware_fp16_to_fp32(static_cast<uint16_t>(h));
    const float got = fp16_to_fp32(static_cast<f16_bits>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << "half bits " << h;
    }
  }
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(bits(rng));
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_fp16(f), hardware_fp32_to_fp16(f)) << "float " << f;
  }
}

TEST(Bf16, TruncatesWithRoundToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 lies exactly between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(fp32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 ties upward to the even neighbour 1 + 2^-6.
  EXPECT_EQ(fp32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_fp32(static_cast<bf16_bits>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_bf16(f), h);
  }
}

TEST(TypeTraits, KnownSizesAndUnknownIds) {
  EXPECT_EQ(type_traits(2)->block_bytes, 18u);   // Q4_0
  EXPECT_EQ(type_traits(12)->block_elems, 256);  // Q4_K
  EXPECT_TRUE(type_traits(13)->readable);        // Q5_K
  EXPECT_FALSE(type_traits(999).has_value());
  EXPECT_FALSE(type_traits(4).has_value());      // Q4_2, removed from GGML
  EXPECT_EQ(row_bytes(TensorType::Q4_1, 64), 40u);
  EXPECT_EQ(row_bytes(TensorType::IQ4_XS, 512), 272u);
  // Known but not read: the name is there for the error message, and the size for the reader.
  for (const auto& [id, name] : {std::pair<uint32_t, std::string_view>{16, "IQ2_XXS"}, {34, "TQ1_0"}, {28, "F64"}}) {
    const std::optional<TypeTraits> t = type_traits(id);
    ASSERT_TRUE(t.has_value()) << name;
    EXPECT_EQ(t->name, name);
    EXPECT_FALSE(t->readable) << name;
  }
  EXPECT_EQ(type_traits(16)->block_bytes, 66u);
}

// ringlm's table of GGML type ids against gguf's own (make_dequant_vectors.py copies it into the
// vectors file): every id gguf knows is known here with the same name and block size, and the
// readable ones are exactly those the dequantization test above covers.
TEST(TypeTraits, AgreeWithTheGgufPackage) {
  const auto file = GgufFile::open(kVectorsPath);
  const auto* ids = file->get_int_array("ggml.types.id");
  const auto* names = file->get_string_array("ggml.types.name");
  const auto* elems = file->get_int_array("ggml.types.block_elems");
  const auto* bytes = file->get_int_array("ggml.types.block_bytes");
  ASSERT_TRUE(ids && names && elems && bytes);
  ASSERT_EQ(names->size(), ids->size());
  ASSERT_EQ(elems->size(), ids->size());
  ASSERT_EQ(bytes->size(), ids->size());
  ASSERT_GE(ids->size(), 30u);

  std::set<uint32_t> in_gguf;
  for (size_t i = 0; i < ids->size(); ++i) {
    const auto id = static_cast<uint32_t>((*ids)[i]);
    const std::string_view name = (*names)[i];
    SCOPED_TRACE(std::string(name));
    in_gguf.insert(id);
    const std::optional<TypeTraits> t = type_traits(id);
    ASSERT_TRUE(t.has_value());
    EXPECT_EQ(t->name, name);
    EXPECT_EQ(t->block_elems, (*elems)[i]);
    if (name == "Q8_1") {
      // gguf-py 0.19.0 still lists 40 bytes (two fp32, an old layout); ggml's block_q8_1 is two
      // fp16 and 32 int8. No model file carries Q8_1 (it is a dot-product intermediate).
      EXPECT_EQ(t->block_bytes, 36u);
    } else {
      EXPECT_EQ(t->block_bytes, static_cast<size_t>((*bytes)[i]));
    }
    const bool covered = std::find(kReadableTypes.begin(), kReadableTypes.end(), name) != kReadableTypes.end();
    EXPECT_EQ(t->readable, covered) << "a readable type must have dequantization vectors, and the reverse";
  }
  // Nothing below ringlm's own INT4 ids is known that gguf does not know, but Q2_0: ggml.h has it
  // (id 42, 64 weights in 18 bytes), gguf 0.19.0 not yet.
  for (uint32_t id = 0; id < kInt4TypeBase; ++id) {
    if (type_traits(id).has_value() && in_gguf.count(id) == 0) {
      EXPECT_EQ(id, 42u) << type_traits(id)->name;
    }
  }
}

}  // namespace
}  // namespace ringlm
