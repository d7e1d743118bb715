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

#include <cstdint>
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

// RoPE as the cache's rows will have it. RoPE turns each rotary pair of channels by an angle
// that grows with the position, so a pair's two channels trade their mean squares along the
// context: rows measured after RoPE tell the mean squares of the positions they sit at, which for
// a short first pass (a chat's "hi") are not those of the context the cache will hold. Rows
// measured before RoPE, each pair's second moments carried over every position [0,
// n_positions) (the statistics of unrotated rows taken not to depend on the position), tell
// those of the whole context.
struct KeyScaleRope {
  std::span<const double> inv_freq;  // [n_rot / 2]: position p turns pair i by p * inv_freq[i]
  int n_rot = 0;                     // the rotated channels of a head (0: none, the rows as they are)
  bool adjacent_pairs = false;       // pairs (2i, 2i + 1), else (i, i + n_rot / 2)
  int64_t n_positions = 0;           // the positions a cache holds
};

// The scales (n_head_kv * head_dim) from n rows of queries ([n][n_head][head_dim]) and keys
// ([n][n_head_kv][head_dim]), before `rope` (or as the cache stores them, rope.n_rot 0): per key
// channel the mean square of its keys and of the queries of its group's heads over the context,
// s = (E[k²] / E[q²])^(1/4), divided per head by the head's geometric mean (its keys keep their
// overall size) and clamped. A channel with no signal on either side keeps 1.
std::vector<float> calibrate_key_scales(std::span<const float> q, std::span<const float> k, int n,
                                        const KeyScaleShape& shape, const KeyScaleRope& rope = {});

}  // namespace ringlm
