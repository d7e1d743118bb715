// The CPU backend's weight products: every weight matrix is copied once, at prepare, into the
// packed layout of packed_format.h (16 rows interleaved, scales next to their codes), and the
// products read only that copy.
//
// Why interleave rows: a kernel reading one row at a time spends most of its instructions
// rearranging the row's codes to meet the activations, then on horizontal sums. With 16 rows'
// codes side by side, one dot-product instruction (vpdpbusd on AVX-512 VNNI, vpmaddubsw +
// vpmaddwd on AVX2) against 4 activation bytes broadcast to every lane advances 16 outputs at
// once, each in its own lane, and one conversion and multiply-add per block of 32 (or per 256
// for the K-quants) serves all 16 rows. Why one stream per group: decode reads each weight byte
// once per token, and a thread's bytes arrive fastest as one sequential stream that it also asks
// for ahead of time (software prefetch far enough ahead to cover the memory latency).
//
// Activations come in the form each format's arithmetic needs (packed_format.h's ActKind):
//   - block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4, ringlm's INT4 types): int8 per
//     block of 32 with a float scale and sum (QuantizedActs),
//   - super formats (Q2_K..Q6_K, IQ4_XS): int8 per block of 256 with one scale and integer sums
//     per 16 and per 32 (SuperActs), so that sub-block scales apply in integers, as llama.cpp's
//     Q8_K does,
//   - F32, F16, BF16: the fp32 rows themselves (a converting multiply-add, no int8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backends/cpu/quantize_acts.h"
#include "backends/cpu/packed_format.h"
#include "backends/cpu/weight_arena.h"
#include "quant/formats.h"

namespace ringlm::cpu {

struct PackedWeight {
  TensorType type = TensorType::F32;
  int64_t rows = 0, cols = 0;  // the matrix: rows outputs of cols inputs (unpadded)
  size_t group_bytes = 0;      // bytes of one 16-row group (a multiple of 64)
  std::shared_ptr<uint8_t> data;  // from a WeightArena (shared with other weights) or its own

  int64_t groups() const { return (rows + kPackRows - 1) / kPackRows; }
  size_t bytes() const { return group_bytes * static_cast<size_t>(groups()); }
  const uint8_t* group(int64_t g) const { return data.get() + group_bytes * static_cast<size_t>(g); }
};

// Whether the packed kernels run weights of `type` with `cols` columns: every type of
// packed_format(), with cols a multiple of its row_multiple().
bool packed_supported(TensorType type, int64_t cols);

// Packs a [rows][cols] matrix of `type` (packed_supported) whose rows are `row_stride` bytes
// apart from `w`. Groups are packed in parallel over the OpenMP threads (a nested call runs
// serially). The copy is cut from `arena` when given (weights packed in the order the model uses
// them lie in that order), else allocated alone. Rows past `rows` in the last group are zero.
// With release_source (the source lies in a read-only file mapping), the whole pages of the
// source are given back to the kernel as they are read (re-read from the file if touched again).
PackedWeight pack_weight(TensorType type, const uint8_t* w, size_t row_stride, int64_t rows, int64_t cols,
                         WeightArena* arena = nullptr, bool release_source = false);

// Gives the kernel back the whole pages of a file mapping that lie inside [data, data + bytes).
void release_mapped_pages(const uint8_t* data, size_t bytes);

// Rows [n0, n1) of the packed matrix in fp32, row-major into out ([n1 - n0][cols]): the weights
// exactly as the file defines them (for the sgemm prefill path and the embedding lookup).
void dequantize_packed(const PackedWeight& w, int64_t n0, int64_t n1, float* out);

// The inputs of a product, in every form some weight may want: quantized per 32 (block
// formats), per 256 (super formats), or as fp32 rows (float formats; `f32` rows `cols` apart).
// Only the form the weight's format reads must be filled. `passes` and `super_passes` hold
// block's and super's values laid out for the kernels' passes (quantize_acts.h:
// lay_out_for_passes), which the products of several tokens read: each pass then reads its
// tokens as one stream. Without them (q null) gemm_packed lays them out itself, on every call.
struct PackedInput {
  QuantizedActs block;
  SuperActs super;
  const float* f32 = nullptr;
  QuantizedActs passes;
  SuperActs super_passes;
};

// y[m][n] = sum_k W[n][k] * x[m][k] for n in [n_begin, n_end), m in [0, n_tokens), y with row
// stride ldy. n_begin must be a multiple of 16; n_end (at most w.rows) need not be: a part group
// computes all 16 rows and stores its own. The input's row length must equal w.cols.
// Each output's sum has a fixed order, whatever the row range or the number of tokens, so
// splitting rows across threads cannot change results.
void gemm_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const PackedInput& x, int64_t n_tokens,
                 float* y, int64_t ldy);

}  // namespace ringlm::cpu
