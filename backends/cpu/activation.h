// Element-wise activations of the CPU backend, vectorized per Highway target.
#pragma once

#include <cstdint>

namespace ringlm::cpu {

// gate[i] = silu(gate[i]) * up[i] for i < n, silu(x) = x / (1 + exp(-x)): the SwiGLU of the
// feed-forward block. exp is Highway's (within a few ulp of std::exp), in every lane alike.
void silu_mul(float* gate, const float* up, int64_t n);

}  // namespace ringlm::cpu
