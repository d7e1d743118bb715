// What the model does to key and value rows on their way into (and inside) a KV cache: the RoPE
// rotation and fp16 storage, vectorized per Highway target.
#pragma once

#include <cstdint>

namespace ringlm::cpu {

// How a head's rotary elements pair up: element 2i with 2i + 1 (llama.cpp's GGUF Llama layout),
// or i with i + n_rot / 2 (NeoX).
enum class RopePairs { kAdjacent, kHalves };

// The rotation tables of one angle set, expanded to one entry per rotary element e < n_rot so
// that every element is rotated alike: for the pair (a, b) at angle θ, a' = a cos θ - b sin θ
// and b' = a sin θ + b cos θ, i.e. x'[e] = x[e] * cos_x[e] + x[partner(e)] * sin_x[e] with
// cos_x = cos θ at both, sin_x = -sin θ at a and +sin θ at b.
void expand_rope_angles(const float* cos, const float* sin, int n_rot, RopePairs pairs, float* cos_x,
                        float* sin_x);

// Rotates the first n_rot elements of each of n_heads vectors (head_dim apart) in place by the
// expanded tables: per element, two products and one sum (fused where the target has FMA).
void rotate_heads(float* vec, int n_heads, int head_dim, int n_rot, RopePairs pairs, const float* cos_x,
                  const float* sin_x);

// x <- H x for each of n_heads vectors of head_dim elements (a power of two), H the orthonormal
// Walsh-Hadamard matrix of that size (H = H^T = H^-1), by the fast transform (log2(head_dim)
// rounds of sums and differences, then 1/sqrt(head_dim)). It spreads a head's outlier channels
// over all its elements before a cache quantizes them (QuaRot; llama.cpp's quantized caches do
// the same), and leaves every dot product between two rotated vectors as it was.
void hadamard_heads(float* x, int n_heads, int head_dim);

// n values (whole blocks of 32) into Q4_0 blocks at out, each block's step chosen by a clip
// search: among GGML's grid (the value of largest magnitude at -8 steps), its mirror (that value
// at +7 steps, so that the other side gets the eighth) and both clipped to 96%, 92%, ..., 80% of
// their span, the one of least squared error, GGML's on a tie; every value then at its nearest
// point. The same format (any Q4_0 reader reads them), no block further from its values than
// GGML's rounding: what a q4_0 KV cache stores, whose keys' outliers GGML's grid pays for in
// every other value of their block (bench/README.md: SmolLM2 loses a fifth less perplexity).
inline constexpr int kQ4_0Clips = 6;             // 100%, 96%, ..., 80%
inline constexpr float kQ4_0ClipStep = 0.04f;
inline constexpr int kQ4_0Grids = 2 * kQ4_0Clips;  // GGML's grid and its mirror, each clipped so
static_assert(kQ4_0Grids <= 16);
void quantize_q4_0_searched(const float* x, uint8_t* out, int64_t n);

// dst[i] = fp16(src[i]) (round to nearest even) and back, for i < n.
void fp32_to_fp16_row(const float* src, uint16_t* dst, int64_t n);
void fp16_to_fp32_row(const uint16_t* src, float* dst, int64_t n);

}  // namespace ringlm::cpu
