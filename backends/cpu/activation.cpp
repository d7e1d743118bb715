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

void SiluMul(float* gate, const float* up, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto one = hn::Set(d, 1.0f);
  const auto silu_mul = [&](auto g, auto u) { return hn::Mul(hn::Div(g, hn::Add(one, hn::Exp(d, hn::Neg(g)))), u); };
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(silu_mul(hn::LoadU(d, gate + i), hn::LoadU(d, up + i)), d, gate + i);
  // The tail through the same vector code (padded copies), so every element is computed alike.
  if (i < n) {
    HWY_ALIGN float g[kMaxLanes] = {}, u[kMaxLanes] = {};
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    hn::Store(silu_mul(hn::Load(d, g), hn::Load(d, u)), d, g);
    std::copy(g, g + (n - i), gate + i);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace ringlm::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace ringlm::cpu {

HWY_EXPORT(SiluMul);

void silu_mul(float* gate, const float* up, int64_t n) { HWY_DYNAMIC_DISPATCH(SiluMul)(gate, up, n); }

}  // namespace ringlm::cpu
#endif  // HWY_ONCE
