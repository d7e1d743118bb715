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

void Sampler::gather_candidates(std::span<float> logits, std::span<const int32_t> history) {
  apply_penalties(logits, history);
  candidates_.clear();
  for (size_t i = 0; i < logits.size(); ++i) candidates_.push_back({static_cast<int32_t>(i), logits[i], 0.0f});
  const size_t k = params_.top_k > 0 ? static_cast<size_t>(params_.top_k) : candidates_.size();
  keep_top_k(k);
  std::sort(candidates_.begin(), candidates_.end(), ranks_before);
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  if (params_.temperature <= 0.0f) {
    apply_penalties(logits, history);
    return argmax(logits);
  }
  gather_candidates(logits, history);
  filter_sorted();
  return draw_from(candidates_);
}

std::span<const Sampler::Candidate> Sampler::distribution(std::span<float> logits, std::span<const int32_t> history) {
  if (params_.temperature <= 0.0f) {
    apply_penalties(logits, history);
    const int32_t best = argmax(logits);
    candidates_.assign(1, {best, logits[static_cast<size_t>(best)], 1.0f});
    return candidates_;
  }
  gather_candidates(logits, history);
  filter_sorted();
  return candidates_;
}

Sampler::Verdict Sampler::check_draft(std::span<float> logits, std::span<const int32_t> history, int32_t drafted,
                                      std::span<const Candidate> q) {
  if (params_.temperature <= 0.0f) {
    const int32_t best = sample(logits, history);
    return {best, best == drafted};
  }
  const std::span<const Candidate> p = distribution(logits, history);
  q_by_id_.assign(q.begin(), q.end());
  std::sort(q_by_id_.begin(), q_by_id_.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
  const auto q_of = [&](int32_t id) -> double {
    if (q.empty()) return id == drafted ? 1.0 : 0.0;
    const auto it = std::lower_bound(q_by_id_.begin(), q_by_id_.end(), id,
                                     [](const Candidate& c, int32_t wanted) { return c.id < wanted; });
    return it != q_by_id_.end() && it->id == id ? it->p : 0.0;
  };
  double p_drafted = 0;
  for (const Candidate& c : p) {
    if (c.id == drafted) p_drafted = c.p;
  }
  const double q_drafted = q_of(drafted);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  // Accept when u < p/q (u in [0, 1)): certain when p >= q, impossible when p = 0.
  if (p_drafted > 0 && uniform(rng_) * q_drafted < p_drafted) return {drafted, true};
  residual_.clear();
  double mass = 0;
  for (const Candidate& c : p) {
    const double r = std::max(0.0, static_cast<double>(c.p) - q_of(c.id));
    if (r > 0) {
      residual_.push_back({c.id, c.logit, static_cast<float>(r)});
      mass += r;
    }
  }
  // p = q leaves no residual, and then no draft is ever rejected; rounding may still get here.
  if (residual_.empty()) return {draw_from(p), false};
  for (Candidate& c : residual_) c.p = static_cast<float>(c.p / mass);
  return {draw_from(residual_), false};
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
  filter_sorted();
  return draw_from(candidates_);
}

void Sampler::filter_sorted() {
  // top-p and min-p judge the distribution before temperature, as llama.cpp's default chain does.
  softmax_sorted(candidates_, 1.0f);
  keep_top_p();
  keep_min_p();
  softmax_sorted(candidates_, params_.temperature);
}

int32_t Sampler::draw_from(std::span<const Candidate> distribution) {
  if (distribution.empty()) throw std::invalid_argument("Sampler::draw_from: no candidates");
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  double r = uniform(rng_);
  for (const Candidate& c : distribution) {
    r -= c.p;
    if (r <= 0) return c.id;
  }
  return distribution.back().id;
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
