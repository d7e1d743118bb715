// The CPU backend's fused entry points against their definitions:
//  - matmul_many with RMSNorm fused into the input preparation: against a float64 product of
//    the normalised input, within the error the compute type allows;
//  - matmul_many over several weights (the fused QKV pass): exactly the bits of separate calls;
//  - matmul_glu (SiLU): against silu(gate x) * (up x) in float64;
//  - all of them: the same bits with 1 and 2 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/cpu_backend.h"

namespace ringlm {
namespace {

constexpr float kEps = 1e-5f;
constexpr int64_t kBlock = 32;

struct Matrix {
  TensorType type;
  int64_t rows, cols;
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // dequantized, row-major
};

// Random weights of `type`: random bytes with sane fp16 scales (block formats) or random halves.
Matrix random_matrix(TensorType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  Matrix m{type, rows, cols, std::vector<uint8_t>(row_bytes(type, cols) * static_cast<size_t>(rows)), {}};
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const auto traits = *type_traits(static_cast<uint32_t>(type));
  if (traits.block_elems == 1) {  // F16: every element a random half in [-0.5, 0.5]
    for (size_t i = 0; i + 1 < m.bytes.size(); i += 2) {
      const f16_bits h = fp32_to_fp16(scale(rng) * 10);
      std::memcpy(&m.bytes[i], &h, 2);
    }
  } else {
    for (auto& b : m.bytes) b = static_cast<uint8_t>(rng());
    for (size_t off = 0; off < m.bytes.size(); off += traits.block_bytes) {
      const f16_bits d = fp32_to_fp16(scale(rng));
      std::memcpy(&m.bytes[off], &d, 2);
      if (type == TensorType::Q4_1) {
        const f16_bits mn = fp32_to_fp16(4 * scale(rng));
        std::memcpy(&m.bytes[off + 2], &mn, 2);
      }
    }
  }
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(type, m.bytes.data() + static_cast<size_t>(r) * row_bytes(type, cols), row.data(), cols);
    m.values.insert(m.values.end(), row.begin(), row.end());
  }
  return m;
}

std::vector<float> random_vector(int64_t n, float mean, float sd, std::mt19937& rng) {
  std::normal_distribution<float> normal(mean, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// RMSNorm in float64, straight from its definition.
std::vector<double> rms_normalise(const std::vector<float>& x, const std::vector<float>& weight, int64_t m, int64_t k) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < m; ++r) {
    double sum_sq = 0;
    for (int64_t i = 0; i < k; ++i) sum_sq += static_cast<double>(x[static_cast<size_t>(r * k + i)]) * x[static_cast<size_t>(r * k + i)];
    const double inv = 1.0 / std::sqrt(sum_sq / static_cast<double>(k) + kEps);
    for (int64_t i = 0; i < k; ++i) out[static_cast<size_t>(r * k + i)] = x[static_cast<size_t>(r * k + i)] * inv * weight[static_cast<size_t>(i)];
  }
  return out;
}

// The exact product of row r of the input with row n of the weights, and the error the backend
// may make on it: int8 compute rounds each activation by at most max|x_block| / 254; both
// compute types then add float rounding, bounded loosely by 1e-5 of the sum of magnitudes.
struct Expected {
  double value, tolerance;
};
Expected expected(const std::vector<double>& x, const Matrix& w, int64_t r, int64_t n, ComputeType compute) {
  const int64_t k = w.cols;
  double value = 0, mag = 0, quant_err = 0;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    double amax = 0, wabs = 0;
    for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) {
      const double xi = x[static_cast<size_t>(r * k + i)], wi = w.values[static_cast<size_t>(n * k + i)];
      value += xi * wi;
      mag += std::fabs(xi * wi) + 0.4 * std::fabs(xi);  // 0.4 >= 8 * max|scale|: the kernels' offset terms
      amax = std::max(amax, std::fabs(xi));
      wabs += std::fabs(wi);
    }
    quant_err += amax / 254 * wabs;
  }
  const bool int8 = compute == ComputeType::kInt8 && w.type != TensorType::F16;
  // A float input rounded once more than the float64 reference (the fused normalisation) moves
  // each product by a relative 2^-23 at most: inside the 1e-5 term.
  return {value, (int8 ? quant_err * 1.001 : 0.0) + 1e-5 * mag + 1e-30};
}

struct Prepared {
  std::vector<std::unique_ptr<PreparedWeight>> owned;
  std::vector<const PreparedWeight*> ptrs;
};
Prepared prepare_all(Backend& backend, const std::vector<Matrix>& ws) {
  Prepared p;
  for (const Matrix& w : ws) {
    p.owned.push_back(backend.prepare({"w", w.type, w.rows, w.cols, w.bytes.data()}));
    p.ptrs.push_back(p.owned.back().get());
  }
  return p;
}

// Outputs of matmul_many on `ws` (one call), concatenated.
std::vector<std::vector<float>> run_many(Backend& backend, const std::vector<Matrix>& ws, const MatmulInput& in) {
  Prepared p = prepare_all(backend, ws);
  std::vector<std::vector<float>> ys;
  std::vector<float*> ptrs;
  for (const Matrix& w : ws) ys.emplace_back(static_cast<size_t>(in.n_tokens * w.rows), NAN);
  for (auto& y : ys) ptrs.push_back(y.data());
  backend.matmul_many(p.ptrs, in, ptrs);
  return ys;
}

// (Prepared weights point into the matrices' bytes: they must outlive the call.)
std::vector<float> run_swiglu(Backend& backend, const Matrix& gate, const Matrix& up, const MatmulInput& in) {
  Prepared p;
  for (const Matrix* w : {&gate, &up}) {
    p.owned.push_back(backend.prepare({"w", w->type, w->rows, w->cols, w->bytes.data()}));
    p.ptrs.push_back(p.owned.back().get());
  }
  std::vector<float> out(static_cast<size_t>(in.n_tokens * gate.rows), NAN);
  backend.matmul_glu(*p.ptrs[0], *p.ptrs[1], in, Activation::kSilu, out.data());
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  ComputeType compute;
  int64_t m;
};
class Fused : public ::testing::TestWithParam<Case> {};

// Mixed formats in one call: the int8 kernels (Q4_0, Q4_1, Q8_0) and the fp32 path (F16).
std::vector<Matrix> qkv_like(int64_t k, std::mt19937& rng) {
  return {random_matrix(TensorType::Q4_1, 37, k, rng), random_matrix(TensorType::Q4_0, 12, k, rng),
          random_matrix(TensorType::Q8_0, 12, k, rng), random_matrix(TensorType::F16, 5, k, rng)};
}

TEST_P(Fused, NormalisedManyMatchesFloat64Definition) {
  const auto [compute, m] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(m) * 7 + 1);
  const int64_t k = 192;
  const std::vector<Matrix> ws = qkv_like(k, rng);
  // Inputs far from unit scale, so a missing or wrong normalisation cannot pass.
  const std::vector<float> x = random_vector(m * k, 3.0f, 40.0f, rng);
  const std::vector<float> norm = random_vector(k, 1.0f, 0.5f, rng);
  auto backend = make_cpu_backend(2, compute);
  const auto ys = run_many(*backend, ws, MatmulInput{x.data(), m, norm.data(), kEps});
  const std::vector<double> xn = rms_normalise(x, norm, m, k);
  for (size_t i = 0; i < ws.size(); ++i) {
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t n = 0; n < ws[i].rows; ++n) {
        const Expected e = expected(xn, ws[i], r, n, compute);
        ASSERT_NEAR(ys[i][static_cast<size_t>(r * ws[i].rows + n)], e.value, e.tolerance)
            << "weight " << i << " token " << r << " row " << n;
      }
    }
  }
}

// One fused call over several weights gives exactly the bits of one call per weight, with 1 or
// 2 threads: fusing changes the scheduling, never the arithmetic.
TEST_P(Fused, ManyGivesTheBitsOfSeparateCallsForAnyThreadCount) {
  const auto [compute, m] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(m) * 13 + 2);
  const int64_t k = 256;
  const std::vector<Matrix> ws = qkv_like(k, rng);
  const std::vector<float> x = random_vector(m * k, 0.0f, 2.0f, rng);
  const std::vector<float> norm = random_vector(k, 1.0f, 0.3f, rng);
  const MatmulInput in{x.data(), m, norm.data(), kEps};
  auto one = make_cpu_backend(1, compute);
  auto two = make_cpu_backend(2, compute);
  const auto fused = run_many(*two, ws, in);
  const auto fused_one_thread = run_many(*one, ws, in);
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto alone = run_many(*two, {ws[i]}, in);
    EXPECT_TRUE(same_bits(fused[i], alone[0])) << "weight " << i;
    EXPECT_TRUE(same_bits(fused[i], fused_one_thread[i])) << "weight " << i;
  }
}

// silu(g) * u with g, u the products of the normalised input: the error of g and u (bounded as
// above) reaches the output through |d silu / dg| <= 1.1 and |silu(g)|.
TEST_P(Fused, SwigluMatchesFloat64DefinitionForAnyThreadCount) {
  const auto [compute, m] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(m) * 31 + 3);
  const int64_t k = 160, ff = 45;
  for (TensorType type : {TensorType::Q4_1, TensorType::Q8_0, TensorType::F16}) {
    SCOPED_TRACE(type_traits(static_cast<uint32_t>(type))->name);
    const Matrix gate = random_matrix(type, ff, k, rng), up = random_matrix(type, ff, k, rng);
    const std::vector<float> x = random_vector(m * k, -1.0f, 5.0f, rng);
    const std::vector<float> norm = random_vector(k, 1.0f, 0.5f, rng);
    const MatmulInput in{x.data(), m, norm.data(), kEps};
    auto one = make_cpu_backend(1, compute);
    auto two = make_cpu_backend(2, compute);
    const std::vector<float> out = run_swiglu(*two, gate, up, in);
    EXPECT_TRUE(same_bits(out, run_swiglu(*one, gate, up, in)));
    const std::vector<double> xn = rms_normalise(x, norm, m, k);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t n = 0; n < ff; ++n) {
        const Expected g = expected(xn, gate, r, n, compute), u = expected(xn, up, r, n, compute);
        const double silu_g = g.value / (1 + std::exp(-g.value));
        const double tol = 1.1 * g.tolerance * (std::fabs(u.value) + u.tolerance) + (std::fabs(silu_g) + 1.1 * g.tolerance) * u.tolerance +
                           1e-6 * std::fabs(silu_g * u.value) + 1e-30;
        ASSERT_NEAR(out[static_cast<size_t>(r * ff + n)], silu_g * u.value, tol) << "token " << r << " row " << n;
      }
    }
  }
}

// Token counts on both sides of every path switch: decode (1), flat GEMM (2..16), the int8
// kernels with threads quantizing (17..47), and the sgemm prefill path (48 and up).
INSTANTIATE_TEST_SUITE_P(Paths, Fused,
                         ::testing::Values(Case{ComputeType::kInt8, 1}, Case{ComputeType::kInt8, 3},
                                           Case{ComputeType::kInt8, 17}, Case{ComputeType::kInt8, 64},
                                           Case{ComputeType::kFp32, 1}, Case{ComputeType::kFp32, 20}),
                         [](const auto& info) {
                           return std::string(info.param.compute == ComputeType::kInt8 ? "int8" : "fp32") + "_M" +
                                  std::to_string(info.param.m);
                         });

TEST(FusedErrors, ManyRejectsWeightsOfDifferentWidths) {
  std::mt19937 rng(9);
  const std::vector<Matrix> ws = {random_matrix(TensorType::Q4_0, 4, 64, rng), random_matrix(TensorType::Q4_0, 4, 96, rng)};
  const std::vector<float> x(96, 1.0f);
  auto backend = make_cpu_backend(1);
  EXPECT_THROW(run_many(*backend, ws, MatmulInput{x.data(), 1, nullptr, 0.0f}), std::invalid_argument);
}

}  // namespace
}  // namespace ringlm
