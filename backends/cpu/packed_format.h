// The packed weight layout of the CPU backend: how every weight type the kernels run is laid
// out after prepare() copies it out of the file, and what its numbers mean. Shared by the
// packing (packing.cpp), the SIMD kernels of every target (kernel_packed.cpp) and the scalar
// reading of the packed bytes (dequantize_packed, the portable fallback). Target-independent:
// one layout serves AVX2 and AVX-512 alike, so a packed matrix does not depend on the CPU.
//
// Rows come in groups of kPackRows = 16. A group is one stream of bytes, read front to back by
// one thread: a sequence of K-blocks, each a header (the scales of the 16 rows for that stretch
// of the row, padded to 64 bytes) followed by its codes. The codes of 32 consecutive weights (a
// "sub-block") are a few 64-byte chunks; in a chunk, row r owns bytes 4r..4r+3, so one 512-bit
// register (or two 256-bit ones) holds the same 4 weights' codes of all 16 rows, and a dot
// product instruction against 4 activation bytes broadcast to every lane leaves each row's sum
// in its own lane. No horizontal sums; one conversion and one multiply-add per block serve 16 rows.
//
// Code planes of one sub-block (weights w0..w31 of each row; "quad" q = weights 4q..4q+3):
//   kNib4      4 chunks: chunk c, row byte j: low nibble = code of w(8c+j) (quad 2c),
//              high nibble = code of w(8c+4+j) (quad 2c+1).
//   kNib4Hb1   kNib4 + 1 chunk of fifth bits: row byte j, bit 2c+h = bit 4 of w(8c+4h+j).
//   kNib4Hb2   kNib4 + 2 chunks of bits 4-5: chunk e, row byte j, bits 2k..2k+1 = bits 4-5 of the
//              weight of quad i = 4e+k, i.e. w(8c+4h+j) with 2c+h = i.
//   kCrumb2    2 chunks: chunk c, row byte j, bits 2k..2k+1 = code of w(16c+4k+j) (quad 4c+k).
//   kCrumb2Hb1 kCrumb2 + 1 chunk: row byte j, bit i = bit 2 of w(4i+j) (quad i).
//   kBytes     8 chunks: chunk c = quad c, one signed byte per weight.
//   kHalf, kBf16, kFloat: no header; per weight k, the 16 rows' values (32 or 64 bytes).
//
// Headers (S = 16 rows x bytes of one value, row-major within each field):
//   block formats (scale per block of 32 or 128, activations quantized per 32): the scales of
//     kblock / group blocks (fp16, bf16 or fp32 bits as stored in the file; MXFP4's E8M0 byte
//     as the bf16 of its halved scale, the same number), then as many mins
//     for the formats with a min. A K-block holds as many blocks as fill 64 header bytes
//     (two blocks of a format with one 16-bit scale, else one).
//   super formats (K-quants, IQ4_XS: 256 weights, activations quantized per 256): fp16 d, fp16
//     dmin (formats with mins), then one byte per sub-block and row: the sub-block scale (Q2_K:
//     scale in the low nibble, min in the high one), then for Q4_K/Q5_K one byte of min.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>

#include "quant/formats.h"
#include "quant/int4.h"

namespace ringlm::cpu {

inline constexpr int64_t kPackRows = 16;    // rows per group: the lanes of one 512-bit register
inline constexpr size_t kChunkBytes = 64;   // 16 rows x 4 code bytes
inline constexpr int64_t kSubWeights = 32;  // weights per sub-block (8 quads of 4)

enum class Codes : uint8_t { kNib4, kNib4Hb1, kNib4Hb2, kCrumb2, kCrumb2Hb1, kBytes, kHalf, kBf16, kFloat };

// The table a code book format's 4-bit codes index. (An enum, not the table's address: GCC does
// not fold a global's address compared with null under the sanitizers, and the kernels decide on
// it at compile time.)
enum class CodeBook : uint8_t { kNone, kIq4nl, kMxfp4 };
inline const int8_t* codebook_values(CodeBook c) { return c == CodeBook::kMxfp4 ? kMxfp4Values : kIq4nlValues; }

// Which activations a format's kernel reads.
enum class ActKind : uint8_t {
  kBlock32,   // int8 per block of 32 with its scale and sum (QuantizedActs)
  kSuper256,  // int8 per block of 256 with one scale and integer sums per 16 and 32 (SuperActs)
  kFloat,     // the fp32 rows themselves
};

struct PackedFormat {
  TensorType type = TensorType::F32;
  Codes codes = Codes::kFloat;
  ActKind acts = ActKind::kFloat;
  int group = 1;       // weights per float scale: 32 or 128 (block formats), 256 (super formats)
  int sub = 32;        // super formats: weights per integer sub-block scale, 16 or 32
  bool min = false;    // block: a float min per block; super: fp16 dmin and integer mins
  int offset = 0;      // integer weight = code - offset (block sym 4-bit: 8, Q5_0: 16, Q3_K: 4, Q6_K: 32)
  // A code book format's 16 values, which its 4-bit codes index (IQ4_NL, IQ4_XS: kIq4nlValues;
  // MXFP4: kMxfp4Values); kNone for the formats whose codes are the integers themselves.
  CodeBook codebook = CodeBook::kNone;
  bool signed_scales = false;   // super: sub-block scales are signed bytes (Q3_K, Q6_K, IQ4_XS)
  bool nibble_scale_min = false;  // super: scale and min share a byte (Q2_K)
  ScaleType scale = ScaleType::kF16;  // block formats: scales and mins in the header (as in the file; MXFP4: bf16)
  int kblock = 0;               // weights per K-block (one header)
  size_t header_bytes = 0;      // per full K-block, a multiple of 64

  constexpr bool super() const { return acts == ActKind::kSuper256; }
  constexpr bool has_codebook() const { return codebook != CodeBook::kNone; }
  constexpr int subs() const { return static_cast<int>(kblock / sub); }  // super: sub-block scales per K-block
  // Super headers: where the sub-block scales and (Q4_K, Q5_K) the mins start.
  constexpr size_t scales_offset() const { return min ? 64 : 32; }
  constexpr size_t mins_offset() const { return scales_offset() + static_cast<size_t>(subs()) * kPackRows; }
  constexpr bool floats() const { return acts == ActKind::kFloat; }
  constexpr size_t value_bytes() const { return scale == ScaleType::kF32 ? 4 : 2; }
  // Code bytes of one sub-block of 16 rows.
  constexpr size_t sub_code_bytes() const {
    switch (codes) {
      case Codes::kNib4: return 4 * kChunkBytes;
      case Codes::kNib4Hb1: return 5 * kChunkBytes;
      case Codes::kNib4Hb2: return 6 * kChunkBytes;
      case Codes::kCrumb2: return 2 * kChunkBytes;
      case Codes::kCrumb2Hb1: return 3 * kChunkBytes;
      case Codes::kBytes: return 8 * kChunkBytes;
      case Codes::kHalf:
      case Codes::kBf16: return static_cast<size_t>(kSubWeights * kPackRows * 2);
      case Codes::kFloat: return static_cast<size_t>(kSubWeights * kPackRows * 4);
    }
    return 0;
  }
  // Header bytes of a K-block of n weights (the last K-block of a row may be shorter).
  constexpr size_t header_bytes_for(int64_t n) const {
    if (floats()) return 0;
    if (super()) return header_bytes;
    const size_t raw = static_cast<size_t>(n / group) * kPackRows * value_bytes() * (min ? 2 : 1);
    return (raw + 63) / 64 * 64;
  }
  // Bytes of one 16-row group for rows of `cols` weights.
  constexpr size_t group_bytes(int64_t cols) const {
    const int64_t full = cols / kblock, rest = cols % kblock;
    size_t bytes = static_cast<size_t>(full) * (header_bytes + static_cast<size_t>(kblock / kSubWeights) * sub_code_bytes());
    if (rest > 0) bytes += header_bytes_for(rest) + static_cast<size_t>(rest / kSubWeights) * sub_code_bytes();
    return bytes;
  }
  // The row length a matrix of this format must be a multiple of.
  constexpr int64_t row_multiple() const { return floats() ? kSubWeights : std::max<int64_t>(group, kSubWeights); }
};

// --- The layout of each type ---------------------------------------------------------------------

constexpr PackedFormat block_format(TensorType type, Codes codes, int group, bool min, int offset, ScaleType scale,
                                    CodeBook codebook = CodeBook::kNone) {
  PackedFormat f;
  f.type = type;
  f.codes = codes;
  f.acts = ActKind::kBlock32;
  f.group = group;
  f.min = min;
  f.offset = offset;
  f.codebook = codebook;
  f.scale = scale;
  // As many blocks per K-block as fill 64 header bytes: two of a format with one 16-bit scale.
  const size_t per_block = static_cast<size_t>(kPackRows) * f.value_bytes() * (min ? 2 : 1);
  f.kblock = per_block == 32 ? 2 * group : group;
  f.header_bytes = f.header_bytes_for(f.kblock);
  return f;
}

constexpr PackedFormat super_format(TensorType type, Codes codes, int sub, bool min, int offset, bool signed_scales,
                                    CodeBook codebook = CodeBook::kNone, bool nibble_scale_min = false) {
  PackedFormat f;
  f.type = type;
  f.codes = codes;
  f.acts = ActKind::kSuper256;
  f.group = 256;
  f.sub = sub;
  f.min = min;
  f.offset = offset;
  f.codebook = codebook;
  f.signed_scales = signed_scales;
  f.nibble_scale_min = nibble_scale_min;
  f.kblock = 256;
  // fp16 d (and dmin), a byte per sub-block scale, and for Q4_K/Q5_K a byte per min.
  const bool separate_mins = min && !nibble_scale_min;
  const size_t raw = f.scales_offset() + static_cast<size_t>(f.subs()) * kPackRows * (separate_mins ? 2 : 1);
  f.header_bytes = (raw + 63) / 64 * 64;
  return f;
}

constexpr PackedFormat float_format(TensorType type, Codes codes) {
  PackedFormat f;
  f.type = type;
  f.codes = codes;
  f.acts = ActKind::kFloat;
  f.kblock = static_cast<int>(kSubWeights);
  return f;
}

// The packed layout of a weight type, or nullopt for a type the packed kernels do not run.
constexpr std::optional<PackedFormat> packed_format(TensorType type) {
  if (const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(type))) {
    return block_format(type, Codes::kNib4, f->group, f->asymmetric, f->asymmetric ? 0 : 8, f->scale);
  }
  constexpr ScaleType kF16 = ScaleType::kF16;
  switch (type) {
    case TensorType::F32: return float_format(type, Codes::kFloat);
    case TensorType::F16: return float_format(type, Codes::kHalf);
    case TensorType::BF16: return float_format(type, Codes::kBf16);
    case TensorType::Q4_0: return block_format(type, Codes::kNib4, 32, false, 8, kF16);
    case TensorType::Q4_1: return block_format(type, Codes::kNib4, 32, true, 0, kF16);
    case TensorType::Q5_0: return block_format(type, Codes::kNib4Hb1, 32, false, 16, kF16);
    case TensorType::Q5_1: return block_format(type, Codes::kNib4Hb1, 32, true, 0, kF16);
    case TensorType::Q8_0: return block_format(type, Codes::kBytes, 32, false, 0, kF16);
    case TensorType::IQ4_NL: return block_format(type, Codes::kNib4, 32, false, 0, kF16, CodeBook::kIq4nl);
    // MXFP4's E8M0 scale, halved (e8m0_half_to_fp32), is a power of two from 2^-128 to 2^127:
    // bf16 holds every one exactly, and two blocks' scales fill a header as IQ4_NL's fp16 do.
    case TensorType::MXFP4: return block_format(type, Codes::kNib4, 32, false, 0, ScaleType::kBF16, CodeBook::kMxfp4);
    case TensorType::Q2_K: return super_format(type, Codes::kCrumb2, 16, true, 0, false, CodeBook::kNone, true);
    case TensorType::Q3_K: return super_format(type, Codes::kCrumb2Hb1, 16, false, 4, true);
    case TensorType::Q4_K: return super_format(type, Codes::kNib4, 32, true, 0, false);
    case TensorType::Q5_K: return super_format(type, Codes::kNib4Hb1, 32, true, 0, false);
    case TensorType::Q6_K: return super_format(type, Codes::kNib4Hb2, 16, false, 32, true);
    case TensorType::IQ4_XS: return super_format(type, Codes::kNib4, 32, false, 0, true, CodeBook::kIq4nl);
    default: return std::nullopt;
  }
}

// --- Reading the packed layout one value at a time ------------------------------------------
// The kernels read whole chunks and headers; these say what they mean, for the scalar fallback
// and dequantize_packed.

// fp16 bits to float, exactly as fp16_to_fp32 (quant/formats.h) but inline and without branches
// a compiler cannot turn into selects: the tile products read 16 rows' scales at a time with it.
inline float fp16_bits_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);  // exact; 0 for 0
  const uint32_t special = 0x7F800000u | (mantissa << 13);                                     // inf, NaN
  const uint32_t normal = ((exponent + 112) << 23) | (mantissa << 13);
  return std::bit_cast<float>(sign | (exponent == 0 ? subnormal : exponent == 31 ? special : normal));
}

// The same for the 16 fp16 values at p (a header's scales of the 16 rows) into out, in the
// compilers' vector extension (GCC, Clang): a few vector operations on whatever instruction set
// the including file is compiled for. No function takes or returns a vector, so no calling
// convention depends on that instruction set.
inline void fp16x16_to_fp32(const uint8_t* p, float* out) {
  using Halves = uint16_t __attribute__((vector_size(32)));
  using Words = uint32_t __attribute__((vector_size(64)));
  using Floats = float __attribute__((vector_size(64)));
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words v = __builtin_convertvector(h, Words);
  const Words sign = (v & 0x8000u) << 16, exponent = (v >> 10) & 0x1Fu, mantissa = v & 0x3FFu;
  const Floats scaled = __builtin_convertvector(mantissa, Floats) * 0x1p-24f;  // exact
  const Words subnormal = __builtin_bit_cast(Words, scaled);
  const Words special = 0x7F800000u | (mantissa << 13), normal = ((exponent + 112) << 23) | (mantissa << 13);
  const Words zero_exponent = __builtin_bit_cast(Words, exponent == 0u), max_exponent = __builtin_bit_cast(Words, exponent == 31u);  // all ones where true
  const Words bits = sign | (subnormal & zero_exponent) | (special & max_exponent) | (normal & ~(zero_exponent | max_exponent));
  std::memcpy(out, &bits, sizeof bits);
}

// A float scale or min of a header, stored as the format stores them (fp16, bf16 or fp32).
inline float scale_at(const uint8_t* p, ScaleType s) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, s == ScaleType::kF32 ? 4 : 2);
  switch (s) {
    case ScaleType::kF32: return std::bit_cast<float>(bits);
    case ScaleType::kBF16: return bf16_to_fp32(static_cast<bf16_bits>(bits));
    case ScaleType::kF16: return fp16_bits_to_fp32(static_cast<uint16_t>(bits));
  }
  return 0.0f;
}

// A super format's integer scale and min of sub-block j (of a K-block's header) for row r.
struct SubScale {
  int scale = 0, min = 0;
};
inline SubScale sub_scale_at(const PackedFormat& f, const uint8_t* header, int j, int r) {
  const uint8_t byte = header[f.scales_offset() + static_cast<size_t>(j * kPackRows + r)];
  if (f.nibble_scale_min) return {byte & 0x0F, byte >> 4};
  const int scale = f.signed_scales ? static_cast<int8_t>(byte) : byte;
  return {scale, f.min ? header[f.mins_offset() + static_cast<size_t>(j * kPackRows + r)] : 0};
}

// --- Reading single codes of a sub-block (16 rows x 32 weights at `sub`) ----------
// (packing.cpp's put_sub writes the chunks a row's byte at a time.)

// Byte of row r that holds weight i's quad position j = i % 4, in chunk `chunk`.
inline size_t chunk_byte(size_t chunk, int r, int i) { return chunk * kChunkBytes + static_cast<size_t>(4 * r + i % 4); }

// The code of weight i (0..31) of row r: unsigned 0..63 (Q8_0: the signed byte's bits).
inline int code_at(Codes codes, const uint8_t* sub, int r, int i) {
  const int q = i / 4;  // quad
  switch (codes) {
    case Codes::kNib4:
    case Codes::kNib4Hb1:
    case Codes::kNib4Hb2: {
      int c = (sub[chunk_byte(static_cast<size_t>(q / 2), r, i)] >> (4 * (q % 2))) & 0x0F;
      if (codes == Codes::kNib4Hb1) c |= ((sub[chunk_byte(4, r, i)] >> q) & 1) << 4;
      if (codes == Codes::kNib4Hb2) c |= ((sub[chunk_byte(static_cast<size_t>(4 + q / 4), r, i)] >> (2 * (q % 4))) & 3) << 4;
      return c;
    }
    case Codes::kCrumb2:
    case Codes::kCrumb2Hb1: {
      int c = (sub[chunk_byte(static_cast<size_t>(q / 4), r, i)] >> (2 * (q % 4))) & 3;
      if (codes == Codes::kCrumb2Hb1) c |= ((sub[chunk_byte(2, r, i)] >> q) & 1) << 2;
      return c;
    }
    case Codes::kBytes: return sub[chunk_byte(static_cast<size_t>(q), r, i)];
    default: return 0;  // float formats have no codes
  }
}


}  // namespace ringlm::cpu
