// Row-interleaved copies of the int8 kernels' weights (Q4_0, Q4_1, Q8_0 and the 12 INT4 formats
// of quant/int4.h), made once at prepare, and the GEMV / GEMM that reads them.
//
// Why: the in-place kernels (int8_kernels.h) spend most of their instructions rearranging a
// row's nibbles to meet the activations, then on horizontal sums, a conversion and a few FMAs
// per row and block. Here the weights of 8 rows are interleaved so that each 32-bit lane of a
// 256-bit register holds 4 bytes of one row: vpmaddubsw + vpmaddwd (or vpdpbusd) against 4
// activation bytes broadcast to every lane leave each row's partial dot in its own lane. One
// conversion and two FMAs then serve 8 rows per 32-weight block, and the 8 lanes of the
// accumulator are the 8 outputs: no horizontal sum at all.
//
// Layout: rows in groups of 8 (the last group padded with zero rows); each group is
// `group_bytes` bytes, 64-byte aligned, holding
//   codes:  K/32 sub-blocks x 128 bytes (nibbles) or 256 bytes (Q8_0), each as chunks of 32
//           bytes, row r's 4 bytes at r * 4 of every chunk. A nibble chunk c of a sub-block
//           holds, in byte j of a row, weight 8c + j in its low nibble and 8c + 4 + j in its
//           high nibble; a Q8_0 chunk c holds weights 4c .. 4c + 3.
//   scales: per weight block (32 or 128 weights) the 8 rows' scales in the format's storage
//           (fp16, bf16 or fp32: bits unchanged), then, for the asymmetric formats, their mins.
// A g128 block keeps one scale per group for all four of its sub-blocks. The packed bytes equal
// the stored ones (plus the padding rows and group alignment): packing costs a second copy of
// the weights, not a bigger one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "backends/cpu/int8_kernels.h"
#include "backends/cpu/weight_arena.h"
#include "quant/formats.h"

namespace ringlm::cpu {

inline constexpr int64_t kPackRows = 8;  // rows per interleaved group

struct PackedWeight {
  TensorType type = TensorType::F32;
  int64_t rows = 0, cols = 0;  // the matrix: rows outputs of cols inputs (unpadded)
  size_t group_bytes = 0;      // bytes of one 8-row group (a multiple of 64)
  std::shared_ptr<uint8_t> data;  // from a WeightArena (shared with other weights) or its own

  int64_t groups() const { return (rows + kPackRows - 1) / kPackRows; }
  size_t bytes() const { return group_bytes * static_cast<size_t>(groups()); }
  const uint8_t* group(int64_t g) const { return data.get() + group_bytes * static_cast<size_t>(g); }
};

// Packs a [rows][cols] matrix of `type` (int8_supported(type); cols a multiple of the format's
// block) whose rows are `row_stride` bytes apart from `w`. Groups are packed in parallel over
// the OpenMP threads (a nested call runs serially). The copy is cut from `arena` when given
// (weights packed in the order the model uses them lie in that order), else allocated alone.
PackedWeight pack_int8(TensorType type, const uint8_t* w, size_t row_stride, int64_t rows, int64_t cols,
                       WeightArena* arena = nullptr);

// y[m][n] = sum_k W[n][k] * xq[m][k] for n in [n_begin, n_end), m in [0, n_tokens), y with row
// stride ldy; as gemm_int8 on the unpacked weights, within the same rounding bound (the sums
// are ordered differently, so not bit-identical to it). n_begin must be a multiple of 8; n_end
// (at most w.rows) need not be: a part group computes all 8 rows and stores its own. xq.k must
// equal w.cols.
// Each output's sum has a fixed order, whatever the row range or the number of tokens.
void gemm_int8_packed(const PackedWeight& w, int64_t n_begin, int64_t n_end, const QuantizedActs& xq,
                      int64_t n_tokens, float* y, int64_t ldy);

}  // namespace ringlm::cpu
