// KIVI's 2-bit KV cache format (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization
// for KV Cache", 2024): keys quantized per channel over a group of tokens, values per token.
//
// Keys have a few channels of much larger magnitude than the rest, the same in every token: a
// scale shared along a token (q4_0's) spends its 2 bits on those and leaves the others at zero,
// while a scale per channel fits each channel's own range. Values have no such channels and are
// quantized along the token. Both are asymmetric: a value is min + code * scale, code in 0..3,
// with min and scale stored in fp16.
//
// Layouts (n: a row's elements, a multiple of kKiviValueBlock):
//  - a key row: n codes of 2 bits, 4 to a byte, element e in bits 2 (e % 4) of byte e / 4;
//  - a key group's parameters: its n channels' scales, then their mins (fp16), [2][n];
//  - a value row: per block of kKiviValueBlock elements, its scale and min (fp16), then the
//    block's codes packed as the keys' are.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ringlm {

inline constexpr int kKiviGroup = 32;        // tokens whose keys share their channels' scales
inline constexpr int kKiviValueBlock = 64;   // elements of a value row that share a scale
inline constexpr int kKiviResidual = 128;    // default: the newest tokens kept in fp16
inline constexpr int kKiviMaxHead = 512;     // the largest head size a KIVI cache takes
// The fractions of a key channel's range its grid may leave out at either end (searched for the
// least squared error; at most kKiviKeyMostCut together).
inline constexpr float kKiviKeyCuts[] = {0.0f, 0.05f, 0.1f, 0.15f, 0.2f, 0.3f};
inline constexpr float kKiviKeyMostCut = 0.5f;

// Why speculative decoding refuses a KIVI cache: a draft's checking pass appends its tokens at
// once, so the groups would be sealed at other steps than plain decoding seals them, and the
// text would not be decoding's.
inline constexpr const char* kKiviRefusesDrafts =
    "speculative decoding (--lookup, -md) does not combine with --cache-type kivi2: a draft's checking pass would "
    "quantize the cache's groups at other steps than decoding does; use q8_0 or q4_0 with drafts";

constexpr size_t kivi_key_row_bytes(int64_t n) { return static_cast<size_t>(n) / 4; }
constexpr size_t kivi_key_params_bytes(int64_t n) { return static_cast<size_t>(n) * 4; }
constexpr size_t kivi_value_row_bytes(int64_t n) {
  return static_cast<size_t>(n) / kKiviValueBlock * (4 + kKiviValueBlock / 4);
}

// Quantizes the keys of one group per channel: rows[i] (n floats, `ld` apart) for i < count,
// only those with live[i] setting a channel's grid (a group with none live gets scale 0 and
// min 0): of the grids over the live values' range with its ends cut by kKiviKeyCuts, the one
// of least squared error. codes[i] (row i's codes, code_ld bytes apart) is written for every
// row, each channel's scale and min to scales[c] and mins[c] (a group's parameters, [2][n]).
void kivi_quantize_keys(const float* rows, int64_t ld, const bool* live, int count, int64_t n, uint8_t* codes,
                        int64_t code_ld, uint16_t* scales, uint16_t* mins);

// Elements [first, first + n) of `count` key rows of one group (codes code_ld bytes apart) as
// floats, out_ld apart: each code against its channel's scale and min (first a multiple of 4).
void kivi_dequantize_keys(const uint8_t* codes, int64_t code_ld, int count, const uint16_t* scales, const uint16_t* mins,
                          int64_t first, int64_t n, float* out, int64_t out_ld);

// One value row of n elements, and back (elements [first, first + n) of it, first a multiple of
// kKiviValueBlock).
void kivi_quantize_value(const float* in, int64_t n, uint8_t* row);
void kivi_dequantize_value(const uint8_t* row, int64_t first, int64_t n, float* out);

}  // namespace ringlm
