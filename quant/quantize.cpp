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

// The weight of largest magnitude among n, its sign kept (the first of equal magnitudes).
float signed_largest(const float* x, int n) {
  float amax = 0, max = 0;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// The smallest and the largest of n weights.
struct ValueRange {
  float min = FLT_MAX, max = -FLT_MAX;
};
ValueRange value_range(const float* x, int n) {
  ValueRange r;
  for (int j = 0; j < n; ++j) {
    r.min = x[j] < r.min ? x[j] : r.min;
    r.max = x[j] > r.max ? x[j] : r.max;
  }
  return r;
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK4_0) {
    // The weight of largest magnitude, sign kept, maps to q = 0, i.e. to -8 steps.
    const float d = signed_largest(x, kQK4_0) / -8;
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
    const auto [min, max] = value_range(x, kQK4_1);
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

// Q5_0 and Q5_1: 32 5-bit codes, the low 4 bits as Q4_0's nibbles (code j and code j + 16 share
// byte j), the fifth bit of code j in bit j of qh (a little-endian 32-bit word).
void pack_q5_codes(const uint8_t* q, uint8_t* qh, uint8_t* qs) {
  uint32_t high = 0;
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
  for (int j = 0; j < 32; ++j) high |= static_cast<uint32_t>(q[j] >> 4) << j;
  for (int k = 0; k < 4; ++k) qh[k] = static_cast<uint8_t>(high >> (8 * k));
}

void quantize_q5_0(const float* x, BlockQ5_0* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK5_0) {
    // As Q4_0 with twice the steps: the weight of largest magnitude maps to q = 0, i.e. to -16 steps.
    const float d = signed_largest(x, kQK5_0) / -16;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    // x/d lies in [-16, 16]: truncating x/d + 16.5 rounds it to nearest; only 32 needs clamping.
    uint8_t q[kQK5_0];
    for (int j = 0; j < kQK5_0; ++j) q[j] = static_cast<uint8_t>(std::min(31, static_cast<int>(x[j] * id + 16.5f)));
    pack_q5_codes(q, y[b].qh, y[b].qs);
  }
}

void quantize_q5_1(const float* x, BlockQ5_1* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK5_1) {
    const auto [min, max] = value_range(x, kQK5_1);
    const float d = (max - min) / 31;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[b].d = fp32_to_fp16(d);
    y[b].m = fp32_to_fp16(min);
    // (x - min)/d lies in [0, 31] up to a few ulps; the clamp never changes a code GGML writes.
    uint8_t q[kQK5_1];
    for (int j = 0; j < kQK5_1; ++j) q[j] = static_cast<uint8_t>(std::min(31, static_cast<int>((x[j] - min) * id + 0.5f)));
    pack_q5_codes(q, y[b].qh, y[b].qs);
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

// --- K-quants: Q4_K, Q5_K, Q6_K ----------------------------------------------------------------
//
// Any bytes of these layouts are a valid block, so ringlm's bytes need not be GGML's; the method is
// the one of GGML's reference quantizers (ggml-quants.c). Each sub-block's grid is searched for the
// smallest squared error weighted towards the larger weights: several step sizes around the one that
// spans the sub-block are tried, each giving codes to which the best scale (and offset) is fitted by
// weighted least squares. The sub-block scales (and offsets) are then stored as codes of the super-
// block's fp16 scale; where rounding a code to nearest is not the best choice, a neighbouring code
// is taken. The weights finally round to nearest on the grid as stored, so every weight lands on the
// nearest value the dequantizer can produce from its block.

// Round to nearest (half to even) into [lo, hi]; NaN gives lo.
int round_clamp(float v, int lo, int hi) {
  const float r = round_nearest(v);
  return r >= static_cast<float>(hi) ? hi : r > static_cast<float>(lo) ? static_cast<int>(r) : lo;
}

// Below this magnitude a sub-block counts as all zeros (as GGML's GROUP_MAX_EPS).
constexpr float kNegligible = 1e-15f;

// --- Q4_K and Q5_K: w = step * q - offset, q in [0, nmax], per sub-block of 32 -------------------

constexpr int kAffineSub = 32;                   // weights per sub-block
constexpr int kAffineSubs = kQK_K / kAffineSub;  // sub-blocks per super-block
constexpr int kCodeMax = 63;                     // 6-bit codes of the sub-block step and offset

// A sub-block's grid: w = step * q - offset, offset >= 0 (the format stores it as an unsigned code).
struct AffineGrid {
  float step = 0, offset = 0;
};

// The code of w on a grid: nearest, clamped to [0, nmax].
int affine_code(float w, const AffineGrid& g, int nmax) {
  return g.step > 0 ? round_clamp((w + g.offset) / g.step, 0, nmax) : 0;
}

// The weighted squared error of x on a grid, every weight on its nearest code; `step * q - offset` is
// the dequantizer's own float expression.
float affine_error(const float* x, const float* importance, int nmax, const AffineGrid& g) {
  float error = 0;
  for (int i = 0; i < kAffineSub; ++i) {
    const float e = g.step * static_cast<float>(affine_code(x[i], g, nmax)) - g.offset - x[i];
    error += importance[i] * e * e;
  }
  return error;
}

// The step sizes a search tries: the one spanning the sub-block times (nmax + first + k * delta) / nmax,
// k = 0..count-1 (GGML's choices: Q4_K -1, 0.1, 21 tries; Q5_K -0.5, 0.1, 16).
struct StepSearch {
  float first, delta;
  int count;
};

// The least-squares grid of one sub-block (in the format's convention, offset >= 0, so the grid's
// lowest value is <= 0 and a sub-block of positive weights has its grid start at 0).
AffineGrid fit_affine(const float* x, const float* importance, int nmax, const StepSearch& search) {
  float lo = std::min(0.0f, x[0]), hi = x[0];
  for (int i = 1; i < kAffineSub; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  if (!(hi > lo)) return {0, -lo};  // constant: every weight on the offset
  // Round to nearest on the grid spanning [lo, hi] is the first candidate.
  AffineGrid best{(hi - lo) / static_cast<float>(nmax), -lo};
  float best_error = affine_error(x, importance, nmax, best);
  for (int k = 0; k < search.count; ++k) {
    const float inv_step = (static_cast<float>(nmax) + search.first + search.delta * static_cast<float>(k)) / (hi - lo);
    // Codes on this trial grid, then the step and offset that fit those codes best.
    float sw = 0, sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int i = 0; i < kAffineSub; ++i) {
      const float q = static_cast<float>(round_clamp(inv_step * (x[i] - lo), 0, nmax));
      const float w = importance[i];
      sw += w;
      sq += w * q;
      sqq += w * q * q;
      sx += w * x[i];
      sqx += w * q * x[i];
    }
    const float det = sw * sqq - sq * sq;
    if (!(det > 0)) continue;
    AffineGrid g{(sw * sqx - sq * sx) / det, -(sqq * sx - sq * sqx) / det};
    if (g.offset < 0) g = {sqx / sqq, 0};  // the format cannot raise the grid above 0: fit the step alone
    if (!(g.step > 0)) continue;
    const float error = affine_error(x, importance, nmax, g);
    if (error < best_error) {
      best = g;
      best_error = error;
    }
  }
  return best;
}

// Q4_K's and Q5_K's 12 bytes of eight 6-bit step codes and eight 6-bit offset codes: codes 0..3 in the
// low 6 bits of bytes 0..3 (steps) and 4..7 (offsets); codes 4..7 as nibbles of bytes 8..11 (step
// low, offset high) with their top 2 bits in the top bits of bytes 0..3 (steps) and 4..7 (offsets).
void pack_k_codes(const uint8_t* step, const uint8_t* offset, uint8_t* bytes) {
  for (int j = 0; j < 4; ++j) {
    bytes[j] = static_cast<uint8_t>(step[j] | ((step[j + 4] >> 4) << 6));
    bytes[j + 4] = static_cast<uint8_t>(offset[j] | ((offset[j + 4] >> 4) << 6));
    bytes[j + 8] = static_cast<uint8_t>((step[j + 4] & 0x0F) | ((offset[j + 4] & 0x0F) << 4));
  }
}

// One super-block of Q4_K / Q5_K (nmax 15 / 31): the fp16 scale of the steps and of the offsets, the
// codes, and each weight's q in element order.
struct AffineSuperBlock {
  f16_bits d = 0, dmin = 0;
  uint8_t step_code[kAffineSubs] = {}, offset_code[kAffineSubs] = {};
  uint8_t q[kQK_K] = {};
};

AffineSuperBlock quantize_affine_super_block(const float* x, int nmax, const StepSearch& search) {
  AffineSuperBlock out;
  float importance[kQK_K];
  AffineGrid fits[kAffineSubs];
  float max_step = 0, max_offset = 0;
  for (int s = 0; s < kAffineSubs; ++s) {
    const float* xs = x + s * kAffineSub;
    // GGML's weighting: the sub-block's RMS plus the weight's own magnitude.
    float sum_sq = 0;
    for (int i = 0; i < kAffineSub; ++i) sum_sq += xs[i] * xs[i];
    const float rms = std::sqrt(sum_sq / kAffineSub);
    for (int i = 0; i < kAffineSub; ++i) importance[s * kAffineSub + i] = rms + std::fabs(xs[i]);
    fits[s] = fit_affine(xs, importance + s * kAffineSub, nmax, search);
    max_step = std::max(max_step, fits[s].step);
    max_offset = std::max(max_offset, fits[s].offset);
  }
  // The largest step and offset take code 63.
  out.d = fp32_to_fp16(max_step / kCodeMax);
  out.dmin = fp32_to_fp16(max_offset / kCodeMax);
  const float d = fp16_to_fp32(out.d), dmin = fp16_to_fp32(out.dmin);
  for (int s = 0; s < kAffineSubs; ++s) {
    const float* xs = x + s * kAffineSub;
    const float* ws = importance + s * kAffineSub;
    const int sc0 = d > 0 ? round_clamp(fits[s].step / d, 0, kCodeMax) : 0;
    const int m0 = dmin > 0 ? round_clamp(fits[s].offset / dmin, 0, kCodeMax) : 0;
    // The nearest codes, or a neighbour of them whose grid fits the sub-block better.
    int best_sc = sc0, best_m = m0;
    float best_error = affine_error(xs, ws, nmax, {d * static_cast<float>(sc0), dmin * static_cast<float>(m0)});
    for (int sc = std::max(0, sc0 - 1); sc <= std::min(kCodeMax, sc0 + 1); ++sc) {
      for (int m = std::max(0, m0 - 1); m <= std::min(kCodeMax, m0 + 1); ++m) {
        const float error = affine_error(xs, ws, nmax, {d * static_cast<float>(sc), dmin * static_cast<float>(m)});
        if (error < best_error) {
          best_sc = sc;
          best_m = m;
          best_error = error;
        }
      }
    }
    out.step_code[s] = static_cast<uint8_t>(best_sc);
    out.offset_code[s] = static_cast<uint8_t>(best_m);
    const AffineGrid stored{d * static_cast<float>(best_sc), dmin * static_cast<float>(best_m)};
    for (int i = 0; i < kAffineSub; ++i) out.q[s * kAffineSub + i] = static_cast<uint8_t>(affine_code(xs[i], stored, nmax));
  }
  return out;
}

void quantize_q4_k(const float* x, BlockQ4_K* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK_K) {
    const AffineSuperBlock sb = quantize_affine_super_block(x, 15, {-1.0f, 0.1f, 21});
    y[b].d = sb.d;
    y[b].dmin = sb.dmin;
    pack_k_codes(sb.step_code, sb.offset_code, y[b].scales);
    // Each 32 bytes hold two sub-blocks: the first in the low nibbles, the second in the high.
    for (int c = 0; c < kQK_K / 64; ++c) {
      for (int l = 0; l < 32; ++l) y[b].qs[32 * c + l] = static_cast<uint8_t>(sb.q[64 * c + l] | (sb.q[64 * c + 32 + l] << 4));
    }
  }
}

void quantize_q5_k(const float* x, BlockQ5_K* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK_K) {
    const AffineSuperBlock sb = quantize_affine_super_block(x, 31, {-0.5f, 0.1f, 16});
    y[b].d = sb.d;
    y[b].dmin = sb.dmin;
    pack_k_codes(sb.step_code, sb.offset_code, y[b].scales);
    // The low 4 bits as Q4_K's nibbles; the fifth bit of element 32 s + l in bit s of qh[l].
    std::memset(y[b].qh, 0, sizeof y[b].qh);
    for (int c = 0; c < kQK_K / 64; ++c) {
      for (int l = 0; l < 32; ++l) {
        const int lo = sb.q[64 * c + l], hi = sb.q[64 * c + 32 + l];
        y[b].qs[32 * c + l] = static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
      }
    }
    for (int e = 0; e < kQK_K; ++e) y[b].qh[e % 32] |= static_cast<uint8_t>((sb.q[e] >> 4) << (e / 32));
  }
}

// --- Q6_K: w = d * scale_s * l, l in [-32, 31], per sub-block of 16 --------------------------------

constexpr int kSymSub = 16;
constexpr int kSymSubs = kQK_K / kSymSub;

int symmetric_code(float w, float step) { return step != 0 ? round_clamp(w / step, -32, 31) : 0; }

float symmetric_error(const float* x, const float* importance, float step) {
  float error = 0;
  for (int i = 0; i < kSymSub; ++i) {
    const float e = step * static_cast<float>(symmetric_code(x[i], step)) - x[i];
    error += importance[i] * e * e;
  }
  return error;
}

// The least-squares step of one sub-block. The weight of largest magnitude maps to -32 steps (the
// code range's long end) times (32 + k/10)/32, k = -9..9; each trial's codes get the step that fits
// them best, sum(w x l) / sum(w l^2), and the trial whose fit leaves the least error wins (for a
// fitted step that error is sum(w x^2) - sum(w x l)^2 / sum(w l^2), so the largest quotient wins).
float fit_symmetric(const float* x, const float* importance) {
  float extreme = 0;
  for (int i = 0; i < kSymSub; ++i) {
    if (std::fabs(x[i]) > std::fabs(extreme)) extreme = x[i];
  }
  if (std::fabs(extreme) < kNegligible) return 0;
  float best_step = 0, best_quotient = 0;
  for (int k = -9; k <= 9; ++k) {
    const float inv_step = -(32.0f + 0.1f * static_cast<float>(k)) / extreme;
    float sxl = 0, sll = 0;
    for (int i = 0; i < kSymSub; ++i) {
      const float l = static_cast<float>(round_clamp(inv_step * x[i], -32, 31));
      sxl += importance[i] * x[i] * l;
      sll += importance[i] * l * l;
    }
    if (sll > 0 && sxl * sxl / sll > best_quotient) {
      best_quotient = sxl * sxl / sll;
      best_step = sxl / sll;
    }
  }
  return best_step;
}

void quantize_q6_k(const float* x, BlockQ6_K* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQK_K) {
    // GGML's weighting for Q6_K: the square of each weight.
    float importance[kQK_K];
    for (int i = 0; i < kQK_K; ++i) importance[i] = x[i] * x[i];
    float steps[kSymSubs];
    float extreme = 0;  // the step of largest magnitude, sign kept
    for (int s = 0; s < kSymSubs; ++s) {
      steps[s] = fit_symmetric(x + s * kSymSub, importance + s * kSymSub);
      if (std::fabs(steps[s]) > std::fabs(extreme)) extreme = steps[s];
    }
    // The step of largest magnitude takes code -128, the long end of int8.
    y[b].d = std::fabs(extreme) < kNegligible ? f16_bits{0} : fp32_to_fp16(extreme / -128);
    const float d = fp16_to_fp32(y[b].d);
    int8_t l[kQK_K];
    for (int s = 0; s < kSymSubs; ++s) {
      const float* xs = x + s * kSymSub;
      const float* ws = importance + s * kSymSub;
      const int c0 = d != 0 ? round_clamp(steps[s] / d, -128, 127) : 0;
      int best = c0;
      float best_error = symmetric_error(xs, ws, d * static_cast<float>(c0));
      for (int c = std::max(-128, c0 - 1); c <= std::min(127, c0 + 1); ++c) {
        const float error = symmetric_error(xs, ws, d * static_cast<float>(c));
        if (error < best_error) {
          best = c;
          best_error = error;
        }
      }
      y[b].scales[s] = static_cast<int8_t>(best);
      for (int i = 0; i < kSymSub; ++i) l[s * kSymSub + i] = static_cast<int8_t>(symmetric_code(xs[i], d * static_cast<float>(best)));
    }
    // Two halves of 128; in each, element 32 k + j (k = 0..3) has its low 4 bits in ql[j] (k = 0, 2:
    // low / high nibble) or ql[32 + j] (k = 1, 3) and its top 2 bits at bit 2k of qh[j].
    for (int h = 0; h < 2; ++h) {
      uint8_t* ql = y[b].ql + 64 * h;
      uint8_t* qh = y[b].qh + 32 * h;
      const int8_t* lh = l + 128 * h;
      for (int j = 0; j < 32; ++j) {
        int q[4];
        for (int k = 0; k < 4; ++k) q[k] = lh[32 * k + j] + 32;
        ql[j] = static_cast<uint8_t>((q[0] & 0x0F) | ((q[2] & 0x0F) << 4));
        ql[32 + j] = static_cast<uint8_t>((q[1] & 0x0F) | ((q[3] & 0x0F) << 4));
        qh[j] = static_cast<uint8_t>((q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6));
      }
    }
  }
}

}  // namespace

bool can_quantize(TensorType type) {
  switch (type) {
    case TensorType::F32: case TensorType::F16: case TensorType::BF16:
    case TensorType::Q8_0: case TensorType::Q4_0: case TensorType::Q4_1: case TensorType::Q5_0:
    case TensorType::Q5_1: case TensorType::Q4_K: case TensorType::Q5_K: case TensorType::Q6_K:
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
    case TensorType::Q5_0: return quantize_q5_0(src, static_cast<BlockQ5_0*>(dst), n / kQK5_0);
    case TensorType::Q5_1: return quantize_q5_1(src, static_cast<BlockQ5_1*>(dst), n / kQK5_1);
    case TensorType::Q4_K: return quantize_q4_k(src, static_cast<BlockQ4_K*>(dst), n / kQK_K);
    case TensorType::Q5_K: return quantize_q5_k(src, static_cast<BlockQ5_K*>(dst), n / kQK_K);
    case TensorType::Q6_K: return quantize_q6_k(src, static_cast<BlockQ6_K*>(dst), n / kQK_K);
    default: break;
  }
}

}  // namespace ringlm
