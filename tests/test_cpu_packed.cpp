// The packed int8 kernels (backends/cpu/kernel_packed.h) on Q4_0, Q4_1, Q8_0 and ringlm's 12
// INT4 formats: against an exact double product of the reference-dequantized weights and the
// int8-quantized activations on every Highway target this CPU runs, bit-identical results for
// any split of the rows on 8-row boundaries and any number of tokens, and packing of row counts
// that are not a multiple of 8. Weights are built and dequantized here from the format
// definitions (quant/formats.h, quant/int4.h), independent of the packing code.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backends/cpu/int8_kernels.h"
#include "backends/cpu/kernel_packed.h"
#include "hwy/targets.h"
#include "quant/int4.h"

namespace ringlm {
namespace {

using cpu::kActBlock;

constexpr double kFloatEps = 1.0 / (1 << 24);  // unit roundoff of fp32

// A source format: blocks of `group` weights, scale (and min) first, then the codes.
struct Format {
  TensorType type;
  std::string name;
  int group = 32;
  bool asym = false;
  bool bytes = false;  // Q8_0: signed bytes
  ScaleType scale = ScaleType::kF16;

  size_t scale_bytes() const { return scale == ScaleType::kF32 ? 4 : 2; }
  size_t block_bytes() const { return scale_bytes() * (asym ? 2 : 1) + static_cast<size_t>(bytes ? group : group / 2); }
  size_t row_stride(int64_t cols) const { return static_cast<size_t>(cols / group) * block_bytes(); }
};

void PrintTo(const Format& f, std::ostream* out) { *out << f.name; }

std::vector<Format> all_formats() {
  std::vector<Format> out{{TensorType::Q4_0, "q4_0", 32, false, false, ScaleType::kF16},
                          {TensorType::Q4_1, "q4_1", 32, true, false, ScaleType::kF16},
                          {TensorType::Q8_0, "q8_0", 32, false, true, ScaleType::kF16}};
  const char* scale_names[] = {"f16", "bf16", "f32"};
  for (uint32_t id = kInt4TypeBase; id < kInt4TypeBase + 12; ++id) {
    const Int4Format f = *int4_format(id);
    std::ostringstream name;
    name << (f.asymmetric ? "i4a" : "i4s") << "_g" << f.group << "_" << scale_names[static_cast<int>(f.scale)];
    out.push_back({static_cast<TensorType>(id), name.str(), f.group, f.asymmetric, false, f.scale});
  }
  return out;
}

void store_scale(ScaleType s, float v, uint8_t* dst) {
  if (s == ScaleType::kF32) {
    std::memcpy(dst, &v, 4);
    return;
  }
  const uint16_t bits = s == ScaleType::kF16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
  std::memcpy(dst, &bits, 2);
}
double load_scale(ScaleType s, const uint8_t* src) {
  if (s == ScaleType::kF32) {
    float v;
    std::memcpy(&v, src, 4);
    return v;
  }
  uint16_t bits;
  std::memcpy(&bits, src, 2);
  return scale_to_fp32(bits, s);
}

// Random codes, scales of either sign, mins of either sign.
std::vector<uint8_t> random_weights(const Format& f, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> bytes(f.row_stride(cols) * static_cast<size_t>(rows));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (size_t off = 0; off < bytes.size(); off += f.block_bytes()) {
    store_scale(f.scale, scale(rng), &bytes[off]);
    if (f.asym) store_scale(f.scale, 4 * scale(rng), &bytes[off + f.scale_bytes()]);
  }
  return bytes;
}

// Weight k of row n by the format's definition, and the offset the kernels split off (|8 d| for
// the symmetric 4-bit formats, |m| for the asymmetric ones): their intermediate terms are as
// large as |w| + offset, which bounds the rounding.
struct Weight {
  double w, offset;
};
Weight weight_at(const Format& f, const std::vector<uint8_t>& w, int64_t n, int64_t k, int64_t cols) {
  const uint8_t* blk = w.data() + static_cast<size_t>(n) * f.row_stride(cols) + static_cast<size_t>(k / f.group) * f.block_bytes();
  const uint8_t* qs = blk + f.scale_bytes() * (f.asym ? 2 : 1);
  const double d = load_scale(f.scale, blk);
  const int64_t i = k % f.group;
  if (f.bytes) return {d * static_cast<int8_t>(qs[i]), 0.0};
  const int64_t sub = i / 32, j = i % 32;
  const uint8_t byte = qs[sub * 16 + j % 16];
  const int code = j < 16 ? (byte & 0x0F) : (byte >> 4);
  if (!f.asym) return {d * (code - 8), 8 * std::fabs(d)};
  const double m = load_scale(f.scale, blk + f.scale_bytes());
  return {d * code + m, std::fabs(m)};
}

// Activations with varied magnitudes per block, and all-zero blocks.
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
  int64_t k;
  cpu::QuantizedActs view() { return {q.data(), d.data(), s.data(), k}; }
};
Quantized quantize(const std::vector<float>& x, int64_t m, int64_t k) {
  Quantized out{std::vector<int8_t>(x.size()), std::vector<float>(x.size() / kActBlock),
                std::vector<float>(x.size() / kActBlock), k};
  cpu::quantize_acts(x.data(), 0, m, out.view());
  return out;
}

std::vector<float> run_packed(const cpu::PackedWeight& p, Quantized& xq, int64_t m) {
  std::vector<float> y(static_cast<size_t>(m * p.rows), NAN);
  cpu::gemm_int8_packed(p, 0, p.rows, xq.view(), m, y.data(), p.rows);
  return y;
}

struct Shape {
  int64_t m, n, k;
};
std::string shape_name(const Shape& s) {
  std::ostringstream out;
  out << "M" << s.m << " N" << s.n << " K" << s.k;
  return out.str();
}

// Runs the kernels with one Highway target at a time (here AVX2 and the portable fallback of
// SSE4/SSSE3); the real choice comes back at the end of the scope.
class OnlyTarget {
 public:
  explicit OnlyTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~OnlyTarget() { hwy::SetSupportedTargetsForTest(0); }
  OnlyTarget(const OnlyTarget&) = delete;
  OnlyTarget& operator=(const OnlyTarget&) = delete;
};

class Packed : public ::testing::TestWithParam<Format> {};

// Against the exact double product of the dequantized weights and the quantized activations.
// Each 32-weight sub-block adds dw * (dx * dot + offset term) (dot an exact integer; 2-3
// roundings) to one lane, K/32 such additions in all, so |error| <= (K/32 + 8) u mag with
// u = 2^-24 and mag = sum of (|w| + |offset|) |x|, doubled for the rounding of s: the bound of
// tests/test_cpu_kernels.cpp. K: one group, three groups, 1536.
TEST_P(Packed, MatchesExactProductOfQuantizedOperands) {
  const Format f = GetParam();
  std::mt19937 rng(static_cast<unsigned>(f.type) + 5);
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    SCOPED_TRACE(hwy::TargetName(target));
    const OnlyTarget only(target);
    for (int64_t k : {int64_t{f.group}, int64_t{3 * f.group}, int64_t{1536}}) {
      for (int64_t n : {1, 3, 7, 8, 9, 37, 64}) {
        const std::vector<uint8_t> w = random_weights(f, n, k, rng);
        const cpu::PackedWeight p = cpu::pack_int8(f.type, w.data(), f.row_stride(k), n, k);
        ASSERT_EQ(p.rows, n);
        std::vector<Weight> wd(static_cast<size_t>(n * k));
        for (int64_t ni = 0; ni < n; ++ni) {
          for (int64_t ki = 0; ki < k; ++ki) wd[static_cast<size_t>(ni * k + ki)] = weight_at(f, w, ni, ki, k);
        }
        for (int64_t m : {1, 2, 3, 5, 8, 16, 17}) {
          const Shape s{m, n, k};
          SCOPED_TRACE(shape_name(s));
          Quantized xq = quantize(random_acts(m, k, rng), m, k);
          const std::vector<float> y = run_packed(p, xq, m);
          const int64_t nb = k / kActBlock;
          for (int64_t mi = 0; mi < m; ++mi) {
            for (int64_t ni = 0; ni < n; ++ni) {
              double exact = 0, mag = 0;
              for (int64_t ki = 0; ki < k; ++ki) {
                const double a = static_cast<double>(xq.d[static_cast<size_t>(mi * nb + ki / kActBlock)]) *
                                 xq.q[static_cast<size_t>(mi * k + ki)];
                const Weight& wk = wd[static_cast<size_t>(ni * k + ki)];
                exact += wk.w * a;
                mag += (std::fabs(wk.w) + wk.offset) * std::fabs(a);
              }
              const double tol = 2 * (static_cast<double>(nb) + 8) * kFloatEps * mag + 1e-30;
              ASSERT_NEAR(y[static_cast<size_t>(mi * n + ni)], exact, tol) << "m " << mi << " n " << ni;
            }
          }
        }
      }
    }
  }
}

// Rows split over 1, 2 or 3 OpenMP threads on 8-row boundaries, and any token count (each token
// alone), give the bits of one call over everything: each output's sum has a fixed order.
TEST_P(Packed, SameBitsForAnyRowSplitAndTokenCount) {
  const Format f = GetParam();
  std::mt19937 rng(23);
  for (const Shape& s : {Shape{1, 37, 4 * f.group}, Shape{5, 64, 1536}, Shape{17, 37, 1536}}) {
    SCOPED_TRACE(shape_name(s));
    const std::vector<uint8_t> w = random_weights(f, s.n, s.k, rng);
    const cpu::PackedWeight p = cpu::pack_int8(f.type, w.data(), f.row_stride(s.k), s.n, s.k);
    Quantized xq = quantize(random_acts(s.m, s.k, rng), s.m, s.k);
    const std::vector<float> whole = run_packed(p, xq, s.m);
    const int64_t groups = (s.n + 7) / 8;
    for (int threads : {1, 2, 3}) {
      std::vector<float> y(whole.size(), NAN);
#pragma omp parallel num_threads(threads)
      {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t n0 = std::min(s.n, groups * t / nt * 8), n1 = std::min(s.n, groups * (t + 1) / nt * 8);
        if (n0 < n1) cpu::gemm_int8_packed(p, n0, n1, xq.view(), s.m, y.data(), s.n);
      }
      ASSERT_EQ(0, std::memcmp(whole.data(), y.data(), y.size() * sizeof(float))) << threads << " threads";
    }
    for (int64_t m = 0; m < s.m; ++m) {  // token m alone, one 8-row group per call
      const cpu::QuantizedActs one{xq.q.data() + m * s.k, xq.d.data() + m * (s.k / kActBlock),
                                   xq.s.data() + m * (s.k / kActBlock), s.k};
      std::vector<float> y(static_cast<size_t>(s.n), NAN);
      for (int64_t n = 0; n < s.n; n += 8) cpu::gemm_int8_packed(p, n, std::min(s.n, n + 8), one, 1, y.data(), s.n);
      ASSERT_EQ(0, std::memcmp(whole.data() + m * s.n, y.data(), y.size() * sizeof(float))) << "token " << m;
    }
  }
}

// A matrix whose row count is not a multiple of 8: the last group is padded, its extra rows are
// never stored, and its real rows get the bits they get in a matrix with more rows after them.
TEST_P(Packed, RowsNotAMultipleOf8) {
  const Format f = GetParam();
  std::mt19937 rng(31);
  const int64_t k = 2 * f.group, m = 3;
  const std::vector<uint8_t> w = random_weights(f, 16, k, rng);
  Quantized xq = quantize(random_acts(m, k, rng), m, k);
  const cpu::PackedWeight full = cpu::pack_int8(f.type, w.data(), f.row_stride(k), 16, k);
  const std::vector<float> y_full = run_packed(full, xq, m);
  for (int64_t rows : {1, 5, 13}) {
    SCOPED_TRACE(rows);
    const cpu::PackedWeight p = cpu::pack_int8(f.type, w.data(), f.row_stride(k), rows, k);
    EXPECT_EQ(p.groups(), (rows + 7) / 8);
    EXPECT_EQ(p.bytes() % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data.get()) % 64, 0u);
    EXPECT_GE(p.group_bytes * 8, 8 * f.row_stride(k));  // holds 8 rows of the source
    std::vector<float> y(static_cast<size_t>(m * (rows + 1)), NAN);  // one guard column per token
    cpu::gemm_int8_packed(p, 0, rows, xq.view(), m, y.data(), rows + 1);
    for (int64_t mi = 0; mi < m; ++mi) {
      for (int64_t n = 0; n < rows; ++n) {
        ASSERT_EQ(y[static_cast<size_t>(mi * (rows + 1) + n)], y_full[static_cast<size_t>(mi * 16 + n)])
            << "m " << mi << " n " << n;
      }
      ASSERT_TRUE(std::isnan(y[static_cast<size_t>(mi * (rows + 1) + rows)])) << "stored past row " << rows;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Packed, ::testing::ValuesIn(all_formats()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace ringlm
