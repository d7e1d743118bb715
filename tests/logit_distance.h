// How far apart two paths' logits are, for the tests that compare two ways of computing the same
// next-token distribution. Why two measures: on the fp32 path two orders of the same work differ
// by float rounding only, so the largest logit difference stays within ~1e-3 of the logit range;
// on the int8 path the activations are rounded to 8 bits per block of 32, and any rounding
// difference upstream moves some of them by a whole step, which the layers after carry on. Two
// int8 paths (decode and prefill, two SIMD targets) then differ about as much as each differs
// from fp32 (bench/int8_paths: a mean KL divergence of about 4e-3 over 512 positions of text, a
// single logit off by up to 9% of the range): a per-logit bound tight enough to catch an error
// would fail at random positions there, so those comparisons bound the KL divergence instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace ringlm::test {

inline float max_abs_diff(std::span<const float> a, std::span<const float> b) {
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

inline float logit_range(std::span<const float> x) {
  const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
  return *hi - *lo;
}

// log softmax(x), in double.
inline std::vector<double> log_softmax(std::span<const float> x) {
  const double mx = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (const float v : x) sum += std::exp(v - mx);
  const double log_sum = mx + std::log(sum);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] - log_sum;
  return out;
}

// KL(softmax(p) || softmax(q)) in nats: what is lost by sampling from q where p is right.
inline double kl_divergence(std::span<const float> p, std::span<const float> q) {
  const std::vector<double> lp = log_softmax(p), lq = log_softmax(q);
  double kl = 0;
  for (size_t i = 0; i < lp.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return kl;
}

}  // namespace ringlm::test
