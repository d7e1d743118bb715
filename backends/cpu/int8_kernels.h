// Integer kernels of the CPU backend: activations quantized to int8 per block of 32, and
// GEMV / flat GEMM / tiled GEMM on the GGUF-native weight formats Q4_0, Q4_1 and Q8_0 and on
// ringlm's INT4 formats (quant/int4.h: i4s/i4a, group 32 or 128, fp16/bf16/fp32 scales), read in
// place from the mmap (never requantized or repacked).
//
// Per weight block g (G = 32 or 128 weights, G/32 activation blocks b) of row n and token m the
// kernels compute
//     y[m][n] += dw_g * sum_b dx_b * sum_i qw_i * qx_i  (+ m_g * sum_b s_b for the min formats)
// where qw are the weight integers (symmetric 4-bit: code - 8, Q4_1/i4a: the code 0..15, Q8_0:
// the signed byte), qx the int8 activations, dx their scale and s_b = dx_b * sum_i qx_i, so the
// min term (w = dw * q + m) costs one float multiply-add per block instead of a pass over it, and
// a g128 block applies its scale once to the sum of its four sub-block dots.
//
// Code is compiled for every x86 target Highway knows and chosen at run time
// (HWY_DYNAMIC_DISPATCH): AVX2 uses vpmaddubsw + vpmaddwd on 256-bit vectors, the AVX-512
// targets reuse that code (their ISA includes AVX2), and AVX-512 VNNI (HWY_AVX3_DL) uses
// vpdpbusd. Other targets run a portable scalar fallback.
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant/formats.h"

namespace ringlm::cpu {

inline constexpr int64_t kActBlock = 32;  // activation block: a weight block of Q4_0/Q4_1/Q8_0/g32, a quarter of g128

// M token rows of K activations, quantized: row m's block b covers x[m][32b, 32b + 32).
// Row-major so that a token's blocks are contiguous; the buffers belong to the caller.
struct QuantizedActs {
  int8_t* q = nullptr;  // [M][K] int8 values in [-127, 127]
  float* d = nullptr;   // [M][K/32] block scale: max|x| / 127 (0 for an all-zero block)
  float* s = nullptr;   // [M][K/32] d * (sum of the block's int8 values)
  int64_t k = 0;        // row length K (a multiple of 32)
  int64_t blocks() const { return k / kActBlock; }
};

// Whether the int8 kernels run weights of `type`: Q4_0, Q4_1, Q8_0 and the 12 INT4 type ids of
// quant/int4.h (int4_type_id cast to TensorType).
bool int8_supported(TensorType type);

// Quantizes rows [m_begin, m_end) of x ([M][K] fp32) into `out` (sized for them):
// per block d = max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|).
void quantize_acts(const float* x, int64_t m_begin, int64_t m_end, const QuantizedActs& out);

// y[m][n] = sum_k W[n][k] * xq[m][k] for n in [n_begin, n_end), m in [0, n_tokens);
// y has row stride ldy. W rows are `row_stride` bytes apart, starting at `w`; K (xq.k) must be a
// multiple of the format's block (128 for the g128 formats).
// Each output is summed in a fixed order that depends on neither the row range nor n_tokens'
// tiling, so splitting rows across threads cannot change results.
void gemm_int8(TensorType type, const uint8_t* w, size_t row_stride, int64_t n_begin, int64_t n_end,
               const QuantizedActs& xq, int64_t n_tokens, float* y, int64_t ldy);

}  // namespace ringlm::cpu
