#include "quant/kivi.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/formats.h"

namespace ringlm {
namespace {

// The grid's step's inverse (0 for an empty grid: every code 0).
float inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// The code of x on the grid min + code * scale (scale and min as stored, fp16-rounded; inv its
// inverse): the nearest point, ties rounded up.
int code_of(float x, float min, float inv) {
  return static_cast<int>(std::clamp((x - min) * inv, 0.0f, 3.0f) + 0.5f);
}

// An asymmetric 2-bit grid over [lo, hi]: the fp16 scale and min a block stores.
void grid_of(float lo, float hi, uint16_t& scale, uint16_t& min) {
  scale = fp32_to_fp16((hi - lo) / 3.0f);
  min = fp32_to_fp16(lo);
}

void put_code(uint8_t* codes, int64_t e, int code) {
  uint8_t& byte = codes[e / 4];
  const int shift = static_cast<int>(e % 4) * 2;
  byte = static_cast<uint8_t>((byte & ~(3 << shift)) | (code << shift));
}

}  // namespace

void kivi_quantize_keys(const float* rows, int64_t ld, const bool* live, int count, int64_t n, uint8_t* codes,
                        int64_t code_ld, uint16_t* scales, uint16_t* mins) {
  float x[kKiviGroup];
  for (int64_t c = 0; c < n; ++c) {
    int m = 0;
    for (int i = 0; i < count; ++i) {
      if (live[i]) x[m++] = rows[i * ld + c];
    }
    float lo = 0.0f, hi = 0.0f;  // (no live row: an empty grid)
    if (m > 0) {
      const auto [min_at, max_at] = std::minmax_element(x, x + m);
      lo = *min_at, hi = *max_at;
    }
    // The grid that serves the channel's values best: its ends may cut into the range (a few
    // values clamped, the rest on a finer grid), by the squared error of what it gives back.
    const float range = hi - lo;
    uint16_t best_scale = 0, best_min = 0;
    float best_error = INFINITY;
    for (const float cut_low : kKiviKeyCuts) {
      for (const float cut_high : kKiviKeyCuts) {
        if (cut_low + cut_high > kKiviKeyMostCut) continue;
        uint16_t scale16, min16;
        grid_of(lo + cut_low * range, hi - cut_high * range, scale16, min16);
        const float scale = fp16_to_fp32(scale16), min = fp16_to_fp32(min16), inv = inverse(scale);
        float error = 0;
        for (int i = 0; i < m; ++i) {
          const float back = min + static_cast<float>(code_of(x[i], min, inv)) * scale;
          error += (back - x[i]) * (back - x[i]);
        }
        if (error < best_error) best_error = error, best_scale = scale16, best_min = min16;
      }
    }
    scales[c] = best_scale;
    mins[c] = best_min;
    const float min = fp16_to_fp32(best_min), inv = inverse(fp16_to_fp32(best_scale));
    for (int i = 0; i < count; ++i) put_code(codes + i * code_ld, c, live[i] ? code_of(rows[i * ld + c], min, inv) : 0);
  }
}

void kivi_dequantize_keys(const uint8_t* codes, int64_t code_ld, int count, const uint16_t* scales, const uint16_t* mins,
                          int64_t first, int64_t n, float* out, int64_t out_ld) {
  // The channels' grids once for all the rows.
  float scale[256], min[256];
  for (int64_t c0 = 0; c0 < n; c0 += 256) {
    const int64_t m = std::min<int64_t>(256, n - c0);
    for (int64_t c = 0; c < m; ++c) {
      scale[c] = fp16_to_fp32(scales[first + c0 + c]);
      min[c] = fp16_to_fp32(mins[first + c0 + c]);
    }
    for (int i = 0; i < count; ++i) {
      const uint8_t* row = codes + i * code_ld + (first + c0) / 4;
      float* o = out + i * out_ld + c0;
      for (int64_t c = 0; c < m; ++c) {
        const int code = row[c / 4] >> (c % 4 * 2) & 3;
        o[c] = min[c] + static_cast<float>(code) * scale[c];
      }
    }
  }
}

void kivi_quantize_value(const float* in, int64_t n, uint8_t* row) {
  constexpr size_t kBlockBytes = 4 + kKiviValueBlock / 4;
  for (int64_t b = 0; b < n / kKiviValueBlock; ++b) {
    const float* x = in + b * kKiviValueBlock;
    uint8_t* block = row + b * kBlockBytes;
    const auto [lo, hi] = std::minmax_element(x, x + kKiviValueBlock);
    uint16_t scale16, min16;
    grid_of(*lo, *hi, scale16, min16);
    std::memcpy(block, &scale16, 2);
    std::memcpy(block + 2, &min16, 2);
    const float min = fp16_to_fp32(min16), inv = inverse(fp16_to_fp32(scale16));
    for (int e = 0; e < kKiviValueBlock; ++e) put_code(block + 4, e, code_of(x[e], min, inv));
  }
}

void kivi_dequantize_value(const uint8_t* row, int64_t first, int64_t n, float* out) {
  constexpr size_t kBlockBytes = 4 + kKiviValueBlock / 4;
  for (int64_t b = first / kKiviValueBlock; b * kKiviValueBlock < first + n; ++b) {
    const uint8_t* block = row + b * kBlockBytes;
    uint16_t scale16, min16;
    std::memcpy(&scale16, block, 2);
    std::memcpy(&min16, block + 2, 2);
    const float scale = fp16_to_fp32(scale16), min = fp16_to_fp32(min16);
    const int64_t from = std::max(first, b * kKiviValueBlock), to = std::min(first + n, (b + 1) * kKiviValueBlock);
    for (int64_t e = from; e < to; ++e) {
      const int i = static_cast<int>(e - b * kKiviValueBlock);
      out[e - first] = min + static_cast<float>(block[4 + i / 4] >> (i % 4 * 2) & 3) * scale;
    }
  }
}

}  // namespace ringlm
