// RoPE and fp16 rows (see kv_rows.h), compiled once per Highway target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kv_rows.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kv_rows.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include "hwy/highway.h"
#include "quant/formats.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#include "backends/cpu/f16_rows-inl.h"  // IWYU pragma: keep

// x[e] * cos_x[e] + partner[e] * sin_x[e] for one vector of elements, written as the scalar
// tail is. Where the target has FMA the compiler fuses the products and the sum (GCC does on
// AVX2: -ffp-contract=fast), which rounds once instead of twice; each target is deterministic
// and within an ulp or so of the exact rotation (test_kv_rows).
template <class D, class V>
HWY_INLINE V Rotated(D d, V x, V partner, const float* cos_x, const float* sin_x) {
  return hn::Add(hn::Mul(x, hn::LoadU(d, cos_x)), hn::Mul(partner, hn::LoadU(d, sin_x)));
}

void RotateHeads(float* vec, int n_heads, int head_dim, int n_rot, RopePairs pairs, const float* cos_x,
                 const float* sin_x) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const int half = n_rot / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* x = vec + static_cast<int64_t>(h) * head_dim;
    int e = 0;
    if (pairs == RopePairs::kAdjacent) {
#if HWY_TARGET != HWY_SCALAR
      // Vectors (an even number of lanes) start at even elements: a pair never straddles two.
      for (; e + lanes <= n_rot; e += lanes) {
        const auto v = hn::LoadU(d, x + e);
        hn::StoreU(Rotated(d, v, hn::Shuffle2301(v), cos_x + e, sin_x + e), d, x + e);
      }
#endif
      for (; e < n_rot; e += 2) {
        const float a = x[e], b = x[e + 1];
        x[e] = a * cos_x[e] + b * sin_x[e];
        x[e + 1] = b * cos_x[e + 1] + a * sin_x[e + 1];
      }
      continue;
    }
    for (; e + lanes <= half; e += lanes) {
      const auto a = hn::LoadU(d, x + e), b = hn::LoadU(d, x + half + e);
      hn::StoreU(Rotated(d, a, b, cos_x + e, sin_x + e), d, x + e);
      hn::StoreU(Rotated(d, b, a, cos_x + half + e, sin_x + half + e), d, x + half + e);
    }
    for (; e < half; ++e) {
      const float a = x[e], b = x[half + e];
      x[e] = a * cos_x[e] + b * sin_x[e];
      x[half + e] = b * cos_x[half + e] + a * sin_x[half + e];
    }
  }
}

// F16C (AVX2 and up) rounds to nearest even, as fp32_to_fp16 does; Highway's emulation on older
// targets truncates, so those take the scalar conversion.
#if HWY_TARGET <= HWY_AVX2
void Fp32ToFp16Row(const float* src, uint16_t* dst, int64_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<hwy::float16_t, decltype(df)> dh;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  auto* out = reinterpret_cast<hwy::float16_t*>(dst);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + i)), dh, out + i);
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
#else
void Fp32ToFp16Row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}
#endif

void Fp16ToFp32Row(const uint16_t* src, float* dst, int64_t n) { F16RowToF32(src, n, dst); }

// The squared error of a block's 32 values at x on the Q4_0 grid of step d: d * q for the
// integer q in [-8, 7] nearest to x / d (ties to even), as the nibbles will be chosen.
template <class D>
HWY_INLINE float Q4_0GridError(D df, const float* x, float d) {
  const auto step = hn::Set(df, d), inv = hn::Set(df, d != 0.0f ? 1.0f / d : 0.0f);
  const auto lo = hn::Set(df, -8.0f), hi = hn::Set(df, 7.0f);
  auto sum = hn::Zero(df);
  for (size_t i = 0; i < kQK4_0; i += hn::Lanes(df)) {
    const auto v = hn::LoadU(df, x + i);
    const auto e = hn::NegMulAdd(step, hn::Min(hn::Max(hn::Round(hn::Mul(v, inv)), lo), hi), v);
    sum = hn::MulAdd(e, e, sum);
  }
  return hn::GetLane(hn::SumOfLanes(df, sum));
}

void QuantizeQ4_0Searched(const float* x, uint8_t* out, int64_t n) {
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  for (int64_t b = 0; b < n / kQK4_0; ++b, x += kQK4_0, out += sizeof(BlockQ4_0)) {
    // The value of largest magnitude, sign kept (the first of equals): the largest magnitude from
    // the vectors, then the first value that has it.
    auto largest = hn::Zero(df);
    for (size_t i = 0; i < kQK4_0; i += hn::Lanes(df)) largest = hn::Max(largest, hn::Abs(hn::LoadU(df, x + i)));
    const float amax = hn::GetLane(hn::MaxOfLanes(df, largest));
    float extreme = 0.0f;
    for (size_t j = 0; j < kQK4_0 && amax > 0.0f; ++j) {
      if (std::fabs(x[j]) == amax) {
        extreme = x[j];
        break;
      }
    }
    // The candidates' steps, rounded to fp16 as stored: GGML's grid first. (Padded to 16, so that
    // the conversions run as whole vectors.)
    HWY_ALIGN float steps[16] = {};
    uint16_t bits[16];
    for (int k = 0; k < kQ4_0Clips; ++k) {
      const float ratio = 1.0f - kQ4_0ClipStep * static_cast<float>(k);
      steps[k] = ratio * extreme / -8.0f;
      steps[kQ4_0Clips + k] = ratio * extreme / 7.0f;
    }
    Fp32ToFp16Row(steps, bits, 16);
    Fp16ToFp32Row(bits, steps, 16);
    int best = 0;
    float best_error = Q4_0GridError(df, x, steps[0]);
    for (int k = 1; k < kQ4_0Grids && best_error > 0.0f; ++k) {
      const float error = Q4_0GridError(df, x, steps[k]);
      if (error < best_error) best = k, best_error = error;  // strict: ties keep the earlier grid
    }
    const float d = steps[best];
    const auto inv = hn::Set(df, d != 0.0f ? 1.0f / d : 0.0f);
    HWY_ALIGN int32_t q[kQK4_0];
    for (size_t i = 0; i < kQK4_0; i += hn::Lanes(df)) {
      const auto code = hn::Min(hn::Max(hn::Round(hn::Mul(hn::LoadU(df, x + i), inv)), hn::Set(df, -8.0f)), hn::Set(df, 7.0f));
      hn::Store(hn::Add(hn::ConvertTo(di, code), hn::Set(di, 8)), di, q + i);
    }
    BlockQ4_0 block;
    block.d = bits[best];
    for (size_t j = 0; j < kQK4_0 / 2; ++j) block.qs[j] = static_cast<uint8_t>(q[j] | (q[j + kQK4_0 / 2] << 4));
    std::memcpy(out, &block, sizeof(block));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(RotateHeads);
HWY_EXPORT(Fp32ToFp16Row);
HWY_EXPORT(Fp16ToFp32Row);
HWY_EXPORT(QuantizeQ4_0Searched);

void expand_rope_angles(const float* cos, const float* sin, int n_rot, RopePairs pairs, float* cos_x,
                        float* sin_x) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const int a = pairs == RopePairs::kAdjacent ? 2 * i : i;
    const int b = pairs == RopePairs::kAdjacent ? 2 * i + 1 : i + half;
    cos_x[a] = cos_x[b] = cos[i];
    sin_x[a] = -sin[i];
    sin_x[b] = sin[i];
  }
}

void rotate_heads(float* vec, int n_heads, int head_dim, int n_rot, RopePairs pairs, const float* cos_x,
                  const float* sin_x) {
  HWY_DYNAMIC_DISPATCH(RotateHeads)(vec, n_heads, head_dim, n_rot, pairs, cos_x, sin_x);
}

void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n) { HWY_DYNAMIC_DISPATCH(Fp32ToFp16Row)(src, dst, n); }

void hadamard_heads(float* x, int n_heads, int head_dim) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int h = 0; h < n_heads; ++h) {
    float* v = x + static_cast<int64_t>(h) * head_dim;
    for (int span = 1; span < head_dim; span *= 2) {
      for (int i = 0; i < head_dim; i += 2 * span) {
        for (int j = i; j < i + span; ++j) {
          const float a = v[j], b = v[j + span];
          v[j] = a + b;
          v[j + span] = a - b;
        }
      }
    }
    for (int e = 0; e < head_dim; ++e) v[e] *= norm;
  }
}
void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n) { HWY_DYNAMIC_DISPATCH(Fp16ToFp32Row)(src, dst, n); }

void quantize_q4_0_searched(const float* x, uint8_t* out, int64_t n) {
  if (n % kQK4_0 != 0) throw std::invalid_argument("quantize_q4_0_searched: a row of " + std::to_string(n) + " values is not whole blocks of 32");
  HWY_DYNAMIC_DISPATCH(QuantizeQ4_0Searched)(x, out, n);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
