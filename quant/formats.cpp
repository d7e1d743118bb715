#include "quant/formats.h"

#include <algorithm>

#include <bit>
#include <cmath>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "quant/int4.h"

namespace ringlm {

std::optional<TypeTraits> type_traits(uint32_t type_id) {
  if (const std::optional<Int4Format> f = int4_format(type_id)) {
    return TypeTraits{int4_type_name(*f), f->group, int4_block_bytes(*f), true};
  }
  switch (static_cast<TensorType>(type_id)) {
    case TensorType::F32: return TypeTraits{"F32", 1, 4, true};
    case TensorType::F16: return TypeTraits{"F16", 1, 2, true};
    case TensorType::BF16: return TypeTraits{"BF16", 1, 2, true};
    case TensorType::Q4_0: return TypeTraits{"Q4_0", kQK4_0, sizeof(BlockQ4_0), true};
    case TensorType::Q4_1: return TypeTraits{"Q4_1", kQK4_1, sizeof(BlockQ4_1), true};
    case TensorType::Q5_0: return TypeTraits{"Q5_0", kQK5_0, sizeof(BlockQ5_0), true};
    case TensorType::Q5_1: return TypeTraits{"Q5_1", kQK5_1, sizeof(BlockQ5_1), true};
    case TensorType::Q8_0: return TypeTraits{"Q8_0", kQK8_0, sizeof(BlockQ8_0), true};
    // Two fp16 + 32 int8 as ggml's block_q8_1 (gguf-py 0.19.0's table still says 40 bytes).
    case TensorType::Q8_1: return TypeTraits{"Q8_1", 32, 36, false};
    case TensorType::Q2_K: return TypeTraits{"Q2_K", kQK_K, sizeof(BlockQ2_K), true};
    case TensorType::Q3_K: return TypeTraits{"Q3_K", kQK_K, sizeof(BlockQ3_K), true};
    case TensorType::Q4_K: return TypeTraits{"Q4_K", kQK_K, sizeof(BlockQ4_K), true};
    case TensorType::Q5_K: return TypeTraits{"Q5_K", kQK_K, sizeof(BlockQ5_K), true};
    case TensorType::Q6_K: return TypeTraits{"Q6_K", kQK_K, sizeof(BlockQ6_K), true};
    case TensorType::IQ4_NL: return TypeTraits{"IQ4_NL", kQK4_NL, sizeof(BlockIQ4_NL), true};
    case TensorType::IQ4_XS: return TypeTraits{"IQ4_XS", kQK_K, sizeof(BlockIQ4_XS), true};
    case TensorType::MXFP4: return TypeTraits{"MXFP4", kQKMxfp4, sizeof(BlockMXFP4), true};
  }
  // GGML ids that exist but ringlm does not read: the grid-based IQ types (IQ2_*, IQ3_*, IQ1_*),
  // the ternary TQ types, NVFP4, Q8_K (a dot-product intermediate, never in model files)
  // and the plain integer/F64 types. Their sizes are still known so a file using them fails with
  // the type named, not a size error. Ids and sizes: gguf-py's GGML_QUANT_SIZES (ggml.h for Q2_0,
  // which is newer than gguf 0.19.0); 4, 5, 31..33 and 36..38 were removed from GGML.
  struct Other { uint32_t id; std::string_view name; int64_t elems; size_t bytes; };
  static constexpr Other kOthers[] = {
      {15, "Q8_K", 256, 292},    {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74}, {18, "IQ3_XXS", 256, 98},
      {19, "IQ1_S", 256, 50},    {21, "IQ3_S", 256, 110},  {22, "IQ2_S", 256, 82},  {24, "I8", 1, 1},
      {25, "I16", 1, 2},         {26, "I32", 1, 4},        {27, "I64", 1, 8},       {28, "F64", 1, 8},
      {29, "IQ1_M", 256, 56},    {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},  {40, "NVFP4", 64, 36},
      {41, "Q1_0", 128, 18},     {42, "Q2_0", 64, 18},
  };
  for (const Other& o : kOthers) {
    if (o.id == type_id) return TypeTraits{o.name, o.elems, o.bytes, false};
  }
  return std::nullopt;
}

size_t row_bytes(TensorType type, int64_t n) {
  const TypeTraits t = *type_traits(static_cast<uint32_t>(type));
  return static_cast<size_t>(n / t.block_elems) * t.block_bytes;
}

float fp16_to_fp32(f16_bits h) {
  // Exact conversion through the hardware-independent bit layout; F16C is used by the kernels.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      const float v = std::ldexp(static_cast<float>(mant), -24);
      bits = std::bit_cast<uint32_t>(v) | sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

f16_bits fp32_to_fp16(float f) {
  // Round to nearest even, with overflow to inf and gradual underflow.
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return static_cast<f16_bits>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0));
  if (abs >= 0x477FF000u) return static_cast<f16_bits>(sign | 0x7C00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float v = std::bit_cast<float>(abs);
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(v * 16777216.0f));  // units of 2^-24
    return static_cast<f16_bits>(sign | m);
  }
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
  return static_cast<f16_bits>(sign | ((rounded - 0x38000000u) >> 13));
}

float bf16_to_fp32(bf16_bits h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

bf16_bits fp32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<bf16_bits>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<bf16_bits>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

namespace {

void dequantize_q4_0(const BlockQ4_0* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK4_0) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      dst[j] = d * ((blocks[b].qs[j] & 0x0F) - 8);
      dst[j + kQK4_0 / 2] = d * ((blocks[b].qs[j] >> 4) - 8);
    }
  }
}

void dequantize_q4_1(const BlockQ4_1* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK4_1) {
    const float d = fp16_to_fp32(blocks[b].d);
    const float m = fp16_to_fp32(blocks[b].m);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      dst[j] = d * (blocks[b].qs[j] & 0x0F) + m;
      dst[j + kQK4_1 / 2] = d * (blocks[b].qs[j] >> 4) + m;
    }
  }
}

// The fifth bit of every element of a Q5_0 / Q5_1 block: element j's is bit j.
uint32_t load_le32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

void dequantize_q5_0(const BlockQ5_0* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK5_0) {
    const float d = fp16_to_fp32(blocks[b].d);
    const uint32_t qh = load_le32(blocks[b].qh);
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      const int lo = (blocks[b].qs[j] & 0x0F) | ((qh >> j) & 1) << 4;
      const int hi = (blocks[b].qs[j] >> 4) | ((qh >> (j + kQK5_0 / 2)) & 1) << 4;
      dst[j] = d * (lo - 16);
      dst[j + kQK5_0 / 2] = d * (hi - 16);
    }
  }
}

void dequantize_q5_1(const BlockQ5_1* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK5_1) {
    const float d = fp16_to_fp32(blocks[b].d);
    const float m = fp16_to_fp32(blocks[b].m);
    const uint32_t qh = load_le32(blocks[b].qh);
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const int lo = (blocks[b].qs[j] & 0x0F) | ((qh >> j) & 1) << 4;
      const int hi = (blocks[b].qs[j] >> 4) | ((qh >> (j + kQK5_1 / 2)) & 1) << 4;
      dst[j] = d * lo + m;
      dst[j + kQK5_1 / 2] = d * hi + m;
    }
  }
}

void dequantize_q8_0(const BlockQ8_0* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK8_0) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int j = 0; j < kQK8_0; ++j) dst[j] = d * blocks[b].qs[j];
  }
}

// The 2-bit code of element e of a Q2_K / Q3_K block: e = 128 h + 32 k + l is bits 2k..2k+1 of
// qs[32 h + l], so each byte of a 32-byte run serves four runs of 32 elements.
int q2_code(const uint8_t* qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3; }

void dequantize_q2_k(const BlockQ2_K* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const BlockQ2_K& x = blocks[b];
    const float d = fp16_to_fp32(x.d);
    const float dmin = fp16_to_fp32(x.dmin);
    // Sub-block j of 16: scale in the low nibble of scales[j], min in the high nibble.
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float dl = d * (x.scales[j] & 0x0F), ml = dmin * (x.scales[j] >> 4);
      for (int e = 16 * j; e < 16 * j + 16; ++e) dst[e] = dl * q2_code(x.qs, e) - ml;
    }
  }
}

// Q3_K's sixteen 6-bit scales (stored + 32): the low 4 bits of scale j are nibble j / 8 of byte
// j % 8, its high 2 bits are bits 2 (j / 4)..2 (j / 4) + 1 of byte 8 + j % 4.
int q3_k_scale(const uint8_t* s, int j) {
  const int lo = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
  const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (lo | hi << 4) - 32;
}

void dequantize_q3_k(const BlockQ3_K* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK_K) {
    const BlockQ3_K& x = blocks[b];
    const float d = fp16_to_fp32(x.d);
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float dl = d * q3_k_scale(x.scales, j);
      for (int e = 16 * j; e < 16 * j + 16; ++e) {
        // The high bit of element e = 32 i + l is bit i of hmask[l]; a CLEAR bit subtracts 4
        // (q in -4..3), so an all-ones hmask is the unsigned 0..3 case.
        const bool high = (x.hmask[e % 32] >> (e / 32)) & 1;
        dst[e] = dl * (q2_code(x.qs, e) - (high ? 0 : 4));
      }
    }
  }
}

// Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes.
void unpack_q4_k_scale_min(int j, const uint8_t* q, uint8_t* scale, uint8_t* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void dequantize_q4_k(const BlockQ4_K* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    const float dmin = fp16_to_fp32(blocks[b].dmin);
    const uint8_t* q = blocks[b].qs;
    // Each 32-byte chunk of qs holds two sub-blocks: low nibbles then high nibbles.
    for (int chunk = 0; chunk < kQK_K / 64; ++chunk, q += 32) {
      uint8_t sc, mn;
      unpack_q4_k_scale_min(2 * chunk, blocks[b].scales, &sc, &mn);
      const float d_lo = d * sc, m_lo = dmin * mn;
      unpack_q4_k_scale_min(2 * chunk + 1, blocks[b].scales, &sc, &mn);
      const float d_hi = d * sc, m_hi = dmin * mn;
      for (int l = 0; l < 32; ++l) *dst++ = d_lo * (q[l] & 0x0F) - m_lo;
      for (int l = 0; l < 32; ++l) *dst++ = d_hi * (q[l] >> 4) - m_hi;
    }
  }
}

void dequantize_q5_k(const BlockQ5_K* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    const float dmin = fp16_to_fp32(blocks[b].dmin);
    const uint8_t* q = blocks[b].qs;
    const uint8_t* qh = blocks[b].qh;
    // As Q4_K; sub-block s (elements 32 s + l) takes its fifth bit from bit s of qh[l].
    for (int chunk = 0; chunk < kQK_K / 64; ++chunk, q += 32) {
      const int s_lo = 2 * chunk, s_hi = 2 * chunk + 1;
      uint8_t sc, mn;
      unpack_q4_k_scale_min(s_lo, blocks[b].scales, &sc, &mn);
      const float d_lo = d * sc, m_lo = dmin * mn;
      unpack_q4_k_scale_min(s_hi, blocks[b].scales, &sc, &mn);
      const float d_hi = d * sc, m_hi = dmin * mn;
      for (int l = 0; l < 32; ++l) *dst++ = d_lo * ((q[l] & 0x0F) | ((qh[l] >> s_lo) & 1) << 4) - m_lo;
      for (int l = 0; l < 32; ++l) *dst++ = d_hi * ((q[l] >> 4) | ((qh[l] >> s_hi) & 1) << 4) - m_hi;
    }
  }
}

void dequantize_q6_k(const BlockQ6_K* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    const uint8_t* ql = blocks[b].ql;
    const uint8_t* qh = blocks[b].qh;
    const int8_t* sc = blocks[b].scales;
    // Two halves of 128 weights; within each, four interleaved runs of 32.
    for (int half = 0; half < 2; ++half, dst += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int8_t>((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dst[l] = d * sc[is] * q1;
        dst[l + 32] = d * sc[is + 2] * q2;
        dst[l + 64] = d * sc[is + 4] * q3;
        dst[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

void dequantize_iq4_nl(const BlockIQ4_NL* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK4_NL) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int j = 0; j < kQK4_NL / 2; ++j) {
      dst[j] = d * kIq4nlValues[blocks[b].qs[j] & 0x0F];
      dst[j + kQK4_NL / 2] = d * kIq4nlValues[blocks[b].qs[j] >> 4];
    }
  }
}

void dequantize_mxfp4(const BlockMXFP4* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQKMxfp4) {
    const float d = e8m0_half_to_fp32(blocks[b].e);
    for (int j = 0; j < kQKMxfp4 / 2; ++j) {
      dst[j] = d * kMxfp4Values[blocks[b].qs[j] & 0x0F];
      dst[j + kQKMxfp4 / 2] = d * kMxfp4Values[blocks[b].qs[j] >> 4];
    }
  }
}

void dequantize_iq4_xs(const BlockIQ4_XS* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const BlockIQ4_XS& x = blocks[b];
    const float d = fp16_to_fp32(x.d);
    // Eight sub-blocks of 32, each an IQ4_NL block whose scale is d * (6-bit s - 32).
    for (int j = 0; j < kQK_K / 32; ++j, dst += 32) {
      const int s = ((x.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | ((x.scales_h >> (2 * j)) & 3) << 4;
      const float dl = d * (s - 32);
      const uint8_t* qs = x.qs + 16 * j;
      for (int l = 0; l < 16; ++l) {
        dst[l] = dl * kIq4nlValues[qs[l] & 0x0F];
        dst[l + 16] = dl * kIq4nlValues[qs[l] >> 4];
      }
    }
  }
}

// ringlm's INT4 blocks: a block of G weights is G/32 sub-blocks laid out as Q4_0's nibbles.
template <int G, bool Asym, ScaleType S>
void dequantize_int4(const BlockI4<G, Asym, S>* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float d = scale_to_fp32(blocks[b].d, S);
    float m = 0;
    if constexpr (Asym) m = scale_to_fp32(blocks[b].m, S);
    for (int s = 0; s < G / kInt4SubBlock; ++s, dst += kInt4SubBlock) {
      const uint8_t* qs = blocks[b].qs + s * kInt4SubBlock / 2;
      for (int j = 0; j < kInt4SubBlock / 2; ++j) {
        const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        if constexpr (Asym) {
          dst[j] = d * lo + m;
          dst[j + kInt4SubBlock / 2] = d * hi + m;
        } else {
          dst[j] = d * (lo - 8);
          dst[j + kInt4SubBlock / 2] = d * (hi - 8);
        }
      }
    }
  }
}

template <int G, bool Asym>
void dequantize_int4_scaled(ScaleType s, const void* src, float* dst, int64_t n_blocks) {
  switch (s) {
    case ScaleType::kF16: return dequantize_int4(static_cast<const BlockI4<G, Asym, ScaleType::kF16>*>(src), dst, n_blocks);
    case ScaleType::kBF16: return dequantize_int4(static_cast<const BlockI4<G, Asym, ScaleType::kBF16>*>(src), dst, n_blocks);
    case ScaleType::kF32: return dequantize_int4(static_cast<const BlockI4<G, Asym, ScaleType::kF32>*>(src), dst, n_blocks);
  }
}

void dequantize_int4_row(Int4Format f, const void* src, float* dst, int64_t n) {
  const int64_t n_blocks = n / f.group;
  if (f.group == 128) {
    return f.asymmetric ? dequantize_int4_scaled<128, true>(f.scale, src, dst, n_blocks)
                        : dequantize_int4_scaled<128, false>(f.scale, src, dst, n_blocks);
  }
  return f.asymmetric ? dequantize_int4_scaled<32, true>(f.scale, src, dst, n_blocks)
                      : dequantize_int4_scaled<32, false>(f.scale, src, dst, n_blocks);
}

}  // namespace

void dequantize_row(TensorType type, const void* src, float* dst, int64_t n) {
  if (const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(type))) return dequantize_int4_row(*f, src, dst, n);
  switch (type) {
    case TensorType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case TensorType::F16: {
      const auto* h = static_cast<const f16_bits*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
      return;
    }
    case TensorType::BF16: {
      const auto* h = static_cast<const bf16_bits*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return;
    }
    case TensorType::Q4_0: return dequantize_q4_0(static_cast<const BlockQ4_0*>(src), dst, n / kQK4_0);
    case TensorType::Q4_1: return dequantize_q4_1(static_cast<const BlockQ4_1*>(src), dst, n / kQK4_1);
    case TensorType::Q5_0: return dequantize_q5_0(static_cast<const BlockQ5_0*>(src), dst, n / kQK5_0);
    case TensorType::Q5_1: return dequantize_q5_1(static_cast<const BlockQ5_1*>(src), dst, n / kQK5_1);
    case TensorType::Q8_0: return dequantize_q8_0(static_cast<const BlockQ8_0*>(src), dst, n / kQK8_0);
    case TensorType::Q2_K: return dequantize_q2_k(static_cast<const BlockQ2_K*>(src), dst, n / kQK_K);
    case TensorType::Q3_K: return dequantize_q3_k(static_cast<const BlockQ3_K*>(src), dst, n / kQK_K);
    case TensorType::Q4_K: return dequantize_q4_k(static_cast<const BlockQ4_K*>(src), dst, n / kQK_K);
    case TensorType::Q5_K: return dequantize_q5_k(static_cast<const BlockQ5_K*>(src), dst, n / kQK_K);
    case TensorType::Q6_K: return dequantize_q6_k(static_cast<const BlockQ6_K*>(src), dst, n / kQK_K);
    case TensorType::IQ4_NL: return dequantize_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, n / kQK4_NL);
    case TensorType::IQ4_XS: return dequantize_iq4_xs(static_cast<const BlockIQ4_XS*>(src), dst, n / kQK_K);
    case TensorType::MXFP4: return dequantize_mxfp4(static_cast<const BlockMXFP4*>(src), dst, n / kQKMxfp4);
    case TensorType::Q8_1: break;
  }
  throw std::invalid_argument("dequantize_row: unsupported tensor type");
}

namespace {

// Canonical spellings first: quantize_type_names() lists them in this order.
struct NamedType {
  std::string_view name;
  TensorType type;
};
std::vector<NamedType> quantize_types() {
  std::vector<NamedType> types = {{"F32", TensorType::F32}, {"F16", TensorType::F16}, {"BF16", TensorType::BF16},
                                  {"Q8_0", TensorType::Q8_0}, {"Q4_0", TensorType::Q4_0}, {"Q4_1", TensorType::Q4_1},
                                  {"Q5_0", TensorType::Q5_0}, {"Q5_1", TensorType::Q5_1}, {"Q4_K", TensorType::Q4_K},
                                  {"Q5_K", TensorType::Q5_K}, {"Q6_K", TensorType::Q6_K}};
  for (uint32_t id = kInt4TypeBase; id < kInt4TypeBase + std::size(kInt4TypeNames); ++id) {
    types.push_back({kInt4TypeNames[id - kInt4TypeBase], static_cast<TensorType>(id)});
  }
  return types;
}

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [&](char x, char y) { return lower(x) == lower(y); });
}

}  // namespace

std::optional<TensorType> parse_quantize_type(std::string_view name) {
  // "i4s-g128-f16" is the spelled-out default of "i4s-g128".
  constexpr std::string_view kF16Suffix = "-f16";
  if (name.size() > kF16Suffix.size() && equal_ignoring_case(name.substr(name.size() - kF16Suffix.size()), kF16Suffix) &&
      equal_ignoring_case(name.substr(0, 2), "i4")) {
    name.remove_suffix(kF16Suffix.size());
  }
  for (const NamedType& t : quantize_types()) {
    if (equal_ignoring_case(name, t.name)) return t.type;
  }
  return std::nullopt;
}

const std::vector<std::string_view>& quantize_type_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> v;
    for (const NamedType& t : quantize_types()) v.push_back(t.name);
    return v;
  }();
  return names;
}

}  // namespace ringlm
