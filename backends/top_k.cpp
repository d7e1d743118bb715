#include "backends/top_k.h"

#include <algorithm>
#include <cmath>

namespace ringlm {

int32_t argmax(std::span<const float> logits) {
  // Two passes that the compiler vectorizes (a max with an index in one loop does not): the
  // largest value, then the first block that holds it, then its first index there. Greedy
  // decoding runs this over the whole vocabulary for every sequence at every step.
  // (The simd pragmas let the compiler reorder the reductions, which IEEE comparisons with NaN
  // would otherwise forbid; NaNs never compare greater, so they are skipped in any order.)
  if (logits.empty() || std::isnan(logits[0])) return 0;  // a NaN first: std::max_element's answer
  const float* x = logits.data();
  const size_t n = logits.size();
  float best = -INFINITY;
#pragma omp simd reduction(max : best)
  for (size_t i = 0; i < n; ++i) best = x[i] > best ? x[i] : best;
  constexpr size_t kBlock = 64;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t end = std::min(n, b + kBlock);
    int found = 0;
#pragma omp simd reduction(| : found)
    for (size_t i = b; i < end; ++i) found |= x[i] == best;
    if (!found) continue;
    for (size_t i = b; i < end; ++i) {
      if (x[i] == best) return static_cast<int32_t>(i);
    }
  }
  return 0;  // not reached: best is one of the logits
}

namespace {

// Whether a is picked before b: the larger logit, then the lower id.
bool ranks_before(const TopLogit& a, const TopLogit& b) { return a.logit > b.logit || (a.logit == b.logit && a.id < b.id); }

}  // namespace

void select_top_k(std::span<const float> values, std::span<TopLogit> top) {
  const size_t k = top.size();
  if (k == 0) return;
  if (k == 1 && !values.empty() && !std::isnan(values[0])) {
    const int32_t best = argmax(values);
    top[0] = {best, values[static_cast<size_t>(best)]};
    return;
  }
  // A heap of the best k so far, its worst on top: a value enters only when it ranks before
  // that one, which after the first few thousand values almost none does.
  size_t count = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const TopLogit candidate{static_cast<int32_t>(i), values[i]};
    if (std::isnan(candidate.logit)) continue;
    if (count < k) {
      top[count++] = candidate;
      std::push_heap(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(count), ranks_before);
    } else if (ranks_before(candidate, top[0])) {
      std::pop_heap(top.begin(), top.end(), ranks_before);
      top[k - 1] = candidate;
      std::push_heap(top.begin(), top.end(), ranks_before);
    }
  }
  std::sort_heap(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(count), ranks_before);
  for (size_t i = count; i < k; ++i) top[i] = {-1, -INFINITY};
}

}  // namespace ringlm
