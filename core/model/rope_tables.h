// A model's rotary position embedding as numbers: the inverse frequency of every rotary pair,
// every scaling folded in (linear, YaRN's per-pair mix and any file's frequency divisors are all
// linear in the position), per set of layers, and the cos and sin tables the forward pass and the
// StreamingLLM shift rotate by. Computed in double: positions reach millions, where float angles
// lose digits.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "backends/backend.h"
#include "core/model/hparams.h"

namespace ringlm {

class ModelTensors;

class RopeTables {
 public:
  // Set 0 for every layer (scaled; with the file's per-pair factors: rope_freqs, or LongRoPE's
  // short ones, the long ones kept apart), set 1 for sliding-window layers, with a base of their
  // own and no scaling. The factor tensors the family may carry are read (and marked used) here.
  RopeTables(const LlamaHparams& hp, const ArchInfo& arch, ModelTensors& tensors);

  size_t n_sets() const { return inv_freq_.size(); }
  int half() const { return hp_.n_rot / 2; }
  // The inverse frequencies of `set` for a cache of n_ctx positions: LongRoPE's long factors past
  // the original context, as llama.cpp's get_rope_factors chooses them by the context's size.
  const std::vector<double>& inv_freq(size_t set, int n_ctx) const;
  // cos and sin of every rotation angle of n positions from pos0, [n][half()] each, times
  // rope_mscale(): q and k come out of RoPE scaled by it.
  void angles(size_t set, int64_t pos0, int n, int n_ctx, float* cos, float* sin) const;
  // The rotation by -n_discard positions: a pure rotation, without rope_mscale(), which the keys
  // already carry from their own RoPE.
  void shift_angles(size_t set, int n_discard, int n_ctx, float* cos, float* sin) const;
  // Angle tables in this model's RoPE layout.
  RopeAngles layout(const float* cos, const float* sin) const {
    return RopeAngles{cos, sin, hp_.n_rot, hp_.rope_style == RopeStyle::kAdjacentPairs};
  }

 private:
  const LlamaHparams& hp_;
  // [set][n_rot / 2]: position p turns rotary pair i by p * inv_freq_[set][i].
  std::vector<std::vector<double>> inv_freq_;
  // LongRoPE (Phi-3 128k): set 0's frequencies for caches longer than rope_n_ctx_orig, where
  // inv_freq_[0] has the short factors'. Empty: none.
  std::vector<double> inv_freq_long_;
};

}  // namespace ringlm
