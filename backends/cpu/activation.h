// Element-wise activations of the CPU backend, vectorized per Highway target.
#pragma once

#include <cstdint>

#include "backends/backend.h"

namespace ringlm::cpu {

// gate[i] = silu(gate[i]) * up[i] for i < n, silu(x) = x / (1 + exp(-x)): the SwiGLU of the
// feed-forward block. exp is Highway's (within a few ulp of std::exp), in every lane alike.
void silu_mul(float* gate, const float* up, int64_t n);

// gate[i] = gelu(gate[i]) * up[i], GELU in its tanh form (Activation::kGeluTanh): the GeGLU of
// Gemma's feed-forward block; tanh is Highway's.
void gelu_tanh_mul(float* gate, const float* up, int64_t n);

// gpt-oss's clamped SwiGLU (Activation::kSwigluOai): a = min(gate, 7), b = clamp(up, -7, 7),
// gate = a * sigmoid(1.702 a) * (b + 1).
void swiglu_oai_mul(float* gate, const float* up, int64_t n);

// gate = act(gate, up) for the activation a model names.
void glu(Activation act, float* gate, const float* up, int64_t n);

}  // namespace ringlm::cpu
