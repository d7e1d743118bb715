// RoPE and fp16 rows (see kv_rows.h), compiled once per Highway target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/kv_rows.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "backends/cpu/kv_rows.h"

#include <cmath>
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

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(RotateHeads);
HWY_EXPORT(Fp32ToFp16Row);
HWY_EXPORT(Fp16ToFp32Row);

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

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
