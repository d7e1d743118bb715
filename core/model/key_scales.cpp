#include "core/model/key_scales.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ringlm {

namespace {

// Mean squares and the mean product of a pair's channels before RoPE.
struct PairMoments {
  double aa = 0, bb = 0, ab = 0;
};

// The means of cos²(pθ), sin²(pθ) and sin(pθ) cos(pθ) over p in [0, n): from the geometric sum
// of e^{2ipθ}, Σ = e^{i(n-1)θ} sin(nθ) / sin(θ).
struct TurnMeans {
  double cc, ss, cs;
};
TurnMeans turn_means(double theta, int64_t n) {
  double c = 0, s = 0;  // Σ cos(2pθ), Σ sin(2pθ)
  if (std::abs(std::sin(theta)) > 1e-12) {  // (for a slow pair too: sin(nθ) / sin(θ) keeps its digits)
    const double ratio = std::sin(static_cast<double>(n) * theta) / std::sin(theta);
    c = std::cos(static_cast<double>(n - 1) * theta) * ratio;
    s = std::sin(static_cast<double>(n - 1) * theta) * ratio;
  } else {  // θ a multiple of π, or near enough: the sum term by term
    for (int64_t p = 0; p < n; ++p) c += std::cos(2.0 * p * theta), s += std::sin(2.0 * p * theta);
  }
  const double m = static_cast<double>(n);
  return {0.5 + c / (2 * m), 0.5 - c / (2 * m), s / (2 * m)};
}

// Replaces the mean squares of every rotary pair's channels (head by head, `sq` [heads][hd])
// with their means over the rope's positions: a' = a cos - b sin, b' = b cos + a sin.
void carry_over_positions(std::vector<double>& sq, const std::vector<double>& cross, int heads, int hd,
                          const KeyScaleRope& rope) {
  const int half = rope.n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const int a = rope.adjacent_pairs ? 2 * i : i, b = rope.adjacent_pairs ? 2 * i + 1 : i + half;
    const TurnMeans t = turn_means(rope.inv_freq[static_cast<size_t>(i)], rope.n_positions);
    for (int h = 0; h < heads; ++h) {
      const size_t base = static_cast<size_t>(h) * hd;
      const PairMoments m{sq[base + a], sq[base + b], cross[static_cast<size_t>(h) * half + i]};
      sq[base + a] = m.aa * t.cc + m.bb * t.ss - 2 * m.ab * t.cs;
      sq[base + b] = m.aa * t.ss + m.bb * t.cc + 2 * m.ab * t.cs;
    }
  }
}

}  // namespace

std::vector<float> calibrate_key_scales(std::span<const float> q, std::span<const float> k, int n,
                                        const KeyScaleShape& shape, const KeyScaleRope& rope) {
  const int hd = shape.head_dim, kv_dim = shape.n_head_kv * hd;
  if (shape.n_head_kv <= 0 || hd <= 0 || shape.n_head % shape.n_head_kv != 0) {
    throw std::invalid_argument("calibrate_key_scales: inconsistent head shape");
  }
  if (n < 0 || q.size() < static_cast<size_t>(n) * shape.n_head * hd || k.size() < static_cast<size_t>(n) * kv_dim) {
    throw std::invalid_argument("calibrate_key_scales: fewer values than rows");
  }
  if (rope.n_rot != 0 && (rope.n_rot < 0 || rope.n_rot > hd || rope.n_rot % 2 != 0 ||
                          rope.inv_freq.size() != static_cast<size_t>(rope.n_rot / 2) || rope.n_positions <= 0)) {
    throw std::invalid_argument("calibrate_key_scales: inconsistent rotary pairs");
  }
  const int group = shape.n_head / shape.n_head_kv;
  const int half = rope.n_rot / 2;
  // Per key head: the products of each rotary pair's channels, the keys' and the group's queries'.
  std::vector<double> key_cross(static_cast<size_t>(shape.n_head_kv) * half, 0.0), query_cross(key_cross.size(), 0.0);
  const auto pair_products = [&](const float* head, double* into) {
    for (int i = 0; i < half; ++i) {
      const int a = rope.adjacent_pairs ? 2 * i : i, b = rope.adjacent_pairs ? 2 * i + 1 : i + half;
      into[i] += static_cast<double>(head[a]) * head[b];
    }
  };
  std::vector<double> key_square(static_cast<size_t>(kv_dim), 0.0), query_square(static_cast<size_t>(kv_dim), 0.0);
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < kv_dim; ++c) {
      const double x = k[static_cast<size_t>(r) * kv_dim + c];
      key_square[static_cast<size_t>(c)] += x * x;
    }
    for (int kh = 0; kh < shape.n_head_kv; ++kh) {
      pair_products(k.data() + static_cast<size_t>(r) * kv_dim + static_cast<size_t>(kh) * hd,
                    key_cross.data() + static_cast<size_t>(kh) * half);
    }
    for (int h = 0; h < shape.n_head; ++h) {
      const float* head = q.data() + (static_cast<size_t>(r) * shape.n_head + h) * hd;
      double* into = query_square.data() + static_cast<size_t>(h / group) * hd;
      for (int i = 0; i < hd; ++i) into[i] += static_cast<double>(head[i]) * head[i];
      pair_products(head, query_cross.data() + static_cast<size_t>(h / group) * half);
    }
  }
  if (half > 0) {
    carry_over_positions(key_square, key_cross, shape.n_head_kv, hd, rope);
    carry_over_positions(query_square, query_cross, shape.n_head_kv, hd, rope);
  }
  std::vector<float> scales(static_cast<size_t>(kv_dim), 1.0f);
  for (int kh = 0; kh < shape.n_head_kv; ++kh) {
    const size_t base = static_cast<size_t>(kh) * hd;
    std::vector<double> s(static_cast<size_t>(hd), 1.0);
    double log_sum = 0.0;
    for (int i = 0; i < hd; ++i) {
      const double ks = key_square[base + i], qs = query_square[base + i];
      if (ks > 0.0 && qs > 0.0) s[static_cast<size_t>(i)] = std::pow(ks / (qs / group), 0.25);
      log_sum += std::log(s[static_cast<size_t>(i)]);
    }
    const double mean = std::exp(log_sum / hd);
    for (int i = 0; i < hd; ++i) {
      scales[base + i] = static_cast<float>(std::clamp(s[static_cast<size_t>(i)] / mean, 1.0 / kKeyScaleLimit,
                                                       static_cast<double>(kKeyScaleLimit)));
    }
  }
  return scales;
}

}  // namespace ringlm
