// The vectorized RoPE rotation, fp16 rows and q4_0 cache blocks (backends/cpu/kv_rows.h) against
// independent references: the scalar IEEE conversions of quant/formats.h, every fp16 bit
// pattern, the rotation computed in double from the angles, and GGML's Q4_0 rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "backends/cpu/kv_rows.h"
#include "hwy/targets.h"
#include "quant/formats.h"
#include "quant/quantize.h"

namespace {

using ringlm::cpu::RopePairs;

bool is_f16_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0; }

TEST(Fp16Rows, EveryHalfConvertsToItsExactFloat) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(all.size());
  ringlm::cpu::fp16_to_fp32_row(all.data(), out.data(), static_cast<int64_t>(all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    if (is_f16_nan(all[i])) {
      EXPECT_TRUE(std::isnan(out[i])) << i;
      continue;
    }
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(ringlm::fp16_to_fp32(all[i]))) << i;
  }
}

// Floats spread over the whole fp16 range and past it, rounding halfway cases, subnormals,
// infinities; a length that leaves a scalar tail.
TEST(Fp16Rows, FloatsRoundToNearestEvenAsTheScalarConversion) {
  std::vector<float> in;
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    // A random 24-bit significand at exponents a half can hold (and a few past its limits).
    const float significand = 1.0f + static_cast<float>(bits(rng) & 0x7FFFFFu) / 8388608.0f;
    const int e = static_cast<int>(rng() % 44) - 28;
    in.push_back(std::ldexp(significand, e) * (rng() % 2 ? 1.0f : -1.0f));
  }
  // Exactly halfway between two halves (ties to even, both ways) and the edges of the range.
  for (uint32_t h : {0x3C00u, 0x3C01u, 0x0001u, 0x03FFu, 0x0400u, 0x7BFFu}) {
    const float lo = ringlm::fp16_to_fp32(static_cast<uint16_t>(h));
    const float hi = ringlm::fp16_to_fp32(static_cast<uint16_t>(h + 1));
    in.push_back((lo + hi) / 2);
    in.push_back(-(lo + hi) / 2);
  }
  for (float f : {0.0f, -0.0f, 65504.0f, 65520.0f, 1e6f, -1e6f, 1e-9f, INFINITY, -INFINITY}) in.push_back(f);
  in.push_back(1.0f);  // an odd count: the last elements take the scalar tail
  std::vector<uint16_t> out(in.size());
  ringlm::cpu::fp32_to_fp16_row(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_EQ(out[i], ringlm::fp32_to_fp16(in[i])) << "float " << in[i] << " at " << i;
  }
  const float nan = NAN;
  uint16_t h = 0;
  ringlm::cpu::fp32_to_fp16_row(&nan, &h, 1);
  EXPECT_TRUE(is_f16_nan(h));
}

struct RopeCase {
  RopePairs pairs;
  int head_dim, n_rot, n_heads;
};

class Rope : public testing::TestWithParam<RopeCase> {};

// Pair (a, b) of element indices for rotary pair i.
std::pair<int, int> pair_of(RopePairs pairs, int i, int n_rot) {
  return pairs == RopePairs::kAdjacent ? std::pair{2 * i, 2 * i + 1} : std::pair{i, i + n_rot / 2};
}

TEST_P(Rope, RotatesEveryPairByItsAngleAndNothingElse) {
  const RopeCase c = GetParam();
  const int half = c.n_rot / 2;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  std::vector<double> theta(static_cast<size_t>(half));
  std::vector<float> cos(static_cast<size_t>(half)), sin(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    theta[i] = 1234.0 * std::pow(10000.0, -2.0 * i / c.n_rot);
    cos[i] = static_cast<float>(std::cos(theta[i]));
    sin[i] = static_cast<float>(std::sin(theta[i]));
  }
  std::vector<float> cos_x(static_cast<size_t>(c.n_rot)), sin_x(static_cast<size_t>(c.n_rot));
  ringlm::cpu::expand_rope_angles(cos.data(), sin.data(), c.n_rot, c.pairs, cos_x.data(), sin_x.data());

  std::vector<float> x(static_cast<size_t>(c.n_heads * c.head_dim));
  for (float& v : x) v = normal(rng);
  const std::vector<float> before = x;
  ringlm::cpu::rotate_heads(x.data(), c.n_heads, c.head_dim, c.n_rot, c.pairs, cos_x.data(), sin_x.data());
  for (int h = 0; h < c.n_heads; ++h) {
    const float* in = &before[static_cast<size_t>(h * c.head_dim)];
    const float* out = &x[static_cast<size_t>(h * c.head_dim)];
    for (int i = 0; i < half; ++i) {
      const auto [a, b] = pair_of(c.pairs, i, c.n_rot);
      // The rotation of the float pair by the float cos and sin, in double.
      const double ra = double{in[a]} * cos[i] - double{in[b]} * sin[i];
      const double rb = double{in[a]} * sin[i] + double{in[b]} * cos[i];
      const double tol = 4e-7 * (std::fabs(in[a]) + std::fabs(in[b]));
      EXPECT_NEAR(out[a], ra, tol) << "head " << h << " pair " << i;
      EXPECT_NEAR(out[b], rb, tol) << "head " << h << " pair " << i;
    }
    for (int e = c.n_rot; e < c.head_dim; ++e) EXPECT_EQ(out[e], in[e]) << "head " << h << " element " << e;
  }

  // The rotation by -theta undoes it.
  for (int i = 0; i < half; ++i) sin[i] = -sin[i];
  ringlm::cpu::expand_rope_angles(cos.data(), sin.data(), c.n_rot, c.pairs, cos_x.data(), sin_x.data());
  ringlm::cpu::rotate_heads(x.data(), c.n_heads, c.head_dim, c.n_rot, c.pairs, cos_x.data(), sin_x.data());
  for (size_t e = 0; e < x.size(); ++e) EXPECT_NEAR(x[e], before[e], 1e-5 * (1 + std::fabs(before[e]))) << e;
}

INSTANTIATE_TEST_SUITE_P(Layouts, Rope,
                         testing::Values(RopeCase{RopePairs::kAdjacent, 64, 64, 3}, RopeCase{RopePairs::kHalves, 64, 64, 3},
                                         RopeCase{RopePairs::kAdjacent, 128, 128, 1},
                                         RopeCase{RopePairs::kAdjacent, 64, 32, 5}, RopeCase{RopePairs::kHalves, 64, 32, 5},
                                         RopeCase{RopePairs::kAdjacent, 6, 6, 7}, RopeCase{RopePairs::kHalves, 10, 10, 2}));

// The Walsh-Hadamard turn of a quantized cache's heads, against the matrix of Sylvester's
// construction (H_1 = [1], H_2n = [[H, H], [H, -H]], over sqrt(n)) multiplied out in double: each
// head alone, its own inverse, its norm kept.
TEST(HadamardHeads, EachHeadTimesTheSylvesterMatrix) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (const int dim : {64, 128, 256}) {
    const int heads = 3;
    std::vector<float> x(static_cast<size_t>(heads) * dim);
    for (float& e : x) e = normal(rng);
    std::vector<float> turned = x;
    ringlm::cpu::hadamard_heads(turned.data(), heads, dim);
    const auto sign = [](int i, int j) { return std::popcount(static_cast<unsigned>(i & j)) % 2 == 0 ? 1.0 : -1.0; };
    for (int h = 0; h < heads; ++h) {
      const float* in = &x[static_cast<size_t>(h) * dim];
      for (int i = 0; i < dim; ++i) {
        double want = 0;
        for (int j = 0; j < dim; ++j) want += sign(i, j) * in[j];
        want /= std::sqrt(static_cast<double>(dim));
        ASSERT_NEAR(turned[static_cast<size_t>(h) * dim + i], want, 1e-5) << dim << " " << h << " " << i;
      }
    }
    ringlm::cpu::hadamard_heads(turned.data(), heads, dim);  // H H = I
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(turned[i], x[i], 1e-5) << dim << " " << i;
  }
}

// A q4_0 cache's blocks (quantize_q4_0_searched), on every SIMD target this machine runs: Q4_0
// blocks as the Q4_0 reader reads them, none further from its values by squared error than
// GGML's rounding of the same values (quantize_row), most of a Gaussian row with outliers nearer,
// and exact values on a grid kept exact.
TEST(Q4_0Searched, NoBlockFurtherThanGgmlsOnEveryTarget) {
  constexpr int kBlocks = 256, kCols = 32 * kBlocks;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> x(kCols);
  for (int i = 0; i < kCols; ++i) x[static_cast<size_t>(i)] = normal(rng) * (i % 97 == 0 ? 8.0f : 1.0f);
  for (int j = 0; j < 32; ++j) x[static_cast<size_t>(32 + j)] = 0.25f * static_cast<float>(j % 16 - 8);  // on a grid
  for (int j = 0; j < 32; ++j) x[static_cast<size_t>(64 + j)] = 0.0f;
  std::vector<uint8_t> ggml(ringlm::row_bytes(ringlm::TensorType::Q4_0, kCols)), searched(ggml.size());
  ringlm::quantize_row(ringlm::TensorType::Q4_0, x.data(), ggml.data(), kCols);
  std::vector<float> from_ggml(kCols), from_searched(kCols);
  ringlm::dequantize_row(ringlm::TensorType::Q4_0, ggml.data(), from_ggml.data(), kCols);
  const auto block_error = [&](const std::vector<float>& back, int b) {
    double sum = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) sum += std::pow(static_cast<double>(x[static_cast<size_t>(j)]) - back[static_cast<size_t>(j)], 2);
    return sum;
  };
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    hwy::SetSupportedTargetsForTest(target);
    ringlm::cpu::quantize_q4_0_searched(x.data(), searched.data(), kCols);
    ringlm::dequantize_row(ringlm::TensorType::Q4_0, searched.data(), from_searched.data(), kCols);
    int nearer = 0;
    for (int b = 0; b < kBlocks; ++b) {
      const double mine = block_error(from_searched, b), theirs = block_error(from_ggml, b);
      ASSERT_LE(mine, theirs * (1 + 1e-5) + 1e-12) << "block " << b;
      nearer += mine < theirs * (1 - 1e-3);
    }
    EXPECT_GT(nearer, kBlocks / 2);
    for (int j = 32; j < 96; ++j) EXPECT_EQ(from_searched[static_cast<size_t>(j)], x[static_cast<size_t>(j)]) << j;
  }
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_THROW(ringlm::cpu::quantize_q4_0_searched(x.data(), searched.data(), 33), std::invalid_argument);
}

}  // namespace
