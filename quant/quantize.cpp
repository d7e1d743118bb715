#include "quant/quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "quant/int4.h"

namespace ringlm {

namespace {

// --- GGML's reference quantizers --------------------------------------------------------------
// The float operations below are GGML's, in GGML's order: the same inputs give the same bytes.

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK4_0) {
    // The weight of largest magnitude, sign kept, maps to q = 0, i.e. to -8 steps.
    float amax = 0, max = 0;
    for (int j = 0; j < kQK4_0; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    // x/d lies in [-8, 8]: truncating x/d + 8.5 rounds it to nearest; only 16 needs clamping.
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      const int lo = std::min(15, static_cast<int>(x[j] * id + 8.5f));
      const int hi = std::min(15, static_cast<int>(x[j + kQK4_0 / 2] * id + 8.5f));
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK4_1) {
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < kQK4_1; ++j) {
      min = x[j] < min ? x[j] : min;
      max = x[j] > max ? x[j] : max;
    }
    const float d = (max - min) / 15;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    y[b].m = fp32_to_fp16(min);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      const int lo = std::min(15, static_cast<int>((x[j] - min) * id + 0.5f));
      const int hi = std::min(15, static_cast<int>((x[j + kQK4_1 / 2] - min) * id + 0.5f));
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK8_0) {
    float amax = 0;
    for (int j = 0; j < kQK8_0; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    // roundf: halves away from zero, as GGML rounds.
    for (int j = 0; j < kQK8_0; ++j) y[b].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

// --- ringlm's INT4 types ----------------------------------------------------------------------

enum class Rounding { kNearest, kDown, kUp };

// fp16 and bf16 are sign-magnitude, so the neighbouring value is the neighbouring bit pattern:
// one step up shrinks a negative magnitude and grows a positive one.
uint16_t next_half_bits(uint16_t h, bool up) {
  if ((h & 0x7FFFu) == 0) return up ? 0x0001 : 0x8001;  // from +-0 to the smallest subnormal of that sign
  const bool negative = (h & 0x8000u) != 0;
  return static_cast<uint16_t>(negative == up ? h - 1 : h + 1);
}

// A scale or min as stored, rounded as asked: down/up let a grid be widened to cover a range.
template <ScaleType S>
ScaleBits<S> store_scale(float x, Rounding r) {
  if constexpr (S == ScaleType::kF32) {
    return x;
  } else {
    uint16_t h = S == ScaleType::kBF16 ? fp32_to_bf16(x) : fp32_to_fp16(x);
    const float stored = scale_to_fp32(h, S);
    if (r == Rounding::kUp && stored < x) h = next_half_bits(h, true);
    if (r == Rounding::kDown && stored > x) h = next_half_bits(h, false);
    return h;
  }
}

// One group's grid, as stored and as the dequantizer reads it back:
// w = d * (q - 8) (symmetric) or w = d * q + m (asymmetric), q in [0, 15].
template <ScaleType S>
struct Grid {
  ScaleBits<S> d_bits{}, m_bits{};
  float d = 0, m = 0;
};

// What a group's round-to-nearest grid depends on.
struct GroupRange {
  float min, max;
  float extreme;  // the weight of largest magnitude, sign kept
};

GroupRange group_range(const float* w, int n) {
  GroupRange r{w[0], w[0], w[0]};
  for (int j = 1; j < n; ++j) {
    r.min = std::min(r.min, w[j]);
    r.max = std::max(r.max, w[j]);
    if (std::fabs(w[j]) > std::fabs(r.extreme)) r.extreme = w[j];
  }
  return r;
}

// The grid spanning `ratio` of the group's range (1: all of it; below 1, the ends are clipped).
template <bool Asym, ScaleType S>
Grid<S> make_grid(const GroupRange& range, float ratio) {
  Grid<S> g;
  if constexpr (Asym) {
    // Shrink both ends towards the middle. The min is rounded down and the step up, so that the
    // stored grid still covers [lo, hi]: no weight inside it is more than half a step away.
    const float shrink = (1.0f - ratio) * (range.max - range.min) / 2;
    const float lo = range.min + shrink, hi = range.max - shrink;
    g.m_bits = store_scale<S>(lo, Rounding::kDown);
    g.m = scale_to_fp32(g.m_bits, S);
    g.d_bits = store_scale<S>((hi - g.m) / 15, Rounding::kUp);
  } else {
    // As Q4_0: the extreme weight maps to -8 steps, which leaves 7 steps on the other side.
    g.d_bits = store_scale<S>(ratio * range.extreme / -8, Rounding::kNearest);
  }
  g.d = scale_to_fp32(g.d_bits, S);
  return g;
}

// Clamps a rounded grid coordinate into a nibble (NaN goes to 0 rather than to undefined behaviour).
int clamp_nibble(float q) { return q >= 15.0f ? 15 : q > 0.0f ? static_cast<int>(q) : 0; }

// Round half to even without a libm call (nearbyint is one on baseline x86-64, and the search
// calls this 21 times per weight): adding 1.5 * 2^23 pushes a float's fraction bits out of its
// mantissa. Exact for |x| < 2^22; larger values stay beyond the nibble range and clamp the same.
float round_nearest(float x) {
  constexpr float kMagic = 12582912.0f;
  return (x + kMagic) - kMagic;
}

// The nibble of the grid point nearest to w; inv_d is 1/d, or 0 for a grid of one point.
template <bool Asym, ScaleType S>
int nibble(float w, const Grid<S>& g, float inv_d) {
  if constexpr (Asym) return clamp_nibble(round_nearest((w - g.m) * inv_d));
  return clamp_nibble(round_nearest(w * inv_d) + 8.0f);
}

// The value a nibble dequantizes to: the same float expression as dequantize_row()'s.
template <bool Asym, ScaleType S>
float grid_value(const Grid<S>& g, int q) {
  if constexpr (Asym) return g.d * q + g.m;
  return g.d * (q - 8);
}

float inverse(float d) { return d != 0 ? 1.0f / d : 0.0f; }

template <bool Asym, ScaleType S>
double squared_error(const float* w, int n, const Grid<S>& g) {
  const float inv_d = inverse(g.d);
  double sum = 0;
  for (int j = 0; j < n; ++j) {
    const double e = static_cast<double>(w[j]) - grid_value<Asym>(g, nibble<Asym>(w[j], g, inv_d));
    sum += e * e;
  }
  return sum;
}

// Clip ratios 1.00, 0.99, ..., 0.80: the search's candidates, the unclipped grid first.
constexpr int kClipSteps = 20;
constexpr float kClipStep = 0.01f;

template <bool Asym, ScaleType S>
Grid<S> choose_grid(const float* w, int n, bool clip_search) {
  const GroupRange range = group_range(w, n);
  Grid<S> best = make_grid<Asym, S>(range, 1.0f);
  if (!clip_search) return best;
  double best_error = squared_error<Asym>(w, n, best);
  for (int k = 1; k <= kClipSteps && best_error > 0; ++k) {
    const Grid<S> g = make_grid<Asym, S>(range, 1.0f - kClipStep * static_cast<float>(k));
    const double error = squared_error<Asym>(w, n, g);
    if (error < best_error) {  // strict: ties keep the wider grid
      best = g;
      best_error = error;
    }
  }
  return best;
}

template <int G, bool Asym, ScaleType S>
void quantize_int4(const float* x, BlockI4<G, Asym, S>* y, int64_t n_blocks, bool clip_search) {
  for (int64_t b = 0; b < n_blocks; ++b, x += G) {
    const Grid<S> g = choose_grid<Asym, S>(x, G, clip_search);
    y[b].d = g.d_bits;
    if constexpr (Asym) y[b].m = g.m_bits;
    const float inv_d = inverse(g.d);
    // Q4_0's nibble order within each sub-block of 32 (quant/int4.h).
    for (int s = 0; s < G / kInt4SubBlock; ++s) {
      const float* w = x + s * kInt4SubBlock;
      uint8_t* qs = y[b].qs + s * kInt4SubBlock / 2;
      for (int j = 0; j < kInt4SubBlock / 2; ++j) {
        const int lo = nibble<Asym>(w[j], g, inv_d);
        const int hi = nibble<Asym>(w[j + kInt4SubBlock / 2], g, inv_d);
        qs[j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

template <int G, bool Asym>
void quantize_int4_scaled(ScaleType s, const float* x, void* y, int64_t n_blocks, bool clip) {
  switch (s) {
    case ScaleType::kF16: return quantize_int4(x, static_cast<BlockI4<G, Asym, ScaleType::kF16>*>(y), n_blocks, clip);
    case ScaleType::kBF16: return quantize_int4(x, static_cast<BlockI4<G, Asym, ScaleType::kBF16>*>(y), n_blocks, clip);
    case ScaleType::kF32: return quantize_int4(x, static_cast<BlockI4<G, Asym, ScaleType::kF32>*>(y), n_blocks, clip);
  }
}

void quantize_int4_row(Int4Format f, const float* x, void* y, int64_t n, bool clip) {
  const int64_t n_blocks = n / f.group;
  if (f.group == 128) {
    return f.asymmetric ? quantize_int4_scaled<128, true>(f.scale, x, y, n_blocks, clip)
                        : quantize_int4_scaled<128, false>(f.scale, x, y, n_blocks, clip);
  }
  return f.asymmetric ? quantize_int4_scaled<32, true>(f.scale, x, y, n_blocks, clip)
                      : quantize_int4_scaled<32, false>(f.scale, x, y, n_blocks, clip);
}

}  // namespace

bool can_quantize(TensorType type) {
  switch (type) {
    case TensorType::F32: case TensorType::F16: case TensorType::BF16:
    case TensorType::Q8_0: case TensorType::Q4_0: case TensorType::Q4_1:
      return true;
    default:
      return is_int4_type(type);
  }
}

void quantize_row(TensorType type, const float* src, void* dst, int64_t n, const QuantizeOptions& options) {
  const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(type));
  if (!can_quantize(type) || !traits) {
    throw std::invalid_argument("quantize_row: cannot quantize to type " +
                                (traits ? std::string(traits->name) : std::to_string(static_cast<uint32_t>(type))));
  }
  if (n < 0 || n % traits->block_elems != 0) {
    throw std::invalid_argument("quantize_row: row length " + std::to_string(n) + " is not a multiple of the " +
                                std::string(traits->name) + " block size " + std::to_string(traits->block_elems));
  }
  if (const std::optional<Int4Format> f = int4_format(static_cast<uint32_t>(type))) {
    return quantize_int4_row(*f, src, dst, n, options.clip_search);
  }
  switch (type) {
    case TensorType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case TensorType::F16: {
      auto* h = static_cast<f16_bits*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
      return;
    }
    case TensorType::BF16: {
      auto* h = static_cast<bf16_bits*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
      return;
    }
    case TensorType::Q8_0: return quantize_q8_0(src, static_cast<BlockQ8_0*>(dst), n / kQK8_0);
    case TensorType::Q4_0: return quantize_q4_0(src, static_cast<BlockQ4_0*>(dst), n / kQK4_0);
    case TensorType::Q4_1: return quantize_q4_1(src, static_cast<BlockQ4_1*>(dst), n / kQK4_1);
    default: break;
  }
}

}  // namespace ringlm
