// Element-wise activations (see activation.h), compiled once per Highway target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu/activation.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>

#include "backends/cpu/activation.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace ringlm::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

constexpr size_t kMaxLanes = 64;  // more floats than any target's vector holds

// gate[i] = f(gate[i], up[i]) over whole vectors; the tail through the same vector code (padded
// copies), so every element is computed alike.
template <class D, class F>
HWY_INLINE void MapGated(D d, float* gate, const float* up, int64_t n, F f) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(f(hn::LoadU(d, gate + i), hn::LoadU(d, up + i)), d, gate + i);
  if (i < n) {
    HWY_ALIGN float g[kMaxLanes] = {}, u[kMaxLanes] = {};
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    hn::Store(f(hn::Load(d, g), hn::Load(d, u)), d, g);
    std::copy(g, g + (n - i), gate + i);
  }
}

void SiluMul(float* gate, const float* up, int64_t n) {
  const hn::ScalableTag<float> d;
  const auto one = hn::Set(d, 1.0f);
  MapGated(d, gate, up, n, [&](auto g, auto u) { return hn::Mul(hn::Div(g, hn::Add(one, hn::Exp(d, hn::Neg(g)))), u); });
}

void GeluTanhMul(float* gate, const float* up, int64_t n) {
  const hn::ScalableTag<float> d;
  const auto half = hn::Set(d, 0.5f), one = hn::Set(d, 1.0f);
  const auto sqrt_2_over_pi = hn::Set(d, 0.7978845608028654f), cubic = hn::Set(d, 0.044715f);
  MapGated(d, gate, up, n, [&](auto g, auto u) {
    const auto inner = hn::Mul(sqrt_2_over_pi, hn::MulAdd(hn::Mul(cubic, g), hn::Mul(g, g), g));
    return hn::Mul(hn::Mul(hn::Mul(half, g), hn::Add(one, hn::Tanh(d, inner))), u);
  });
}

// gpt-oss's clamped SwiGLU (ggml's swiglu_oai, alpha 1.702, limit 7): a = min(g, 7),
// b = clamp(u, -7, 7), a / (1 + exp(-1.702 a)) * (b + 1).
void SwigluOaiMul(float* gate, const float* up, int64_t n) {
  const hn::ScalableTag<float> d;
  const auto one = hn::Set(d, 1.0f), limit = hn::Set(d, 7.0f), alpha = hn::Set(d, -1.702f);
  MapGated(d, gate, up, n, [&](auto g, auto u) {
    const auto a = hn::Min(g, limit);
    const auto b = hn::Clamp(u, hn::Neg(limit), limit);
    return hn::Mul(hn::Div(a, hn::Add(one, hn::Exp(d, hn::Mul(alpha, a)))), hn::Add(b, one));
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(SiluMul);
HWY_EXPORT(GeluTanhMul);
HWY_EXPORT(SwigluOaiMul);

void silu_mul(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(SiluMul)(gate, up, n); }
void gelu_tanh_mul(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(GeluTanhMul)(gate, up, n); }

void swiglu_oai_mul(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(SwigluOaiMul)(gate, up, n); }

void glu(Activation act, float* gate, const float* up, int64_t n) {
  switch (act) {
    case Activation::kGeluTanh: return gelu_tanh_mul(gate, up, n);
    case Activation::kSwigluOai: return swiglu_oai_mul(gate, up, n);
    case Activation::kSilu: break;
  }
  silu_mul(gate, up, n);
}

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
