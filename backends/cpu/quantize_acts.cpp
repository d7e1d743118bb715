// Activation quantization (see quantize_acts.h). This file is compiled once per Highway target
// through foreach_target.h; HWY_ONCE holds the dispatching entry points.

// Also build the AVX-512 VNNI target (Highway 1.0.3 only does so on request).
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/quantize_acts.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <cstdint>
#include <cstring>

#include "backends/cpu/quantize_acts.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most one block of 32 per vector, so the lane count divides 32 (and 16).
using DF = hn::CappedTag<float, kActBlock>;

// max |x| over n values (n a multiple of the lane count).
HWY_INLINE float AbsMax(DF df, const float* x, int64_t n) {
  auto vmax = hn::Zero(df);
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(hn::Lanes(df))) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(df, x + i)));
  return hn::GetLane(hn::MaxOfLanes(df, vmax));
}

// q = nearest(x * inv) for n values; returns the sum of the q (exact: |q| <= 127).
HWY_INLINE int32_t QuantizeRun(DF df, const float* x, float inv, int8_t* q, int64_t n) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, DF> d8;
  auto vsum = hn::Zero(di);
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(hn::Lanes(df))) {
    const auto rounded = hn::NearestInt(hn::Mul(hn::LoadU(df, x + i), hn::Set(df, inv)));
    hn::StoreU(hn::DemoteTo(d8, rounded), d8, q + i);
    vsum = hn::Add(vsum, rounded);
  }
  return hn::GetLane(hn::SumOfLanes(di, vsum));
}

void QuantizeActs(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out) {
  const DF df;
  const int64_t k = out.k, nb = out.blocks();
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * k + b * kActBlock;
      const float amax = AbsMax(df, xb, kActBlock);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const int32_t sum = QuantizeRun(df, xb, inv, out.q + m * k + b * kActBlock, kActBlock);
      const float d = amax / 127.0f;
      out.d[m * nb + b] = d;
      out.s[m * nb + b] = d * static_cast<float>(sum);
      out.sum[m * nb + b] = sum;
    }
  }
}

void QuantizeActsSuper(const float* x, int64_t m_begin, int64_t m_end, const SuperActs& out) {
  const DF df;
  const int64_t k = out.k, nb = out.blocks();
  for (int64_t m = m_begin; m < m_end; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * k + b * kSuperBlock;
      const float amax = AbsMax(df, xb, kSuperBlock);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = out.q + m * k + b * kSuperBlock;
      int32_t* sum16 = out.sum16 + m * (k / 16) + b * (kSuperBlock / 16);
      int32_t* sum32 = out.sum32 + m * (k / 32) + b * (kSuperBlock / 32);
      for (int j = 0; j < kSuperBlock / 16; ++j) sum16[j] = QuantizeRun(df, xb + 16 * j, inv, qb + 16 * j, 16);
      for (int j = 0; j < kSuperBlock / 32; ++j) sum32[j] = sum16[2 * j] + sum16[2 * j + 1];
      out.d[m * nb + b] = amax / 127.0f;
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(QuantizeActs);
HWY_EXPORT(QuantizeActsSuper);

void lay_out_for_passes(const QuantizedActs& rows, int64_t m, int64_t n_tokens, const QuantizedActs& passes) {
  const int64_t nb = rows.blocks();
  const PassPlace at = pass_place(m, n_tokens);
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(passes.q + at.at(nb, b) * kActBlock, rows.q + m * rows.k + b * kActBlock, kActBlock);
    passes.d[at.at(nb, b)] = rows.d[m * nb + b];
    passes.s[at.at(nb, b)] = rows.s[m * nb + b];
    passes.sum[at.at(nb, b)] = rows.sum[m * nb + b];
  }
}

void lay_out_for_passes(const SuperActs& rows, int64_t m, int64_t n_tokens, const SuperActs& passes) {
  const int64_t n32 = rows.k / 32, n16 = rows.k / 16, nb = rows.blocks();
  const PassPlace at = pass_place(m, n_tokens);
  for (int64_t u = 0; u < n32; ++u) {
    std::memcpy(passes.q + at.at(n32, u) * 32, rows.q + m * rows.k + u * 32, 32);
    passes.sum32[at.at(n32, u)] = rows.sum32[m * n32 + u];
  }
  for (int64_t u = 0; u < n16; ++u) passes.sum16[at.at(n16, u)] = rows.sum16[m * n16 + u];
  for (int64_t b = 0; b < nb; ++b) passes.d[at.at(nb, b)] = rows.d[m * nb + b];
}

void quantize_acts(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out) {
  HWY_DYNAMIC_DISPATCH(QuantizeActs)(x, m_begin, m_end, out);
}

void quantize_acts_super(const float* x, int64_t m_begin, int64_t m_end, const SuperActs& out) {
  HWY_DYNAMIC_DISPATCH(QuantizeActsSuper)(x, m_begin, m_end, out);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
