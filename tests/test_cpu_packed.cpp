// The packed kernels (backends/cpu/kernel_packed.h) on every weight type they run, on every
// Highway target of theirs this CPU runs (AVX-512 VNNI, AVX-512, AVX2 and the scalar fallback of
// the others: test::packed_kernel_targets): against the exact double product of the weights (as quant/formats.cpp dequantizes
// them, itself checked against the `gguf` package) and the activations as the kernels quantize
// them; bit-identical results for any split of the rows on 16-row boundaries and any number of
// tokens; row counts that are not a multiple of 16; the packed copy read back in fp32.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/packed_format.h"
#include "hwy/targets.h"
#include "tests/only_target.h"
#include "tests/packed_input.h"
#include "tests/weight_formats.h"

namespace ringlm {
namespace {

using cpu::kActBlock;
using cpu::kPackRows;
using cpu::kSuperBlock;
using test::Acts;
using test::Input;
using test::random_acts;

constexpr double kFloatEps = 1.0 / (1 << 24);  // unit roundoff of fp32

struct Format {
  TensorType type;
  std::string name;
};
void PrintTo(const Format& f, std::ostream* out) { *out << f.name; }
std::vector<Format> all_formats() {
  std::vector<Format> out;
  for (const auto& [type, name] : test::packed_types()) out.push_back({type, name});
  return out;
}

// The smallest row length of a type, and a few longer ones.
std::vector<int64_t> test_cols(TensorType t) {
  const int64_t unit = std::max<int64_t>(test::block_elems(t), 32);
  if (test::acts_of(t) == Acts::kPer256) return {256, 1536};
  return {unit, 3 * unit, 1536};
}

std::vector<float> run_packed(const cpu::PackedWeight& p, Input& x) {
  std::vector<float> y(static_cast<size_t>(x.m * p.rows), NAN);
  cpu::gemm_packed(p, 0, p.rows, x.packed(), x.m, y.data(), p.rows);
  return y;
}

cpu::PackedWeight pack(TensorType t, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  return cpu::pack_weight(t, w.data(), row_bytes(t, cols), rows, cols);
}

std::string shape_name(int64_t m, int64_t n, int64_t k) {
  std::ostringstream out;
  out << "M" << m << " N" << n << " K" << k;
  return out.str();
}

class Packed : public ::testing::TestWithParam<Format> {};

TEST_P(Packed, IsSupported) {
  const TensorType t = GetParam().type;
  for (int64_t k : test_cols(t)) EXPECT_TRUE(cpu::packed_supported(t, k)) << k;
  EXPECT_FALSE(cpu::packed_supported(t, test::acts_of(t) == Acts::kPer256 ? 128 : 16));
}

// Against the exact double product of the weights and the activations as the kernels see them.
// A kernel adds per block (of 32, 128 or 256) a few rounded terms, each as large as the
// magnitudes mag = sum of (|w| + |what code 0 is worth|) |x| of the block, and sums K/32 such
// terms at most per lane, so |error| <= 2 (K/32 + 8) u mag with u = 2^-24. Float weights sum
// K/2 products per chain: K u mag.
TEST_P(Packed, MatchesExactProductOfTheOperandsItSees) {
  const TensorType t = GetParam().type;
  const Acts acts = test::acts_of(t);
  std::mt19937 rng(static_cast<unsigned>(t) + 5);
  for (int64_t target : test::packed_kernel_targets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const test::OnlyTarget only(target);
    for (int64_t k : test_cols(t)) {
      for (int64_t n : {1, 17, 48}) {
        const std::vector<uint8_t> w = test::random_weights(t, n, k, rng);
        const cpu::PackedWeight p = pack(t, w, n, k);
        ASSERT_EQ(p.rows, n);
        const std::vector<float> wf = test::dequantize(t, w, n, k);
        const std::vector<float> off = test::offset_magnitudes(t, w, n, k);
        for (int64_t m : {1, 3, 4, 5, 7, 16}) {
          SCOPED_TRACE(shape_name(m, n, k));
          Input x(random_acts(m, k, rng), m, k);
          const std::vector<float> y = run_packed(p, x);
          const double terms = acts == Acts::kFloat ? static_cast<double>(k) : 2.0 * (static_cast<double>(k / kActBlock) + 8);
          for (int64_t mi = 0; mi < m; ++mi) {
            for (int64_t ni = 0; ni < n; ++ni) {
              double exact = 0, mag = 0;
              for (int64_t ki = 0; ki < k; ++ki) {
                const double a = x.seen(acts, mi, ki);
                const auto at = static_cast<size_t>(ni * k + ki);
                exact += wf[at] * a;
                mag += (std::fabs(wf[at]) + off[at]) * std::fabs(a);
              }
              ASSERT_NEAR(y[static_cast<size_t>(mi * n + ni)], exact, terms * kFloatEps * mag + 1e-30)
                  << "m " << mi << " n " << ni;
            }
          }
        }
      }
    }
  }
}

// Rows split over 1, 2 or 3 OpenMP threads on 16-row boundaries, any token count (each token
// alone), and an input the kernels lay out for their passes themselves give the bits of one call
// over everything: each output's sum has a fixed order.
TEST_P(Packed, SameBitsForAnyRowSplitAndTokenCount) {
  const TensorType t = GetParam().type;
  std::mt19937 rng(23);
  const int64_t k = test_cols(t).back();
  for (const auto& [m, n] : {std::pair<int64_t, int64_t>{1, 37}, {5, 64}, {17, 37}}) {
    SCOPED_TRACE(shape_name(m, n, k));
    const std::vector<uint8_t> w = test::random_weights(t, n, k, rng);
    const cpu::PackedWeight p = pack(t, w, n, k);
    Input x(random_acts(m, k, rng), m, k);
    const std::vector<float> whole = run_packed(p, x);
    const int64_t groups = (n + kPackRows - 1) / kPackRows;
    for (int threads : {1, 2, 3}) {
      std::vector<float> y(whole.size(), NAN);
      const cpu::PackedInput in = x.packed();
#pragma omp parallel num_threads(threads)
      {
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = std::min(n, groups * th / nt * kPackRows), n1 = std::min(n, groups * (th + 1) / nt * kPackRows);
        if (n0 < n1) cpu::gemm_packed(p, n0, n1, in, m, y.data(), n);
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), y.data(), y.size() * sizeof(float))) << threads << " threads";
    }
    {
      std::vector<float> y(whole.size(), NAN);
      cpu::PackedInput rows_only = x.packed();
      rows_only.passes = {};
      rows_only.super_passes = {};
      cpu::gemm_packed(p, 0, n, rows_only, m, y.data(), n);
      ASSERT_EQ(0, std::memcmp(whole.data(), y.data(), y.size() * sizeof(float))) << "passes laid out by the kernels";
    }
    for (int64_t mi = 0; mi < m; ++mi) {  // token mi alone, one 16-row group per call
      std::vector<float> y(static_cast<size_t>(n), NAN);
      for (int64_t ni = 0; ni < n; ni += kPackRows) cpu::gemm_packed(p, ni, std::min(n, ni + kPackRows), x.row(mi), 1, y.data(), n);
      ASSERT_EQ(0, std::memcmp(whole.data() + mi * n, y.data(), y.size() * sizeof(float))) << "token " << mi;
    }
  }
}

// A matrix whose row count is not a multiple of 16: the last group is padded, its extra rows are
// never stored, and its real rows get the bits they get in a matrix with more rows after them.
TEST_P(Packed, RowsNotAMultipleOf16) {
  const TensorType t = GetParam().type;
  std::mt19937 rng(31);
  const int64_t k = test_cols(t).front(), m = 3;
  const std::vector<uint8_t> w = test::random_weights(t, 32, k, rng);
  Input x(random_acts(m, k, rng), m, k);
  const cpu::PackedWeight full = pack(t, w, 32, k);
  const std::vector<float> y_full = run_packed(full, x);
  for (int64_t rows : {1, 5, 15, 17}) {
    SCOPED_TRACE(rows);
    const cpu::PackedWeight p = pack(t, w, rows, k);
    EXPECT_EQ(p.groups(), (rows + kPackRows - 1) / kPackRows);
    EXPECT_EQ(p.bytes() % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data.get()) % 64, 0u);
    std::vector<float> y(static_cast<size_t>(m * (rows + 1)), NAN);  // one guard column per token
    cpu::gemm_packed(p, 0, rows, x.packed(), m, y.data(), rows + 1);
    for (int64_t mi = 0; mi < m; ++mi) {
      for (int64_t n = 0; n < rows; ++n) {
        ASSERT_EQ(y[static_cast<size_t>(mi * (rows + 1) + n)], y_full[static_cast<size_t>(mi * 32 + n)]) << "m " << mi << " n " << n;
      }
      ASSERT_TRUE(std::isnan(y[static_cast<size_t>(mi * (rows + 1) + rows)])) << "stored past row " << rows;
    }
  }
}

// The packed copy reads back as the file's weights (the sgemm path and the memory the file's
// pages gave back depend on it), within a rounding of the terms of each weight's formula.
TEST_P(Packed, ReadsBackAsTheFileDefines) {
  const TensorType t = GetParam().type;
  std::mt19937 rng(41);
  for (int64_t k : test_cols(t)) {
    const int64_t n = 21;
    const std::vector<uint8_t> w = test::random_weights(t, n, k, rng);
    const std::vector<float> wf = test::dequantize(t, w, n, k);
    const std::vector<float> off = test::offset_magnitudes(t, w, n, k);
    const cpu::PackedWeight p = pack(t, w, n, k);
    std::vector<float> back(static_cast<size_t>(n * k));
    cpu::dequantize_packed(p, 0, n, back.data());
    for (size_t i = 0; i < back.size(); ++i) {
      ASSERT_NEAR(back[i], wf[i], 2 * kFloatEps * (std::fabs(wf[i]) + off[i])) << "row " << i / static_cast<size_t>(k) << " col " << i % static_cast<size_t>(k);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Packed, ::testing::ValuesIn(all_formats()), [](const auto& info) { return info.param.name; });

// i4s-g32-f16 and i4a-g32-f16 have Q4_0's and Q4_1's layouts: the same bytes give the same bits.
// The scales' inline conversion against the library's, on every one of the 65,536 fp16 values
// (signed zeros, subnormals, infinities and NaN payloads included), bit for bit.
TEST(PackedScales, InlineFp16ConversionsAreTheLibrarys) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float inline_value = cpu::fp16_bits_to_fp32(static_cast<uint16_t>(h));
    const float library_value = fp16_to_fp32(static_cast<f16_bits>(h));
    uint32_t a = 0, b = 0;
    std::memcpy(&a, &inline_value, 4);
    std::memcpy(&b, &library_value, 4);
    ASSERT_EQ(a, b) << "fp16 bits 0x" << std::hex << h;
  }
  for (uint32_t first = 0; first <= 0xFFFF; first += 16) {  // 16 at a time, as the tile products read them
    uint16_t halves[16];
    for (uint32_t i = 0; i < 16; ++i) halves[i] = static_cast<uint16_t>(first + i);
    float values[16];
    cpu::fp16x16_to_fp32(reinterpret_cast<const uint8_t*>(halves), values);
    for (uint32_t i = 0; i < 16; ++i) {
      const float library_value = fp16_to_fp32(static_cast<f16_bits>(first + i));
      ASSERT_EQ(std::memcmp(&values[i], &library_value, 4), 0) << "fp16 bits 0x" << std::hex << first + i << " (16 at a time)";
    }
  }
}

TEST(PackedInt4, G32Fp16MatchesQ4Formats) {
  std::mt19937 rng(7);
  const int64_t n = 33, k = 576, m = 5;
  Input x(random_acts(m, k, rng), m, k);
  for (const bool asym : {false, true}) {
    const TensorType q4 = asym ? TensorType::Q4_1 : TensorType::Q4_0;
    const auto i4 = static_cast<TensorType>(int4_type_id({32, asym, ScaleType::kF16}));
    const std::vector<uint8_t> w = test::random_weights(q4, n, k, rng);
    const std::vector<float> a = run_packed(pack(q4, w, n, k), x), b = run_packed(pack(i4, w, n, k), x);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << (asym ? "i4a" : "i4s");
  }
}

// Every code of the two code books, alone in a whole matrix, against activations that quantize to
// +127 and -127 everywhere: the largest integer sums the kernels' int16 lanes hold before they
// widen them (MXFP4 is looked up as its values + 12 without VNNI, so 4 quads of 2 x 24 x 127
// fill a lane to 24,384; 8 would overflow it), each output an exact sum of K/32 equal blocks.
TEST(PackedCodeBooks, EveryCodeAgainstTheLargestActivations) {
  const int64_t n = 16, k = 1536, m = 5;
  std::vector<float> values(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) values[static_cast<size_t>(i)] = (i / k) % 2 == 0 ? 1.0f : -1.0f;
  Input x(values, m, k);
  for (const TensorType t : {TensorType::MXFP4, TensorType::IQ4_NL}) {
    const bool mxfp4 = t == TensorType::MXFP4;
    const size_t block_bytes = mxfp4 ? sizeof(BlockMXFP4) : sizeof(BlockIQ4_NL);
    for (int code = 0; code < 16; ++code) {
      std::vector<uint8_t> w(static_cast<size_t>(n * k / 32) * block_bytes);
      for (size_t b = 0; b < w.size(); b += block_bytes) {
        if (mxfp4) {
          w[b] = 127;  // 2^-1, which kMxfp4Values' doubled values undo
        } else {
          w[b] = 0x00, w[b + 1] = 0x3C;  // fp16 1.0
        }
        std::fill(w.begin() + static_cast<ptrdiff_t>(b + block_bytes - 16), w.begin() + static_cast<ptrdiff_t>(b + block_bytes),
                  static_cast<uint8_t>(code * 0x11));
      }
      const double weight = mxfp4 ? kMxfp4Values[code] / 2.0 : kIq4nlValues[code];
      for (int64_t target : test::packed_kernel_targets()) {
        SCOPED_TRACE(hwy::TargetName(target));
        const test::OnlyTarget only(target);
        const std::vector<float> y = run_packed(pack(t, w, n, k), x);
        for (int64_t mi = 0; mi < m; ++mi) {
          const double exact = weight * static_cast<double>(k) * x.seen(Acts::kPer32, mi, 0);
          for (int64_t ni = 0; ni < n; ++ni) {
            ASSERT_NEAR(y[static_cast<size_t>(mi * n + ni)], exact, 1e-5 * std::fabs(exact) + 1e-30)
                << (mxfp4 ? "MXFP4" : "IQ4_NL") << " code " << code << " token " << mi << " row " << ni;
          }
        }
      }
    }
  }
}

// The per-256 activations against their definition: one scale per 256 (max|x| / 127), values
// rounded to nearest, and exact integer sums per 16 and 32.
TEST(QuantizeActsSuper, MatchesDefinition) {
  std::mt19937 rng(9);
  const int64_t m = 3, k = 768;
  Input x(random_acts(m, k, rng), m, k);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
      float amax = 0;
      for (int64_t i = 0; i < kSuperBlock; ++i) amax = std::max(amax, std::fabs(x.x[static_cast<size_t>(t * k + b * kSuperBlock + i)]));
      const float d = x.d256[static_cast<size_t>(t * (k / kSuperBlock) + b)];
      ASSERT_FLOAT_EQ(d, amax / 127.0f);
      for (int64_t i = 0; i < kSuperBlock; ++i) {
        const auto at = static_cast<size_t>(t * k + b * kSuperBlock + i);
        const float want = amax > 0 ? std::nearbyint(x.x[at] * (127.0f / amax)) : 0.0f;
        ASSERT_EQ(x.q256[at], static_cast<int8_t>(want)) << "t " << t << " i " << b * kSuperBlock + i;
      }
    }
    for (int64_t j = 0; j < k / 16; ++j) {
      int32_t sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += x.q256[static_cast<size_t>(t * k + 16 * j + i)];
      ASSERT_EQ(x.sum16[static_cast<size_t>(t * (k / 16) + j)], sum);
      if (j % 2 == 1) {
        ASSERT_EQ(x.sum32[static_cast<size_t>(t * (k / 32) + j / 2)], sum + x.sum16[static_cast<size_t>(t * (k / 16) + j - 1)]);
      }
    }
  }
}

}  // namespace
}  // namespace ringlm
