// Quantization: one row of fp32 weights to a stored type.
//
// GGML's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 follow GGML's reference quantizer bit for bit
// (ggml-quants.c's quantize_row_*_ref, the same rounding as the `gguf` Python package), so a file
// ringlm writes in those types is the file llama.cpp would write from the same weights.
//
// The K-quants Q4_K, Q5_K and Q6_K use the method of GGML's reference quantizers, in ringlm's own
// code (the bytes may differ from llama.cpp's; both are valid blocks): per sub-block, a search over
// step sizes for the scale (and min) with the least weighted squared error, the sub-block scales
// stored as codes of the super-block scale (a neighbouring code where it fits better), then every
// weight rounded to the nearest value of its grid as stored.
//
// ringlm's INT4 types (quant/int4.h) are quantized group by group: round to nearest on a grid
// whose scale (and min) is chosen per group, optionally by a clipping search (see QuantizeOptions).
// The nibbles are always chosen against the scale as stored (rounded to fp16/bf16), so every
// weight lands on the nearest point of the grid the kernels will actually see.
#pragma once

#include <cstdint>

#include "quant/formats.h"

namespace ringlm {

struct QuantizeOptions {
  // INT4 types only. Off: the round-to-nearest baseline, whose grid spans the whole group
  // (i4s: the weight of largest magnitude maps to -8, as GGML's Q4_0 does; i4a: the min maps to
  // q = 0 and the max to q = 15). On: also try grids clipped to 80%..100% of that span in steps of
  // 1% and keep the one with the smallest squared error over the group. Clipping a rare outlier
  // buys a finer step for every other weight; the unclipped grid is among the candidates, so
  // the search never does worse than round-to-nearest.
  bool clip_search = true;
};

// Whether quantize_row() can produce `type`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K and the INT4 types.
bool can_quantize(TensorType type);

// Quantizes n weights (n a multiple of the type's block size) into row_bytes(type, n) bytes at dst.
// Throws std::invalid_argument for a type can_quantize() rejects or a bad n.
void quantize_row(TensorType type, const float* src, void* dst, int64_t n, const QuantizeOptions& options = {});

}  // namespace ringlm
