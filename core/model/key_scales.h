// Key channel scales for caches that quantize their keys in blocks.
//
// A score is q · k = Σ_c q[c] k[c]. Dividing every cached key by s[c], channel by channel, and
// multiplying every query by the same s[c] leaves each score as it was, but changes the error a
// block of quantized key elements makes: a channel whose keys are large but whose queries are
// small (Gemma 3's QK-norm makes many) no longer sets the step of its block for the channels
// that matter. With s[c] = (E[k_c²] / E[q_c²])^(1/4) the two sides' channels meet halfway
// (SmoothQuant's balance with alpha 1/2), which evens out what each channel adds to a score's
// error (bench/README.md: Gemma 3 270M's q4_0 perplexity loss falls from +13.7% to +2.6%).
// The StreamingLLM shift multiplies a key back before it rotates it, and divides it again after.
#pragma once

#include <span>
#include <vector>

namespace ringlm {

struct KeyScaleShape {
  int n_head = 0;     // query heads per row
  int n_head_kv = 0;  // key heads per row; query head h reads key head h / (n_head / n_head_kv)
  int head_dim = 0;
};

// Rows of a pass that calibrate nothing: too few to measure a channel (the scales stay 1).
inline constexpr int kKeyScaleMinRows = 8;
// The scales stay within [1 / kKeyScaleLimit, kKeyScaleLimit].
inline constexpr float kKeyScaleLimit = 16.0f;

// The scales (n_head_kv * head_dim) from n rows of queries ([n][n_head][head_dim]) and keys
// ([n][n_head_kv][head_dim]) as the cache would store them (after RoPE): per key channel the
// mean square of its keys and of the queries of its group's heads, s = (E[k²] / E[q²])^(1/4),
// divided per head by the head's geometric mean (its keys keep their overall size) and clamped.
// A channel with no signal on either side keeps 1.
std::vector<float> calibrate_key_scales(std::span<const float> q, std::span<const float> k, int n,
                                        const KeyScaleShape& shape);

}  // namespace ringlm
