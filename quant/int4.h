// ringlm's own INT4 weight-only formats: group-wise 4-bit weights with a scale per group of
// G = 32 or 128 input features, symmetric (i4s) or asymmetric (i4a), the scale (and min) stored
// as fp16, bf16 or fp32.
//
//   i4s-gG[-S]:  w = d * (q - 8)   q in [0, 15]
//   i4a-gG[-S]:  w = d * q + m     q in [0, 15]   (a min rather than a zero point: the kernel's
//                                                  m * sum(x) term costs one multiply-add per group)
//
// Names without a scale suffix mean fp16 scales (i4s-g128 == i4s-g128-f16).
//
// The stored layout is the layout the kernels read, so a quantized file loads by mmap with no
// repacking: a row of K weights is K/G consecutive blocks; within a block, the nibbles come in
// sub-blocks of 32 weights exactly as in GGML's Q4_0 (byte j of sub-block s holds weight 32s+j
// in its low nibble and weight 32s+j+16 in its high nibble). Hence i4s-g32 has Q4_0's layout and
// i4a-g32 has Q4_1's, and one integer kernel serves all of them.
//
// These type ids are ringlm's (GGML does not define them); they sit far above GGML's ids so that
// a future GGML type can never collide with them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include "quant/formats.h"

namespace ringlm {

enum class ScaleType : uint8_t { kF16 = 0, kBF16 = 1, kF32 = 2 };

struct Int4Format {
  int group = 128;          // weights per scale: 32 or 128
  bool asymmetric = false;  // i4a (scale + min) or i4s (scale only)
  ScaleType scale = ScaleType::kF16;
};

inline constexpr uint32_t kInt4TypeBase = 1024;
inline constexpr int kInt4SubBlock = 32;  // nibble sub-block, the same as Q4_0's block

// Type id of a format: base + 6 * (group == 128) + 3 * asymmetric + scale.
constexpr uint32_t int4_type_id(Int4Format f) {
  return kInt4TypeBase + (f.group == 128 ? 6u : 0u) + (f.asymmetric ? 3u : 0u) + static_cast<uint32_t>(f.scale);
}

// The format of a ringlm INT4 type id; nullopt for any other id.
constexpr std::optional<Int4Format> int4_format(uint32_t type_id) {
  if (type_id < kInt4TypeBase || type_id >= kInt4TypeBase + 12) return std::nullopt;
  const uint32_t i = type_id - kInt4TypeBase;
  return Int4Format{i >= 6 ? 128 : 32, (i % 6) >= 3, static_cast<ScaleType>(i % 3)};
}
constexpr bool is_int4_type(TensorType t) { return int4_format(static_cast<uint32_t>(t)).has_value(); }

// Storage of one scale value.
template <ScaleType S>
using ScaleBits = std::conditional_t<S == ScaleType::kF32, float, uint16_t>;

// One group of G weights. Asymmetric blocks carry the min right after the scale.
template <int G, bool Asym, ScaleType S>
struct BlockI4;
template <int G, ScaleType S>
struct BlockI4<G, false, S> {
  ScaleBits<S> d;
  uint8_t qs[G / 2];
};
template <int G, ScaleType S>
struct BlockI4<G, true, S> {
  ScaleBits<S> d;
  ScaleBits<S> m;
  uint8_t qs[G / 2];
};

static_assert(sizeof(BlockI4<32, false, ScaleType::kF16>) == sizeof(BlockQ4_0));
static_assert(sizeof(BlockI4<32, true, ScaleType::kF16>) == sizeof(BlockQ4_1));
static_assert(sizeof(BlockI4<128, false, ScaleType::kF16>) == 66);
static_assert(sizeof(BlockI4<128, true, ScaleType::kF32>) == 72);

// Bytes of one block of the format.
constexpr size_t int4_block_bytes(Int4Format f) {
  const size_t scale = f.scale == ScaleType::kF32 ? 4 : 2;
  return scale * (f.asymmetric ? 2 : 1) + static_cast<size_t>(f.group / 2);
}

// A scale value in fp32.
inline float scale_to_fp32(uint16_t bits, ScaleType s) { return s == ScaleType::kBF16 ? bf16_to_fp32(bits) : fp16_to_fp32(bits); }
inline float scale_to_fp32(float value, ScaleType) { return value; }

// Names of the twelve types, indexed by type id - kInt4TypeBase.
inline constexpr std::string_view kInt4TypeNames[12] = {
    "i4s-g32",  "i4s-g32-bf16",  "i4s-g32-f32",  "i4a-g32",  "i4a-g32-bf16",  "i4a-g32-f32",
    "i4s-g128", "i4s-g128-bf16", "i4s-g128-f32", "i4a-g128", "i4a-g128-bf16", "i4a-g128-f32",
};
constexpr std::string_view int4_type_name(Int4Format f) { return kInt4TypeNames[int4_type_id(f) - kInt4TypeBase]; }

// Bytes of one stored scale (or min).
constexpr size_t int4_scale_bytes(ScaleType s) { return s == ScaleType::kF32 ? 4 : 2; }

}  // namespace ringlm
