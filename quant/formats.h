// Weight formats: the GGML tensor type ids that GGUF files carry, the byte layout of each
// quantized block, and the size rules every reader must check before touching data.
//
// Block layouts are plain structs so that backends and plugins can share them (DESIGN.md:
// plugins see only plugin_api.h and these layouts).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace ringlm {

// GGML type ids as stored in GGUF tensor infos. Only the ones ringlm reads are named;
// other ids are recognised as "known but unsupported" by type_traits().
enum class TensorType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  IQ4_NL = 20,
  IQ4_XS = 23,
  BF16 = 30,
  MXFP4 = 39,
};

// fp16 / bf16 storage: raw bits, converted explicitly.
using f16_bits = uint16_t;
using bf16_bits = uint16_t;

inline constexpr int kQK4_0 = 32;
inline constexpr int kQK4_1 = 32;
inline constexpr int kQK5_0 = 32;
inline constexpr int kQK5_1 = 32;
inline constexpr int kQK8_0 = 32;
inline constexpr int kQK4_NL = 32;
inline constexpr int kQKMxfp4 = 32;
inline constexpr int kQK_K = 256;      // super-block of the K-quants and IQ4_XS
inline constexpr int kKScaleBytes = 12;  // packed 6-bit scales/mins of Q4_K and Q5_K (and Q3_K's 6-bit scales)

// The 16 values a 4-bit IQ4_NL / IQ4_XS code stands for (a non-linear grid, denser near 0).
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The 16 values of an MXFP4 code (OCP microscaling FP4, E2M1: sign, 2 exponent bits, 1 mantissa
// bit), times two so that they are integers: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
// (code 8 is -0). The block scale is halved to make up for it (e8m0_half_to_fp32).
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Half of an E8M0 scale: the byte e stands for 2^(e - 127), so this is 2^(e - 128), exact in
// float32 for every e (e = 0 and 1 give the subnormals 2^-128 and 2^-127; e = 255, which the OCP
// format reserves for NaN, gives 2^127 as ggml reads it). Built from the bits: a normal float's
// exponent field is e - 1, and below it the one mantissa bit 2^(e - 128) / 2^-149 = 1 << (21 + e).
inline float e8m0_half_to_fp32(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 1u << (21 + e);
  return std::bit_cast<float>(bits);
}

// 32 weights: w = d * (q - 8), q in [0, 15]. Low nibbles hold elements 0..15, high 16..31.
struct BlockQ4_0 {
  f16_bits d;
  uint8_t qs[kQK4_0 / 2];
};
// 32 weights: w = d * q + m, q in [0, 15]. Same nibble order as Q4_0.
struct BlockQ4_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qs[kQK4_1 / 2];
};
// 32 weights: w = d * (q - 16), q in [0, 31]: the low 4 bits as in Q4_0 (low nibbles elements
// 0..15, high 16..31), the fifth bit of element j in bit j of qh (little-endian 32-bit word).
struct BlockQ5_0 {
  f16_bits d;
  uint8_t qh[4];
  uint8_t qs[kQK5_0 / 2];
};
// 32 weights: w = d * q + m, q in [0, 31]; bits as in Q5_0.
struct BlockQ5_1 {
  f16_bits d;
  f16_bits m;
  uint8_t qh[4];
  uint8_t qs[kQK5_1 / 2];
};
// 32 weights: w = d * q, q in [-128, 127].
struct BlockQ8_0 {
  f16_bits d;
  int8_t qs[kQK8_0];
};
// 256 weights in 16 sub-blocks of 16: w = d * (scales[j] & 15) * q - dmin * (scales[j] >> 4), q in
// [0, 3]. Element e = 128 h + 32 k + l (h half, k 0..3, l 0..31) is bits 2k..2k+1 of qs[32 h + l].
struct BlockQ2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  f16_bits d;
  f16_bits dmin;
};
// 256 weights in 16 sub-blocks of 16: w = d * (s_j - 32) * (q - 4 * !hbit), q in [0, 3] placed as
// Q2_K's; the high bit of element e = 32 b + l is bit b of hmask[l]; the 6-bit scales s_j packed
// in 12 bytes (low nibbles in bytes 0..7, high crumbs in bytes 8..11).
struct BlockQ3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[kKScaleBytes];
  f16_bits d;
};
// 256 weights in 8 sub-blocks of 32: w = d * scale_j * q - dmin * min_j, 6-bit scale/min per sub-block.
struct BlockQ4_K {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qs[kQK_K / 2];
};
// 256 weights as Q4_K plus a fifth bit: element e = 32 b + l has its high bit in bit b of qh[l].
struct BlockQ5_K {
  f16_bits d;
  f16_bits dmin;
  uint8_t scales[kKScaleBytes];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
// 256 weights in 16 sub-blocks of 16: w = d * scale_j * (q - 32), q 6 bits split into ql (4) + qh (2).
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  f16_bits d;
};

// 32 weights: w = d * kIq4nlValues[q], nibbles as in Q4_0.
struct BlockIQ4_NL {
  f16_bits d;
  uint8_t qs[kQK4_NL / 2];
};
// 32 weights: w = e8m0_half_to_fp32(e) * kMxfp4Values[q], nibbles as in Q4_0.
struct BlockMXFP4 {
  uint8_t e;
  uint8_t qs[kQKMxfp4 / 2];
};
// 256 weights in 8 sub-blocks of 32: w = d * (s_j - 32) * kIq4nlValues[q]; s_j is 6 bits, its low
// 4 in scales_l (nibble j % 2 of byte j / 2) and its high 2 in bits 2j..2j+1 of scales_h. Each
// sub-block's 16 bytes of nibbles as in IQ4_NL.
struct BlockIQ4_XS {
  f16_bits d;
  uint16_t scales_h;
  uint8_t scales_l[kQK_K / 64];
  uint8_t qs[kQK_K / 2];
};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ2_K) == 84);
static_assert(sizeof(BlockQ3_K) == 110);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockIQ4_XS) == 136);
static_assert(sizeof(BlockMXFP4) == 17);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ6_K) == 210);

struct TypeTraits {
  std::string_view name;
  int64_t block_elems;  // weights per block (1 for plain float types)
  size_t block_bytes;   // bytes per block
  bool readable;        // ringlm can dequantize it
};

// Traits of a GGML type id; nullopt for ids that GGML does not define at all.
std::optional<TypeTraits> type_traits(uint32_t type_id);

// Bytes of one row of n elements; n must be a multiple of the block size (checked by callers).
size_t row_bytes(TensorType type, int64_t n);

// Dequantizes one row of n elements (n a multiple of the block size) to fp32.
// The reference path: every readable type goes through here.
void dequantize_row(TensorType type, const void* src, float* dst, int64_t n);

// The type a name stands for, as `ringlm quantize --type` takes it (case-insensitive): F32, F16,
// BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and ringlm's twelve INT4 types (quant/int4.h;
// the default fp16 scale may also be spelled out, as in "i4s-g128-f16"). nullopt for any other name.
std::optional<TensorType> parse_quantize_type(std::string_view name);
// The names parse_quantize_type() accepts, in their canonical spelling (for error messages).
const std::vector<std::string_view>& quantize_type_names();

float fp16_to_fp32(f16_bits h);
f16_bits fp32_to_fp16(float f);
float bf16_to_fp32(bf16_bits h);
bf16_bits fp32_to_bf16(float f);

}  // namespace ringlm
