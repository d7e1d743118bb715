#include "core/model/rope_tables.h"

#include <cmath>
#include <string>

#include "core/model/layer_weights.h"

namespace ringlm {

RopeTables::RopeTables(const LlamaHparams& hp, const ArchInfo& arch, ModelTensors& tensors) : hp_(hp) {
  auto factors = [&](bool carried, const std::string& name) {
    return carried && tensors.has(name) ? std::optional(tensors.vector(name, half())) : std::nullopt;
  };
  const std::optional<std::vector<float>> rope_freqs = factors(arch.rope_freqs, "rope_freqs.weight");
  const std::optional<std::vector<float>> short_factors = factors(arch.long_rope, "rope_factors_short.weight");
  const std::optional<std::vector<float>> long_factors = factors(arch.long_rope, "rope_factors_long.weight");
  const auto ptr = [](const std::optional<std::vector<float>>& v) { return v ? &*v : nullptr; };
  inv_freq_.push_back(rope_frequencies(hp, hp.rope_base, rope_freqs ? ptr(rope_freqs) : ptr(short_factors), true));
  if (short_factors || long_factors) inv_freq_long_ = rope_frequencies(hp, hp.rope_base, ptr(long_factors), true);
  if (hp.swa_period > 0) inv_freq_.push_back(rope_frequencies(hp, hp.swa_rope_base, nullptr, hp.swa_rope_scaled));
}

const std::vector<double>& RopeTables::inv_freq(size_t set, int n_ctx) const {
  const bool long_context = set == 0 && !inv_freq_long_.empty() && n_ctx > hp_.rope_n_ctx_orig;
  return long_context ? inv_freq_long_ : inv_freq_[set];
}

void RopeTables::angles(size_t set, int64_t pos0, int n, int n_ctx, float* cos, float* sin) const {
  const std::vector<double>& freq = inv_freq(set, n_ctx);
  const double mscale = hp_.rope_mscale();
  const auto h = static_cast<size_t>(half());
  for (int t = 0; t < n; ++t) {
    const double p = static_cast<double>(pos0 + t);
    for (size_t i = 0; i < h; ++i) {
      const double theta = p * freq[i];
      cos[static_cast<size_t>(t) * h + i] = static_cast<float>(mscale * std::cos(theta));
      sin[static_cast<size_t>(t) * h + i] = static_cast<float>(mscale * std::sin(theta));
    }
  }
}

void RopeTables::shift_angles(size_t set, int n_discard, int n_ctx, float* cos, float* sin) const {
  const std::vector<double>& freq = inv_freq(set, n_ctx);
  for (size_t i = 0; i < static_cast<size_t>(half()); ++i) {
    const double theta = -static_cast<double>(n_discard) * freq[i];
    cos[i] = static_cast<float>(std::cos(theta));
    sin[i] = static_cast<float>(std::sin(theta));
  }
}

}  // namespace ringlm
