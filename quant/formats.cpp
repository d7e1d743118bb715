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
    case TensorType::Q8_0: return TypeTraits{"Q8_0", kQK8_0, sizeof(BlockQ8_0), true};
    case TensorType::Q8_1: return TypeTraits{"Q8_1", 32, 36, false};
    case TensorType::Q4_K: return TypeTraits{"Q4_K", kQK_K, sizeof(BlockQ4_K), true};
    case TensorType::Q6_K: return TypeTraits{"Q6_K", kQK_K, sizeof(BlockQ6_K), true};
  }
  // GGML ids that exist but ringlm does not read (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ*, I8..I64, F64, ...).
  // Their sizes are still known so a file using them fails with the type named, not a size error.
  struct Other { uint32_t id; std::string_view name; int64_t elems; size_t bytes; };
  static constexpr Other kOthers[] = {
      {6, "Q5_0", 32, 22},   {7, "Q5_1", 32, 24},   {10, "Q2_K", 256, 84}, {11, "Q3_K", 256, 110},
      {13, "Q5_K", 256, 176}, {15, "Q8_K", 256, 292}, {24, "I8", 1, 1},      {25, "I16", 1, 2},
      {26, "I32", 1, 4},      {27, "I64", 1, 8},      {28, "F64", 1, 8},
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

void dequantize_q8_0(const BlockQ8_0* blocks, float* dst, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, dst += kQK8_0) {
    const float d = fp16_to_fp32(blocks[b].d);
    for (int j = 0; j < kQK8_0; ++j) dst[j] = d * blocks[b].qs[j];
  }
}

// Q4_K packs eight 6-bit scales and eight 6-bit mins into 12 bytes.
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
    case TensorType::Q8_0: return dequantize_q8_0(static_cast<const BlockQ8_0*>(src), dst, n / kQK8_0);
    case TensorType::Q4_K: return dequantize_q4_k(static_cast<const BlockQ4_K*>(src), dst, n / kQK_K);
    case TensorType::Q6_K: return dequantize_q6_k(static_cast<const BlockQ6_K*>(src), dst, n / kQK_K);
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
                                  {"Q8_0", TensorType::Q8_0}, {"Q4_0", TensorType::Q4_0}, {"Q4_1", TensorType::Q4_1}};
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
