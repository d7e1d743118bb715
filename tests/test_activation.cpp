// silu_mul and gelu_tanh_mul against their definitions in float64, x / (1 + exp(-x)) * u and
// x / 2 * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) * u, over the range activations take (and
// past it: large |x| must saturate to x * u and 0, never NaN), on every SIMD target the CPU runs,
// and the same element computed at every offset of a vector and in the tail gives the same float.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backends/cpu/activation.h"
#include "hwy/targets.h"
#include "tests/only_target.h"

namespace ringlm::cpu {
namespace {

double silu_mul_f64(float g, float u) { return g / (1.0 + std::exp(-static_cast<double>(g))) * u; }

// 1001 gates over the range activations take, with 0, +-100 and a tiny negative among them, and
// their up projections.
void random_inputs(unsigned seed, std::vector<float>& gate, std::vector<float>& up) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-20.0f, 20.0f);
  gate.resize(1001), up.resize(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    gate[i] = uniform(rng);
    up[i] = uniform(rng) / 10.0f;
  }
  gate[0] = 0.0f, gate[1] = -100.0f, gate[2] = 100.0f, gate[3] = -1e-30f;
}

TEST(SiluMul, MatchesTheFloat64Definition) {
  std::vector<float> gate, up;
  random_inputs(7, gate, up);
  std::vector<float> out = gate;
  silu_mul(out.data(), up.data(), static_cast<int64_t>(out.size()));
  for (size_t i = 0; i < out.size(); ++i) {
    const double want = silu_mul_f64(gate[i], up[i]);
    ASSERT_TRUE(std::isfinite(out[i])) << "index " << i << " gate " << gate[i];
    // A few ulp of the result (exp, one division, one product), plus an absolute floor near 0.
    ASSERT_NEAR(out[i], want, 4e-7 * std::fabs(want) + 1e-30) << "index " << i << " gate " << gate[i];
  }
}

double gelu_tanh_mul_f64(float g, float u) {
  const double x = g;
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u;
}

TEST(GeluTanhMul, MatchesTheFloat64DefinitionOnEveryTarget) {
  std::vector<float> gate, up;
  random_inputs(9, gate, up);
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const test::OnlyTarget only(target);
    std::vector<float> out = gate;
    glu(Activation::kGeluTanh, out.data(), up.data(), static_cast<int64_t>(out.size()));
    for (size_t i = 0; i < out.size(); ++i) {
      const double want = gelu_tanh_mul_f64(gate[i], up[i]);
      ASSERT_TRUE(std::isfinite(out[i])) << "index " << i << " gate " << gate[i];
      // A few ulp of the result, and near x = -3..-10, where 1 + tanh cancels, of the magnitude
      // x * u the terms have.
      ASSERT_NEAR(out[i], want, 1e-6 * std::fabs(want) + 1e-6 * std::fabs(gate[i] * up[i])) << "index " << i << " gate " << gate[i];
    }
  }
}

TEST(SiluMul, AnElementDoesNotDependOnWhereItSits) {
  const std::vector<float> gate = {-3.5f, -0.25f, 0.5f, 1.75f, 2.0f, 7.0f, -9.0f, 0.125f, 3.0f, -1.0f, 4.5f};
  const std::vector<float> up(gate.size(), 1.5f);
  std::vector<float> all = gate;
  silu_mul(all.data(), up.data(), static_cast<int64_t>(all.size()));
  for (size_t start = 0; start < gate.size(); ++start) {
    for (size_t len = 1; start + len <= gate.size(); ++len) {
      std::vector<float> part(gate.begin() + static_cast<long>(start), gate.begin() + static_cast<long>(start + len));
      silu_mul(part.data(), up.data(), static_cast<int64_t>(len));
      for (size_t i = 0; i < len; ++i) ASSERT_EQ(part[i], all[start + i]) << "start " << start << " length " << len;
    }
  }
}

}  // namespace
}  // namespace ringlm::cpu
