// Dequantization of every readable GGUF type, checked against the `gguf` Python package's own
// dequantizer (tests/reference/make_dequant_vectors.py writes both the raw blocks and its result),
// and the fp16/bf16 conversions checked exhaustively and against the CPU's F16C instructions.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/gguf/gguf.h"
#include "quant/formats.h"

namespace ringlm {
namespace {

const std::string kVectorsPath = std::string(RINGLM_TEST_WORK_DIR) + "/dequant_vectors.gguf";

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

  const int64_t cols = q->cols();
  const size_t stride = row_bytes(q->type, cols);
  std::vector<float> row(static_cast<size_t>(cols));
  const auto* expected = reinterpret_cast<const float*>(ref->data);
  int64_t mismatches = 0;
  for (int64_t r = 0; r < q->rows(); ++r) {
    dequantize_row(q->type, q->data + r * stride, row.data(), cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float want = expected[r * cols + c];
      const float tol = 1e-6f * std::max(1.0f, std::fabs(want));
      if (!(std::fabs(row[static_cast<size_t>(c)] - want) <= tol) && mismatches++ < 5) {
        ADD_FAILURE() << type << " row " << r << " col " << c << ": got " << row[static_cast<size_t>(c)] << ", want " << want;
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << type;
}

INSTANTIATE_TEST_SUITE_P(AllReadableTypes, DequantAgainstGguf,
                         ::testing::Values("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"));

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
  EXPECT_FALSE(type_traits(13)->readable);       // Q5_K: known, not read
  EXPECT_FALSE(type_traits(999).has_value());
  EXPECT_EQ(row_bytes(TensorType::Q4_1, 64), 40u);
}

}  // namespace
}  // namespace ringlm
