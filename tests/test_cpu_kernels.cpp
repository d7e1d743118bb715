// The CPU backend's products against scalar references: activation quantization against its
// definition, and both compute types on every weight type against the plain fp32 product, for
// any thread count. (The packed kernels themselves, on every SIMD target, are in
// test_cpu_packed.cpp.)
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/quantize_acts.h"
#include "hwy/targets.h"
#include "quant/int4.h"
#include "tests/packed_input.h"
#include "tests/weight_formats.h"

namespace ringlm {
namespace {

using cpu::kActBlock;
using test::random_acts;

constexpr double kFloatEps = 1.0 / (1 << 24);  // unit roundoff of fp32
constexpr int64_t kAlwaysInt8 = int64_t{1} << 40;  // keeps large M on the int8 kernels

// The int8 backend as the kernel tests want it: every M through the integer kernels.
std::unique_ptr<Backend> int8_backend(int n_threads) {
  return make_cpu_backend(n_threads, ComputeType::kInt8, kAlwaysInt8);
}

struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  cpu::QuantizedActs view(int64_t k) { return {q.data(), d.data(), s.data(), sum.data(), k}; }
};

Quantized quantize(const std::vector<float>& x, int64_t m, int64_t k) {
  Quantized out{std::vector<int8_t>(x.size()), std::vector<float>(x.size() / kActBlock),
                std::vector<float>(x.size() / kActBlock), std::vector<int32_t>(x.size() / kActBlock)};
  cpu::quantize_acts(x.data(), 0, m, out.view(k));
  return out;
}

std::vector<float> run(Backend& backend, TensorType type, const std::vector<uint8_t>& w, int64_t rows, int64_t cols,
                       const std::vector<float>& x, int64_t m) {
  auto prepared = backend.prepare({"w", type, rows, cols, w.data()});
  std::vector<float> y(static_cast<size_t>(m * rows), NAN);
  backend.matmul(*prepared, x.data(), m, y.data());
  return y;
}

// ---------------------------------------------------------------------------------------------

TEST(QuantizeActs, MatchesDefinition) {
  std::mt19937 rng(7);
  const int64_t m = 3, k = 576;
  std::vector<float> x = random_acts(m, k, rng);
  x[5] = 1e-30f;  // tiny values and exact ties must follow the same rule
  x[40] = 127.0f;
  x[41] = 0.5f;
  Quantized q = quantize(x, m, k);
  const int64_t nb = k / kActBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = &x[static_cast<size_t>(r * k + b * kActBlock)];
      float amax = 0.0f;
      for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      ASSERT_EQ(q.d[static_cast<size_t>(r * nb + b)], d);
      int sum = 0;
      for (int i = 0; i < kActBlock; ++i) {
        const int8_t qi = q.q[static_cast<size_t>(r * k + b * kActBlock + i)];
        ASSERT_EQ(qi, static_cast<int>(std::nearbyint(xb[i] * inv))) << "row " << r << " block " << b << " i " << i;
        ASSERT_LE(std::abs(qi), 127);
        // Round to nearest: the error is at most half a step (and a float rounding of x * inv).
        ASSERT_LE(std::fabs(xb[i] - d * qi), 0.5f * d * (1 + 1e-5f) + 1e-38f);
        sum += qi;
      }
      ASSERT_EQ(q.s[static_cast<size_t>(r * nb + b)], d * static_cast<float>(sum));
      ASSERT_EQ(q.sum[static_cast<size_t>(r * nb + b)], sum);
    }
  }
}

// ---------------------------------------------------------------------------------------------

struct Shape {
  int64_t m, n, k;
};

std::string shape_name(const Shape& s) {
  std::ostringstream out;  // (not operator+: GCC 12 reports a false -Wrestrict on it)
  out << "M" << s.m << " N" << s.n << " K" << s.k;
  return out.str();
}


class PackedBackend : public ::testing::TestWithParam<TensorType> {};

// Against the fp32 product of the unquantized activations: int8 rounding moves each activation
// by at most d/2 = max|x over its quantization block| / 254 (blocks of 32, or 256 for the
// K-quants and IQ4_XS; float weights meet the activations unrounded), so |error| <= sum_k
// max|x_block(k)| / 254 * |w_k| plus the float rounding (bounded loosely here by 1e-5 of the
// magnitude, the offsets included). Both with the packed kernels for every M and with the
// default crossover (large M through sgemm on the dequantized packed copy, which only has float
// rounding, within the same bound).
TEST_P(PackedBackend, CloseToFp32Product) {
  const TensorType type = GetParam();
  const test::Acts acts = test::acts_of(type);
  const int64_t block = acts == test::Acts::kPer256 ? 256 : kActBlock;
  std::mt19937 rng(static_cast<unsigned>(type) + 101);
  auto forced = int8_backend(1);
  auto by_default = make_cpu_backend(1, ComputeType::kInt8);
  const bool super = acts == test::Acts::kPer256;
  const std::vector<Shape> shapes = super ? std::vector<Shape>{{1, 33, 256}, {7, 64, 1536}, {64, 3, 512}, {300, 17, 256}}
                                          : std::vector<Shape>{{1, 33, 640}, {7, 64, 1536}, {64, 3, 128}, {300, 33, 128}};
  for (Backend* backend : {forced.get(), by_default.get()}) {
    for (const Shape& s : shapes) {
      SCOPED_TRACE(shape_name(s));
      const std::vector<uint8_t> w = test::random_weights(type, s.n, s.k, rng);
      const std::vector<float> x = random_acts(s.m, s.k, rng);
      const std::vector<float> wf = test::dequantize(type, w, s.n, s.k);
      const std::vector<float> off = test::offset_magnitudes(type, w, s.n, s.k);
      const std::vector<float> y = run(*backend, type, w, s.n, s.k, x, s.m);
      for (int64_t m = 0; m < s.m; ++m) {
        for (int64_t n = 0; n < s.n; ++n) {
          double exact = 0, bound = 0, mag = 0;
          for (int64_t b = 0; b < s.k / block; ++b) {
            double amax = 0, wabs = 0;
            for (int64_t k = b * block; k < (b + 1) * block; ++k) {
              const auto at = static_cast<size_t>(n * s.k + k);
              const double xk = x[static_cast<size_t>(m * s.k + k)], wk = wf[at];
              exact += xk * wk;
              mag += (std::fabs(wk) + off[at]) * std::fabs(xk);
              amax = std::max(amax, std::fabs(xk));
              wabs += std::fabs(wk);
            }
            if (acts != test::Acts::kFloat) bound += amax / 254 * wabs;
          }
          ASSERT_NEAR(y[static_cast<size_t>(m * s.n + n)], exact, bound * 1.001 + 1e-5 * mag + 1e-30)
              << "m " << m << " n " << n;
        }
      }
    }
  }
}

// Each output is one thread's fixed-order sum: 1 and 2 threads give the same bits.
TEST_P(PackedBackend, SameResultForAnyThreadCount) {
  const TensorType type = GetParam();
  std::mt19937 rng(5);
  auto one = int8_backend(1);
  auto two = int8_backend(2);
  for (const Shape& s : {Shape{1, 33, 768}, Shape{3, 1, 256}, Shape{16, 64, 1536}, Shape{17, 33, 768},
                         Shape{300, 64, 512}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = test::random_weights(type, s.n, s.k, rng);
    const std::vector<float> x = random_acts(s.m, s.k, rng);
    const std::vector<float> y1 = run(*one, type, w, s.n, s.k, x, s.m);
    const std::vector<float> y2 = run(*two, type, w, s.n, s.k, x, s.m);
    ASSERT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
  }
}

std::vector<TensorType> packed_type_ids() {
  std::vector<TensorType> out;
  for (const auto& [type, name] : test::packed_types()) out.push_back(type);
  return out;
}
std::string packed_type_name(TensorType t) {
  for (const auto& [type, name] : test::packed_types()) {
    if (type == t) return name;
  }
  return "unknown";
}

INSTANTIATE_TEST_SUITE_P(Formats, PackedBackend, ::testing::ValuesIn(packed_type_ids()),
                         [](const auto& info) { return packed_type_name(info.param); });

// ---------------------------------------------------------------------------------------------
// The fp32 paths (row dot products for small M, dequantized tiles through sgemm for large M):
// only float rounding, bounded by K * u * sum|x w| (sgemm and the 8-lane dot both sum at most K
// terms sequentially per lane).

class Fp32Path : public ::testing::TestWithParam<TensorType> {};

TEST_P(Fp32Path, MatchesDoubleProductForAnyThreadCount) {
  const TensorType type = GetParam();
  std::mt19937 rng(3);
  auto one = make_cpu_backend(1, ComputeType::kFp32);
  auto two = make_cpu_backend(2, ComputeType::kFp32);
  for (const Shape& s : {Shape{1, 33, 768}, Shape{8, 3, 256}, Shape{16, 64, 1536}, Shape{300, 33, 256},
                         Shape{64, 200, 512}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = test::random_weights(type, s.n, s.k, rng);
    const std::vector<float> x = random_acts(s.m, s.k, rng);
    const std::vector<float> wf = test::dequantize(type, w, s.n, s.k);
    const std::vector<float> y1 = run(*one, type, w, s.n, s.k, x, s.m);
    const std::vector<float> y2 = run(*two, type, w, s.n, s.k, x, s.m);
    ASSERT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
    for (int64_t m = 0; m < s.m; ++m) {
      for (int64_t n = 0; n < s.n; ++n) {
        double exact = 0, mag = 0;
        for (int64_t k = 0; k < s.k; ++k) {
          const double p = static_cast<double>(x[static_cast<size_t>(m * s.k + k)]) * wf[static_cast<size_t>(n * s.k + k)];
          exact += p;
          mag += std::fabs(p);
        }
        ASSERT_NEAR(y1[static_cast<size_t>(m * s.n + n)], exact, 2 * static_cast<double>(s.k) * kFloatEps * mag + 1e-30);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp32Path, ::testing::ValuesIn(packed_type_ids()),
                         [](const auto& info) { return packed_type_name(info.param); });

}  // namespace
}  // namespace ringlm
