// The CPU backend's kernels against scalar references: activation quantization against its
// definition, the int8 GEMV/GEMM on Q4_0, Q4_1, Q8_0 and ringlm's 12 INT4 formats against an
// exact double product of the dequantized weights and the *quantized* activations, and both
// compute types against the plain fp32 product.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/int8_kernels.h"
#include "hwy/targets.h"
#include "quant/int4.h"

namespace ringlm {
namespace {

using cpu::kActBlock;

constexpr double kFloatEps = 1.0 / (1 << 24);  // unit roundoff of fp32
constexpr int64_t kAlwaysInt8 = int64_t{1} << 40;  // keeps large M on the int8 kernels

// The int8 backend as the kernel tests want it: every M through the integer kernels.
std::unique_ptr<Backend> int8_backend(int n_threads) {
  return make_cpu_backend(n_threads, ComputeType::kInt8, kAlwaysInt8);
}

// Random blocks of a Q format: random codes, scales of either sign, Q4_1 mins of either sign.
std::vector<uint8_t> random_q_weights(TensorType type, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(row_bytes(type, cols) * static_cast<size_t>(rows));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const size_t block_bytes = type_traits(static_cast<uint32_t>(type))->block_bytes;
  for (size_t off = 0; off < bytes.size(); off += block_bytes) {
    const f16_bits d = fp32_to_fp16(scale(rng));
    std::memcpy(&bytes[off], &d, 2);
    if (type == TensorType::Q4_1) {
      const f16_bits m = fp32_to_fp16(4 * scale(rng));
      std::memcpy(&bytes[off + 2], &m, 2);
    }
  }
  return bytes;
}

// Activations with varied magnitudes per block, and an all-zero block when K allows.
std::vector<float> random_acts(int64_t m, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) {
    const int64_t block = i / kActBlock;
    x[static_cast<size_t>(i)] = normal(rng) * static_cast<float>(1 + block % 5) * (block % 7 == 3 ? 0.0f : 1.0f);
  }
  return x;
}

struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  cpu::QuantizedActs view(int64_t k) { return {q.data(), d.data(), s.data(), k}; }
};

Quantized quantize(const std::vector<float>& x, int64_t m, int64_t k) {
  Quantized out{std::vector<int8_t>(x.size()), std::vector<float>(x.size() / kActBlock),
                std::vector<float>(x.size() / kActBlock)};
  cpu::quantize_acts(x.data(), 0, m, out.view(k));
  return out;
}

std::vector<float> dequantize(TensorType type, const std::vector<uint8_t>& w, int64_t rows, int64_t cols) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t n = 0; n < rows; ++n) {
    dequantize_row(type, w.data() + static_cast<size_t>(n) * row_bytes(type, cols), out.data() + n * cols, cols);
  }
  return out;
}

// The per-block offset the kernels split off (Q4_0: 8 * dw, Q4_1: the min m, Q8_0: none): the
// kernel's intermediate terms dw * code are as large as |w| + |offset|, which bounds rounding.
float block_offset(TensorType type, const std::vector<uint8_t>& w, int64_t n, int64_t b, int64_t cols) {
  const uint8_t* row = w.data() + static_cast<size_t>(n) * row_bytes(type, cols);
  if (type == TensorType::Q4_0) return 8 * fp16_to_fp32(reinterpret_cast<const BlockQ4_0*>(row)[b].d);
  if (type == TensorType::Q4_1) return fp16_to_fp32(reinterpret_cast<const BlockQ4_1*>(row)[b].m);
  return 0.0f;
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

std::vector<Shape> edge_shapes() {
  std::vector<Shape> shapes;
  for (int64_t m : {1, 2, 3, 7, 8, 16, 17, 64, 300}) {
    for (int64_t n : {1, 3, 33, 64}) {
      for (int64_t k : {32, 64, 576, 1536}) shapes.push_back({m, n, k});
    }
  }
  return shapes;
}

class Int8Kernel : public ::testing::TestWithParam<TensorType> {};

// Against the exact product of the dequantized weights and the dequantized int8 activations:
// the kernel's only error is float rounding. Each block adds dw * (dx*dot + offset term) (dot
// an exact integer; 2-3 roundings) and a lane sums K/32 such terms before a 3-step horizontal
// sum, so |error| <= (K/32 + 8) * u * mag with u = 2^-24 and mag the sum of the magnitudes of
// all intermediate terms, (|w| + |offset|) * |x| per weight. The bound is doubled for the
// rounding of s and the offset split.
TEST_P(Int8Kernel, MatchesExactProductOfQuantizedOperands) {
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 11);
  auto backend = int8_backend(2);
  for (const Shape& s : edge_shapes()) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = random_q_weights(type, s.n, s.k, rng);
    const std::vector<float> x = random_acts(s.m, s.k, rng);
    const std::vector<float> wf = dequantize(type, w, s.n, s.k);
    Quantized xq = quantize(x, s.m, s.k);
    const std::vector<float> y = run(*backend, type, w, s.n, s.k, x, s.m);
    const int64_t nb = s.k / kActBlock;
    for (int64_t m = 0; m < s.m; ++m) {
      for (int64_t n = 0; n < s.n; ++n) {
        double exact = 0, mag = 0;
        for (int64_t b = 0; b < nb; ++b) {
          const double dx = xq.d[static_cast<size_t>(m * nb + b)];
          const double min_abs = std::fabs(block_offset(type, w, n, b, s.k));
          for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) {
            const double a = dx * xq.q[static_cast<size_t>(m * s.k + k)];
            const double wk = wf[static_cast<size_t>(n * s.k + k)];
            exact += wk * a;
            mag += (std::fabs(wk) + min_abs) * std::fabs(a);
          }
        }
        const double tol = 2 * (static_cast<double>(nb) + 8) * kFloatEps * mag + 1e-30;
        ASSERT_NEAR(y[static_cast<size_t>(m * s.n + n)], exact, tol) << "m " << m << " n " << n;
      }
    }
  }
}

// Against the fp32 product of the unquantized activations: int8 rounding moves each activation
// by at most d/2 = max|x_block| / 254, so |error| <= sum_b max|x_b| / 254 * sum_{k in b} |w_k|
// plus the float rounding above (bounded loosely here by 1e-5 of the magnitude). Both with the
// int8 kernels for every M and with the default crossover (large M through sgemm, which only
// has float rounding, within the same bound).
TEST_P(Int8Kernel, CloseToFp32Product) {
  const TensorType type = GetParam();
  std::mt19937 rng(static_cast<unsigned>(type) + 101);
  auto forced = int8_backend(1);
  auto by_default = make_cpu_backend(1, ComputeType::kInt8);
  for (Backend* backend : {forced.get(), by_default.get()}) {
    for (const Shape& s : {Shape{1, 33, 576}, Shape{7, 64, 1536}, Shape{64, 3, 32}, Shape{300, 33, 64}}) {
      SCOPED_TRACE(shape_name(s));
      const std::vector<uint8_t> w = random_q_weights(type, s.n, s.k, rng);
      const std::vector<float> x = random_acts(s.m, s.k, rng);
      const std::vector<float> wf = dequantize(type, w, s.n, s.k);
      const std::vector<float> y = run(*backend, type, w, s.n, s.k, x, s.m);
      for (int64_t m = 0; m < s.m; ++m) {
        for (int64_t n = 0; n < s.n; ++n) {
          double exact = 0, bound = 0, mag = 0;
          for (int64_t b = 0; b < s.k / kActBlock; ++b) {
            double amax = 0, wabs = 0;
            const double min_abs = std::fabs(block_offset(type, w, n, b, s.k));
            for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) {
              const double xk = x[static_cast<size_t>(m * s.k + k)], wk = wf[static_cast<size_t>(n * s.k + k)];
              exact += xk * wk;
              mag += std::fabs(xk * wk) + min_abs * std::fabs(xk);
              amax = std::max(amax, std::fabs(xk));
              wabs += std::fabs(wk);
            }
            bound += amax / 254 * wabs;
          }
          ASSERT_NEAR(y[static_cast<size_t>(m * s.n + n)], exact, bound * 1.001 + 1e-5 * mag + 1e-30)
              << "m " << m << " n " << n;
        }
      }
    }
  }
}

// Each output is one thread's fixed-order sum: 1 and 2 threads give the same bits.
TEST_P(Int8Kernel, SameResultForAnyThreadCount) {
  const TensorType type = GetParam();
  std::mt19937 rng(5);
  auto one = int8_backend(1);
  auto two = int8_backend(2);
  for (const Shape& s : {Shape{1, 33, 576}, Shape{3, 1, 64}, Shape{16, 64, 1536}, Shape{17, 33, 576},
                         Shape{300, 64, 576}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = random_q_weights(type, s.n, s.k, rng);
    const std::vector<float> x = random_acts(s.m, s.k, rng);
    const std::vector<float> y1 = run(*one, type, w, s.n, s.k, x, s.m);
    const std::vector<float> y2 = run(*two, type, w, s.n, s.k, x, s.m);
    ASSERT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Int8Kernel, ::testing::Values(TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0),
                         [](const auto& info) { return std::string(type_traits(static_cast<uint32_t>(info.param))->name); });

// ---------------------------------------------------------------------------------------------
// ringlm's INT4 formats (quant/int4.h) through the kernel entry point itself: blocks are built
// here with the structs of int4.h and dequantized by the scalar reference below, independent of
// quant/formats.cpp.

struct Int4Case {
  Int4Format format;
  TensorType type() const { return static_cast<TensorType>(int4_type_id(format)); }
  size_t row_stride(int64_t k) const { return static_cast<size_t>(k / format.group) * int4_block_bytes(format); }
};

std::string int4_name(const Int4Format& f) {
  const char* scale[] = {"f16", "bf16", "f32"};
  std::ostringstream out;
  out << (f.asymmetric ? "i4a" : "i4s") << "_g" << f.group << "_" << scale[static_cast<int>(f.scale)];
  return out.str();
}

// Scale (or min) storage of the format: the value is rounded to it, and the reference reads the
// rounded value back.
void store_scale(ScaleType s, float v, uint8_t* dst) {
  if (s == ScaleType::kF32) {
    std::memcpy(dst, &v, 4);
    return;
  }
  const uint16_t bits = s == ScaleType::kF16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
  std::memcpy(dst, &bits, 2);
}
float load_scale(ScaleType s, const uint8_t* src) {
  if (s == ScaleType::kF32) {
    float v;
    std::memcpy(&v, src, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, src, 2);
  return scale_to_fp32(bits, s);
}

// Random rows of the format: random codes, scales of either sign, mins of either sign.
std::vector<uint8_t> random_int4_weights(const Int4Case& c, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(c.row_stride(cols) * static_cast<size_t>(rows));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const size_t block = int4_block_bytes(c.format), scale_bytes = c.format.scale == ScaleType::kF32 ? 4 : 2;
  for (size_t off = 0; off < bytes.size(); off += block) {
    store_scale(c.format.scale, scale(rng), &bytes[off]);
    if (c.format.asymmetric) store_scale(c.format.scale, 4 * scale(rng), &bytes[off + scale_bytes]);
  }
  return bytes;
}

// The reference dequantization of one weight: block k / G, sub-block (k % G) / 32, whose byte j
// holds element j in its low nibble and element j + 16 in its high nibble (int4.h).
struct Int4Weight {
  double w;       // the weight's value
  double offset;  // |8 d| (symmetric) or |m| (asymmetric): the term the kernels split off
};
Int4Weight int4_weight(const Int4Case& c, const std::vector<uint8_t>& w, int64_t n, int64_t k, int64_t cols) {
  const Int4Format& f = c.format;
  const uint8_t* blk = w.data() + static_cast<size_t>(n) * c.row_stride(cols) +
                       static_cast<size_t>(k / f.group) * int4_block_bytes(f);
  const size_t scale_bytes = f.scale == ScaleType::kF32 ? 4 : 2;
  const uint8_t* qs = blk + scale_bytes * (f.asymmetric ? 2 : 1);
  const int64_t sub = (k % f.group) / kInt4SubBlock, j = k % kInt4SubBlock;
  const uint8_t byte = qs[sub * kInt4SubBlock / 2 + (j % 16)];
  const int code = j < 16 ? (byte & 0x0F) : (byte >> 4);
  const double d = load_scale(f.scale, blk);
  if (!f.asymmetric) return {d * (code - 8), 8 * std::fabs(d)};
  const double m = load_scale(f.scale, blk + scale_bytes);
  return {d * code + m, std::fabs(m)};
}

std::vector<float> run_kernel(const Int4Case& c, const std::vector<uint8_t>& w, int64_t rows, int64_t cols,
                              Quantized& xq, int64_t m) {
  std::vector<float> y(static_cast<size_t>(m * rows), NAN);
  cpu::gemm_int8(c.type(), w.data(), c.row_stride(cols), 0, rows, xq.view(cols), m, y.data(), rows);
  return y;
}

std::vector<Int4Case> int4_cases() {
  std::vector<Int4Case> cases;
  for (uint32_t id = kInt4TypeBase; id < kInt4TypeBase + 12; ++id) cases.push_back({*int4_format(id)});
  return cases;
}

class Int4Kernel : public ::testing::TestWithParam<Int4Case> {};

TEST_P(Int4Kernel, IsSupported) { EXPECT_TRUE(cpu::int8_supported(GetParam().type())); }

// Runs the kernels with one Highway target at a time (every target this CPU runs: here AVX2 and
// the portable fallback of SSE4/SSSE3); the real choice comes back at the end of the scope.
class OnlyTarget {
 public:
  explicit OnlyTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~OnlyTarget() { hwy::SetSupportedTargetsForTest(0); }
  OnlyTarget(const OnlyTarget&) = delete;
  OnlyTarget& operator=(const OnlyTarget&) = delete;
};

// As Int8Kernel.MatchesExactProductOfQuantizedOperands: the exact double product of the
// reference-dequantized weights and the quantized activations, within the float rounding bound,
// on every Highway target this CPU runs. K: exactly one group, a few groups (for g32 an odd
// number of blocks: the kernels take blocks in pairs), and a longer row.
TEST_P(Int4Kernel, MatchesExactProductOfQuantizedOperands) {
  const Int4Case c = GetParam();
  const int64_t g = c.format.group;  // weights per block
  std::mt19937 rng(int4_type_id(c.format));
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const OnlyTarget only(target);
    for (int64_t m : {1, 2, 3, 17}) {
      for (int64_t n : {1, 3, 5, 37}) {
        for (int64_t k : {g, 3 * g, int64_t{1536}}) {
          const Shape s{m, n, k};
          SCOPED_TRACE(shape_name(s));
          const std::vector<uint8_t> w = random_int4_weights(c, s.n, s.k, rng);
          Quantized xq = quantize(random_acts(s.m, s.k, rng), s.m, s.k);
          const std::vector<float> y = run_kernel(c, w, s.n, s.k, xq, s.m);
          const int64_t nb = s.k / kActBlock;
          for (int64_t mi = 0; mi < s.m; ++mi) {
            for (int64_t ni = 0; ni < s.n; ++ni) {
              double exact = 0, mag = 0;
              for (int64_t ki = 0; ki < s.k; ++ki) {
                const double a = static_cast<double>(xq.d[static_cast<size_t>(mi * nb + ki / kActBlock)]) *
                                 xq.q[static_cast<size_t>(mi * s.k + ki)];
                const Int4Weight wk = int4_weight(c, w, ni, ki, s.k);
                exact += wk.w * a;
                mag += (std::fabs(wk.w) + wk.offset) * std::fabs(a);
              }
              const double tol = 2 * (static_cast<double>(nb) + 8) * kFloatEps * mag + 1e-30;
              ASSERT_NEAR(y[static_cast<size_t>(mi * s.n + ni)], exact, tol) << "m " << mi << " n " << ni;
            }
          }
        }
      }
    }
  }
}

// Rows split over 1, 2 or 3 OpenMP threads, at the backend's 4-row tile boundaries and at
// arbitrary rows, give the bits of one call over all rows: each output's sum has a fixed order.
TEST_P(Int4Kernel, SameResultForAnyThreadCountAndRowSplit) {
  const Int4Case c = GetParam();
  std::mt19937 rng(17);
  for (const Shape& s : {Shape{1, 37, 4 * c.format.group}, Shape{3, 5, 1536}, Shape{16, 64, 1536}, Shape{17, 37, 1536}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = random_int4_weights(c, s.n, s.k, rng);
    Quantized xq = quantize(random_acts(s.m, s.k, rng), s.m, s.k);
    const std::vector<float> whole = run_kernel(c, w, s.n, s.k, xq, s.m);
    for (int threads : {1, 2, 3}) {
      for (int64_t unit : {int64_t{4}, int64_t{1}}) {  // split in whole 4-row tiles, or at any row
        std::vector<float> y(whole.size(), NAN);
        const int64_t units = (s.n + unit - 1) / unit;
#pragma omp parallel num_threads(threads)
        {
          const int t = omp_get_thread_num(), nt = omp_get_num_threads();
          const int64_t n0 = std::min(s.n, units * t / nt * unit), n1 = std::min(s.n, units * (t + 1) / nt * unit);
          if (n0 < n1) cpu::gemm_int8(c.type(), w.data(), c.row_stride(s.k), n0, n1, xq.view(s.k), s.m, y.data(), s.n);
        }
        ASSERT_EQ(0, std::memcmp(whole.data(), y.data(), y.size() * sizeof(float)))
            << threads << " threads, split unit " << unit;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Int4Kernel, ::testing::ValuesIn(int4_cases()),
                         [](const auto& info) { return int4_name(info.param.format); });

// i4s-g32-f16 and i4a-g32-f16 have Q4_0's and Q4_1's layouts: the same bytes give the same bits.
TEST(Int4Kernel, G32Fp16MatchesQ4Formats) {
  std::mt19937 rng(23);
  const int64_t m = 3, n = 37, k = 576;
  for (bool asym : {false, true}) {
    const Int4Case c{{32, asym, ScaleType::kF16}};
    const std::vector<uint8_t> w = random_int4_weights(c, n, k, rng);
    Quantized xq = quantize(random_acts(m, k, rng), m, k);
    const std::vector<float> y = run_kernel(c, w, n, k, xq, m);
    std::vector<float> yq(y.size(), NAN);
    cpu::gemm_int8(asym ? TensorType::Q4_1 : TensorType::Q4_0, w.data(), row_bytes(asym ? TensorType::Q4_1 : TensorType::Q4_0, k),
                   0, n, xq.view(k), m, yq.data(), n);
    ASSERT_EQ(0, std::memcmp(y.data(), yq.data(), y.size() * sizeof(float))) << (asym ? "Q4_1" : "Q4_0");
  }
}

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
  auto int8 = make_cpu_backend(2, ComputeType::kInt8);  // other formats fall back to fp32 there
  for (const Shape& s : {Shape{1, 33, 576}, Shape{8, 3, 64}, Shape{16, 64, 1536}, Shape{300, 33, 32},
                         Shape{64, 200, 576}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = random_q_weights(type, s.n, s.k, rng);
    const std::vector<float> x = random_acts(s.m, s.k, rng);
    const std::vector<float> wf = dequantize(type, w, s.n, s.k);
    const std::vector<float> y1 = run(*one, type, w, s.n, s.k, x, s.m);
    const std::vector<float> y2 = run(*two, type, w, s.n, s.k, x, s.m);
    ASSERT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)));
    if (!cpu::int8_supported(type)) {
      const std::vector<float> y3 = run(*int8, type, w, s.n, s.k, x, s.m);
      ASSERT_EQ(0, std::memcmp(y1.data(), y3.data(), y1.size() * sizeof(float)));
    }
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

INSTANTIATE_TEST_SUITE_P(Formats, Fp32Path,
                         ::testing::Values(TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0, TensorType::F16),
                         [](const auto& info) { return std::string(type_traits(static_cast<uint32_t>(info.param))->name); });

}  // namespace
}  // namespace ringlm
