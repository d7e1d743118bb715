// Activation quantization for the int8 kernels (kernel_packed.h): the rows a product reads,
// turned into int8 with the scales and sums each weight format's arithmetic needs.
//
//   QuantizedActs (per block of 32): for the block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
//     MXFP4 and ringlm's INT4 types), whose weights carry a float scale per block of 32 or 128. Per
//     weight block the kernels add dw * dx * (integer dot), the dot taken against the codes as they
//     are stored, so the block's sum of int8 values undoes what stored codes add: an offset of
//     unsigned codes (w = d (c - 8)), or the 128 that VNNI adds to signed ones, comes off the
//     integer dot as offset * sum, and a min (w = d c + m) adds m * s, s = dx * sum. Either costs a
//     few operations per block, not a pass over it.
//   SuperActs (per block of 256): for the super formats (K-quants, IQ4_XS), whose weights carry a
//     float scale per 256 and small integer scales per sub-block of 16 or 32. With one activation
//     scale per 256, the sub-block scales multiply the integer dots in integers and one float
//     multiply-add per 256 remains; the integer sums per 16 and per 32 serve the integer mins
//     and offsets. This is llama.cpp's Q8_K, so K-quant files compute as they do there.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ringlm::cpu {

inline constexpr int64_t kActBlock = 32;    // QuantizedActs block
inline constexpr int64_t kSuperBlock = 256;  // SuperActs block

// M token rows of K activations, quantized per 32: row m's block b covers x[m][32b, 32b + 32).
// Row-major so that a token's blocks are contiguous; the buffers belong to the caller.
struct QuantizedActs {
  int8_t* q = nullptr;  // [M][K] int8 values in [-127, 127]
  float* d = nullptr;   // [M][K/32] block scale: max|x| / 127 (0 for an all-zero block)
  float* s = nullptr;   // [M][K/32] d * (sum of the block's int8 values)
  int32_t* sum = nullptr;  // [M][K/32] the sum of the block's int8 values
  int64_t k = 0;        // row length K (a multiple of 32)
  int64_t blocks() const { return k / kActBlock; }
};

// M token rows of K activations, quantized per 256 (K a multiple of 256).
struct SuperActs {
  int8_t* q = nullptr;        // [M][K] int8 values in [-127, 127]
  float* d = nullptr;         // [M][K/256] block scale: max|x| / 127
  int32_t* sum16 = nullptr;   // [M][K/16] integer sum of each 16 int8 values
  int32_t* sum32 = nullptr;   // [M][K/32] integer sum of each 32
  int64_t k = 0;
  int64_t blocks() const { return k / kSuperBlock; }
};

// How the packed products cut n tokens into passes over a weight group: ceil(n / 8) passes of
// near equal size, the first ones the larger (9 tokens: 5 + 4; a pass costs about the same for 1
// token as for 8, so a short last one would cost a full one). Pass i covers [i * size, ...).
inline int64_t pass_size(int64_t n_tokens) {
  const int64_t passes = (n_tokens + 7) / 8;
  return passes > 0 ? (n_tokens + passes - 1) / passes : 0;
}

// The activations of n tokens laid out for those passes: in the pass of W tokens from m0, every
// per-token array (the int8 values as units of 32, the scales, the sums) holds unit u of token
// m0 + t at m0 * units + u * W + t, units being its units per token; so a pass reads its tokens'
// units as one stream. For one token this is the row-major layout itself.
struct PassPlace {
  int64_t m0 = 0, t = 0, width = 1;  // token m is token t of the pass of `width` tokens from m0
  int64_t at(int64_t units, int64_t u) const { return m0 * units + u * width + t; }
};
inline PassPlace pass_place(int64_t m, int64_t n_tokens) {
  const int64_t size = pass_size(n_tokens), m0 = m / size * size;
  return {m0, m - m0, std::min(size, n_tokens - m0)};
}

// Copies token m's values (of rows, row-major) to their places in `passes`, laid out for
// n_tokens; both start at the same token.
void lay_out_for_passes(const QuantizedActs& rows, int64_t m, int64_t n_tokens, const QuantizedActs& passes);
void lay_out_for_passes(const SuperActs& rows, int64_t m, int64_t n_tokens, const SuperActs& passes);

// Quantizes rows [m_begin, m_end) of x ([M][K] fp32) into `out` (sized for them):
// per block d = max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|).
void quantize_acts(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out);
// The same per block of 256, with the integer sums.
void quantize_acts_super(const float* x, int64_t m_begin, int64_t m_end, const SuperActs& out);

}  // namespace ringlm::cpu
