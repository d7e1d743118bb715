#include "backends/expert_routing.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backends/top_k.h"

namespace ringlm {

namespace {

// A row's route from its chosen experts, with the softmax's max and denominator given.
void weigh(std::span<const TopLogit> top, float max, double sum, std::span<int32_t> experts, std::span<float> weights) {
  for (size_t j = 0; j < top.size(); ++j) {
    const bool chosen = top[j].id >= 0;
    experts[j] = chosen ? top[j].id : 0;
    weights[j] = chosen ? static_cast<float>(std::exp(static_cast<double>(top[j].logit - max)) / sum) : 0.0f;
  }
}

}  // namespace

void route_experts(std::span<const float> logits, int n_expert, int k, bool normalize, std::span<int32_t> experts,
                   std::span<float> weights) {
  if (n_expert < 1 || k < 1 || k > n_expert || logits.size() % static_cast<size_t>(n_expert) != 0) {
    throw std::invalid_argument("route_experts: " + std::to_string(k) + " of " + std::to_string(n_expert) +
                                " experts over " + std::to_string(logits.size()) + " logits");
  }
  const size_t n_rows = logits.size() / static_cast<size_t>(n_expert), K = static_cast<size_t>(k);
  if (experts.size() != n_rows * K || weights.size() != n_rows * K) throw std::invalid_argument("route_experts: output size");
  // (Kept from call to call: a decode step allocates nothing.)
  thread_local std::vector<TopLogit> chosen;
  chosen.resize(K);
  const std::span<TopLogit> top(chosen);
  for (size_t r = 0; r < n_rows; ++r) {
    const std::span<const float> row = logits.subspan(r * static_cast<size_t>(n_expert), static_cast<size_t>(n_expert));
    select_top_k(row, top);
    // The softmax's denominator over the chosen logits or over all of them; the largest logit
    // (the first chosen) is subtracted first, so no exp overflows. A row of NaNs leaves no
    // expert chosen: expert 0 with weight 0 stands in for each (the row's block adds nothing).
    if (normalize) {
      weigh_chosen(top, experts.subspan(r * K, K), weights.subspan(r * K, K));
      continue;
    }
    const float max = top[0].id >= 0 ? top[0].logit : 0.0f;
    double sum = 0.0;
    for (const float l : row) sum += std::isnan(l) ? 0.0 : std::exp(static_cast<double>(l - max));
    weigh(top, max, sum, experts.subspan(r * K, K), weights.subspan(r * K, K));
  }
}

void weigh_chosen(std::span<const TopLogit> top, std::span<int32_t> experts, std::span<float> weights) {
  const float max = top[0].id >= 0 ? top[0].logit : 0.0f;
  double sum = 0.0;
  for (const TopLogit& t : top) sum += t.id >= 0 ? std::exp(static_cast<double>(t.logit - max)) : 0.0;
  weigh(top, max, sum, experts, weights);
}


ExpertGroups group_by_expert(const ExpertRoutes& routes, int n_expert) {
  ExpertGroups g;
  group_by_expert(routes, n_expert, g);
  return g;
}

void group_by_expert(const ExpertRoutes& routes, int n_expert, ExpertGroups& g) {
  g.start.assign(static_cast<size_t>(n_expert) + 1, 0);
  for (const int32_t e : routes.experts) {
    if (e < 0 || e >= n_expert) throw std::out_of_range("expert " + std::to_string(e) + " of " + std::to_string(n_expert));
    ++g.start[static_cast<size_t>(e) + 1];
  }
  for (size_t e = 0; e < static_cast<size_t>(n_expert); ++e) g.start[e + 1] += g.start[e];
  g.row.resize(routes.experts.size());
  g.weight.resize(routes.experts.size());
  g.next.assign(g.start.begin(), g.start.end() - 1);
  const auto K = static_cast<size_t>(routes.k);
  for (size_t i = 0; i < routes.experts.size(); ++i) {  // rows ascending, so each group is too
    const auto slot = static_cast<size_t>(g.next[static_cast<size_t>(routes.experts[i])]++);
    g.row[slot] = static_cast<int64_t>(i / K);
    g.weight[slot] = routes.weights[i];
  }
}

void entries_by_row(const ExpertGroups& groups, int64_t n_rows, int k, std::vector<int64_t>& entries) {
  // Each row's k places filled in the order of the groups (experts ascending); no counters to
  // allocate: a row's next place is its first still unset (k is small).
  entries.assign(static_cast<size_t>(n_rows * k), -1);
  for (size_t slot = 0; slot < groups.row.size(); ++slot) {
    int64_t* place = entries.data() + groups.row[slot] * k;
    while (*place >= 0) ++place;
    *place = static_cast<int64_t>(slot);
  }
}

void sum_weighted_rows(const ExpertGroups& groups, std::span<const int64_t> entries, int k, const float* products,
                       int64_t width, int64_t r0, int64_t r1, float* out) {
  const auto w = static_cast<size_t>(width);
  for (int64_t r = r0; r < r1; ++r) {
    float* const o = out + static_cast<size_t>(r) * w;
    for (int j = 0; j < k; ++j) {
      const auto slot = static_cast<size_t>(entries[static_cast<size_t>(r * k + j)]);
      const float weight = groups.weight[slot];
      const float* const p = products + slot * w;
      if (j == 0) {
        for (size_t c = 0; c < w; ++c) o[c] = p[c] * weight;
      } else {
        for (size_t c = 0; c < w; ++c) o[c] += p[c] * weight;
      }
    }
  }
}

}  // namespace ringlm
