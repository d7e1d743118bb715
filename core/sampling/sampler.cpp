#include "core/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace ringlm {

Sampler::Sampler(const SamplingParams& params, int n_vocab) : params_(params) {
  if (n_vocab <= 0) throw std::invalid_argument("Sampler: empty vocabulary");
  seed_ = params.seed == 0xFFFFFFFF ? std::random_device{}() : params.seed;
  rng_.seed(seed_);
  candidates_.reserve(static_cast<size_t>(n_vocab));
}

void Sampler::apply_penalties(std::span<float> logits, std::span<const int32_t> history) {
  const bool any = params_.repeat_penalty != 1.0f || params_.frequency_penalty != 0.0f || params_.presence_penalty != 0.0f;
  if (!any || params_.repeat_last_n == 0 || history.empty()) return;
  const size_t n = params_.repeat_last_n < 0 ? history.size()
                                              : std::min(history.size(), static_cast<size_t>(params_.repeat_last_n));
  // Each distinct recent token with its count (sorted, then runs counted): the repetition
  // penalty applies once per token, the frequency penalty once per occurrence.
  recent_.assign(history.end() - static_cast<std::ptrdiff_t>(n), history.end());
  std::sort(recent_.begin(), recent_.end());
  recent_counts_.clear();
  for (size_t i = 0; i < recent_.size();) {
    size_t j = i;
    while (j < recent_.size() && recent_[j] == recent_[i]) ++j;
    recent_counts_.emplace_back(recent_[i], static_cast<int>(j - i));
    i = j;
  }
  for (const auto& [id, count] : recent_counts_) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) continue;
    float& l = logits[static_cast<size_t>(id)];
    if (params_.repeat_penalty != 1.0f) l = l > 0 ? l / params_.repeat_penalty : l * params_.repeat_penalty;
    l -= static_cast<float>(count) * params_.frequency_penalty + params_.presence_penalty;
  }
}

// The larger logit first, the lower id among equals: select_top_k's order, so that the top k of
// the whole vocabulary are the k a device picks, ties at the k-th included.
static bool ranks_before(const Sampler::Candidate& a, const Sampler::Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

void Sampler::keep_top_k(size_t k) {
  if (k == 0 || k >= candidates_.size()) return;
  std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(k), candidates_.end(),
                    ranks_before);
  candidates_.resize(k);
}

// Softmax over the candidates, which must be sorted by logit, largest first.
static void softmax_sorted(std::vector<Sampler::Candidate>& c, float temperature);

void Sampler::keep_top_p() {
  if (params_.top_p >= 1.0f) return;
  double cumulative = 0;
  size_t keep = candidates_.size();
  for (size_t i = 0; i < candidates_.size(); ++i) {
    cumulative += candidates_[i].p;
    if (cumulative >= params_.top_p) {
      keep = i + 1;
      break;
    }
  }
  candidates_.resize(std::max<size_t>(keep, 1));
}

void Sampler::keep_min_p() {
  if (params_.min_p <= 0.0f) return;
  const float threshold = candidates_.front().p * params_.min_p;
  size_t keep = 1;
  while (keep < candidates_.size() && candidates_[keep].p >= threshold) ++keep;
  candidates_.resize(keep);
}

static void softmax_sorted(std::vector<Sampler::Candidate>& c, float temperature) {
  const float max_logit = c.front().logit;
  double sum = 0;
  for (auto& x : c) {
    x.p = std::exp((x.logit - max_logit) / temperature);
    sum += x.p;
  }
  for (auto& x : c) x.p = static_cast<float>(x.p / sum);
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  apply_penalties(logits, history);
  if (params_.temperature <= 0.0f) return argmax(logits);

  candidates_.clear();
  for (size_t i = 0; i < logits.size(); ++i) candidates_.push_back({static_cast<int32_t>(i), logits[i], 0.0f});
  const size_t k = params_.top_k > 0 ? static_cast<size_t>(params_.top_k) : candidates_.size();
  keep_top_k(k);
  std::sort(candidates_.begin(), candidates_.end(), ranks_before);
  return draw_sorted();
}

int Sampler::candidates_needed() const {
  const bool penalties =
      params_.repeat_last_n != 0 &&
      (params_.repeat_penalty != 1.0f || params_.frequency_penalty != 0.0f || params_.presence_penalty != 0.0f);
  if (penalties) return 0;
  if (params_.temperature <= 0.0f) return 1;
  return params_.top_k > 0 && params_.top_k <= kMaxCandidates ? params_.top_k : 0;
}

int32_t Sampler::sample_top(std::span<const TopLogit> top) {
  if (top.empty()) throw std::invalid_argument("Sampler::sample_top: no candidates");
  if (params_.temperature <= 0.0f) return std::max(top[0].id, 0);  // no candidate at all (every logit NaN): 0, as argmax
  candidates_.clear();
  for (const TopLogit& t : top) {
    if (t.id >= 0) candidates_.push_back({t.id, t.logit, 0.0f});
  }
  if (candidates_.empty()) return 0;
  return draw_sorted();
}

int32_t Sampler::draw_sorted() {
  // top-p and min-p judge the distribution before temperature, as llama.cpp's default chain does.
  softmax_sorted(candidates_, 1.0f);
  keep_top_p();
  keep_min_p();
  softmax_sorted(candidates_, params_.temperature);

  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double r = uniform(rng_);
  for (const Candidate& c : candidates_) {
    r -= c.p;
    if (r <= 0) return c.id;
  }
  return candidates_.back().id;
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int top_n) {
  if (token < 0 || static_cast<size_t>(token) >= logits.size()) throw std::out_of_range("token_logprobs: token outside the vocabulary");
  // log softmax(x)_i = x_i - max - log(sum exp(x - max)), the sum in double.
  const float max_logit = logits[static_cast<size_t>(argmax(logits))];
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max_logit);
  const double log_z = max_logit + std::log(sum);
  const auto logprob = [&](int32_t id) { return static_cast<float>(logits[static_cast<size_t>(id)] - log_z); };

  TokenLogprobs out;
  out.chosen = {token, logprob(token)};
  const size_t n = std::min(logits.size(), static_cast<size_t>(std::max(top_n, 0)));
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(), [&](int32_t a, int32_t b) {
    const float la = logits[static_cast<size_t>(a)], lb = logits[static_cast<size_t>(b)];
    return la > lb || (la == lb && a < b);
  });
  for (size_t i = 0; i < n; ++i) out.top.push_back({ids[i], logprob(ids[i])});
  return out;
}

}  // namespace ringlm
