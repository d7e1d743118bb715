// Sampler behaviour checked against the definitions of each method, computed independently here.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "core/sampling/sampler.h"

namespace ringlm {
namespace {

// Logits whose softmax (temperature 1) is exactly `probs`.
std::vector<float> logits_for(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(static_cast<float>(std::log(p)));
  return l;
}

SamplingParams no_filters(float temperature, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.repeat_penalty = 1.0f;
  p.seed = seed;
  return p;
}

std::map<int32_t, int> draw_counts(const SamplingParams& params, const std::vector<float>& logits, int n) {
  Sampler s(params, static_cast<int>(logits.size()));
  std::map<int32_t, int> counts;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = logits;
    ++counts[s.sample(l, {})];
  }
  return counts;
}

TEST(Sampler, ZeroTemperatureIsArgmax) {
  SamplingParams p = no_filters(0.0f, 1);
  Sampler s(p, 5);
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 1.9f, 0.0f};
  EXPECT_EQ(s.sample(logits, {}), 1);
}

TEST(Sampler, ArgmaxPicksLowestIndexAmongTies) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f};
  EXPECT_EQ(argmax(logits), 1);
}

// The definition: std::max_element's first largest element, over random vocabularies with
// repeated values (ties), infinities and NaNs anywhere.
TEST(Sampler, ArgmaxMatchesMaxElement) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t n = 1 + rng() % 300;
    std::vector<float> logits(n);
    for (float& v : logits) v = static_cast<float>(static_cast<int>(rng() % 40) - 20) / 4.0f;  // many ties
    if (trial % 4 == 1) logits[rng() % n] = INFINITY;
    if (trial % 4 == 2) logits[rng() % n] = NAN;
    if (trial % 8 == 3) logits[0] = NAN;
    if (trial % 8 == 7) std::fill(logits.begin(), logits.end(), -INFINITY);
    const auto expected = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ASSERT_EQ(argmax(logits), expected) << "trial " << trial << " n " << n;
  }
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDifferentTokens) {
  const std::vector<float> logits(64, 0.0f);  // uniform: every draw is pure randomness
  auto run = [&](uint64_t seed) {
    Sampler s(no_filters(1.0f, seed), 64);
    std::vector<int32_t> out;
    for (int i = 0; i < 50; ++i) {
      std::vector<float> l = logits;
      out.push_back(s.sample(l, {}));
    }
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, FrequenciesFollowTemperatureSoftmax) {
  const std::vector<double> probs = {0.5, 0.25, 0.15, 0.1};
  const float temperature = 0.7f;
  const int n = 40000;
  const auto counts = draw_counts(no_filters(temperature, 7), logits_for(probs), n);
  // Expected: softmax(log p / T) = p^(1/T) normalised.
  double z = 0;
  for (double p : probs) z += std::pow(p, 1.0 / temperature);
  for (size_t i = 0; i < probs.size(); ++i) {
    const double expected = std::pow(probs[i], 1.0 / temperature) / z;
    const double got = counts.count(static_cast<int32_t>(i)) ? counts.at(static_cast<int32_t>(i)) / double(n) : 0.0;
    // 5 standard deviations of a binomial proportion.
    EXPECT_NEAR(got, expected, 5 * std::sqrt(expected * (1 - expected) / n)) << "token " << i;
  }
}

// Speculative sampling: whatever distribution q the draft came from, the tokens check_draft
// returns follow the target's p, and a draft is accepted with probability sum_x min(p(x), q(x))
// (the identity of Leviathan et al.). p here: top-2 of five logits at temperature 0.8, computed
// by hand; q: certain guesses (prompt lookup) of each token, one outside p's support included,
// and draft distributions that over- and under-weight p's tokens.
TEST(Sampler, SpeculativeSamplingFollowsTheTarget) {
  const std::vector<double> base = {0.4, 0.3, 0.15, 0.1, 0.05};
  const float temperature = 0.8f;
  SamplingParams params = no_filters(temperature, 11);
  params.top_k = 3;
  // p: tokens 0, 1 and 2, base^(1/T) normalised over them.
  std::vector<double> p(base.size(), 0.0);
  double z = 0;
  for (size_t i = 0; i < 3; ++i) z += std::pow(base[i], 1.0 / temperature);
  for (size_t i = 0; i < 3; ++i) p[i] = std::pow(base[i], 1.0 / temperature) / z;

  using Q = std::vector<double>;
  const std::vector<Q> drafts = {
      {1, 0, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 1, 0},  // certain guesses: likely, unlikely, impossible
      {0.1, 0.1, 0.2, 0.3, 0.3},                          // mostly outside p's support
      {0.7, 0.1, 0.1, 0.1, 0.0},                          // over-weights p's best
      p,                                                  // the target itself: always accepted
  };
  const int n = 40000;
  std::mt19937_64 guesser(5);
  for (size_t d = 0; d < drafts.size(); ++d) {
    const Q& q = drafts[d];
    const bool certain = std::count(q.begin(), q.end(), 1.0) == 1;
    std::vector<Sampler::Candidate> q_candidates;
    for (size_t i = 0; i < q.size(); ++i) {
      if (q[i] > 0) q_candidates.push_back({static_cast<int32_t>(i), 0.0f, static_cast<float>(q[i])});
    }
    Sampler sampler(params, static_cast<int>(base.size()));
    std::discrete_distribution<int32_t> draw_q(q.begin(), q.end());
    std::vector<int> counts(base.size(), 0);
    int accepted = 0;
    for (int t = 0; t < n; ++t) {
      std::vector<float> logits = logits_for(base);
      const int32_t drafted = draw_q(guesser);
      const auto verdict = sampler.check_draft(logits, {}, drafted, certain ? std::span<const Sampler::Candidate>()
                                                                              : std::span<const Sampler::Candidate>(q_candidates));
      ++counts[static_cast<size_t>(verdict.token)];
      if (verdict.accepted) {
        ++accepted;
        EXPECT_EQ(verdict.token, drafted);
      }
    }
    for (size_t i = 0; i < base.size(); ++i) {
      const double got = counts[i] / double(n);
      EXPECT_NEAR(got, p[i], 5 * std::sqrt(p[i] * (1 - p[i]) / n) + 1e-12) << "draft " << d << ", token " << i;
    }
    double overlap = 0;
    for (size_t i = 0; i < base.size(); ++i) overlap += std::min(p[i], q[i]);
    overlap = std::min(overlap, 1.0);
    EXPECT_NEAR(accepted / double(n), overlap, 5 * std::sqrt(overlap * (1 - overlap) / n) + 1e-3) << "draft " << d;
  }
}

// Greedy: a draft is accepted when it is the most likely token, which is returned otherwise.
TEST(Sampler, GreedyCheckingAcceptsOnlyTheMostLikelyToken) {
  Sampler sampler(no_filters(0.0f, 1), 4);
  const std::vector<float> logits = {0.1f, 2.0f, 1.5f, -1.0f};
  for (int32_t drafted = 0; drafted < 4; ++drafted) {
    std::vector<float> l = logits;
    const auto verdict = sampler.check_draft(l, {}, drafted, {});
    EXPECT_EQ(verdict.token, 1);
    EXPECT_EQ(verdict.accepted, drafted == 1);
  }
}

TEST(Sampler, TopKOneIsGreedyAtAnyTemperature) {
  SamplingParams p = no_filters(5.0f, 3);
  p.top_k = 1;
  const auto counts = draw_counts(p, {0.0f, 0.5f, 0.4f, -2.0f}, 500);
  ASSERT_EQ(counts.size(), 1u);
  EXPECT_EQ(counts.begin()->first, 1);
}

TEST(Sampler, TopKKeepsOnlyTheKMostLikely) {
  SamplingParams p = no_filters(1.0f, 4);
  p.top_k = 2;
  const auto counts = draw_counts(p, logits_for({0.1, 0.4, 0.3, 0.2}), 2000);
  for (const auto& [id, c] : counts) EXPECT_TRUE(id == 1 || id == 2) << "token " << id << " drawn " << c << " times";
  EXPECT_EQ(counts.size(), 2u);
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  SamplingParams p = no_filters(1.0f, 5);
  p.top_p = 0.7f;  // 0.5 + 0.3 reaches 0.7: tokens 0 and 1 only
  const auto counts = draw_counts(p, logits_for({0.5, 0.3, 0.15, 0.05}), 2000);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts.count(0), 0u);
  EXPECT_GT(counts.count(1), 0u);
}

TEST(Sampler, MinPDropsTokensBelowAFractionOfTheBest) {
  SamplingParams p = no_filters(1.0f, 6);
  p.min_p = 0.5f;  // threshold 0.25: tokens 0 (0.5) and 1 (0.3) survive
  const auto counts = draw_counts(p, logits_for({0.5, 0.3, 0.15, 0.05}), 2000);
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts.count(2), 0u);
  EXPECT_EQ(counts.count(3), 0u);
}

TEST(Sampler, RepeatPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  SamplingParams p = no_filters(0.0f, 1);
  p.repeat_penalty = 2.0f;
  p.repeat_last_n = 2;
  Sampler s(p, 4);
  std::vector<float> logits = {3.0f, 2.0f, -1.0f, 1.8f};
  const std::vector<int32_t> history = {0, 0, 2, 0};  // last 2: {2, 0}
  // Token 0: 3 -> 1.5; token 2: -1 -> -2; token 1 untouched (2.0) wins.
  EXPECT_EQ(s.sample(logits, history), 1);
  EXPECT_FLOAT_EQ(logits[0], 1.5f);
  EXPECT_FLOAT_EQ(logits[2], -2.0f);
  EXPECT_FLOAT_EQ(logits[1], 2.0f);
}

TEST(Sampler, RepeatPenaltyLooksOnlyAtTheLastNTokens) {
  SamplingParams p = no_filters(0.0f, 1);
  p.repeat_penalty = 10.0f;
  p.repeat_last_n = 1;
  Sampler s(p, 3);
  std::vector<float> logits = {5.0f, 4.0f, 0.0f};
  const std::vector<int32_t> history = {0, 1};  // only token 1 is recent
  EXPECT_EQ(s.sample(logits, history), 0);
  EXPECT_FLOAT_EQ(logits[1], 0.4f);
}

// OpenAI's definition: logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty.
TEST(Sampler, FrequencyAndPresencePenaltiesFollowOpenAIsDefinition) {
  SamplingParams p = no_filters(0.0f, 1);
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.repeat_last_n = 5;
  Sampler s(p, 4);
  std::vector<float> logits = {3.0f, 2.0f, -1.0f, 1.0f};
  const std::vector<int32_t> history = {3, 0, 0, 2, 0, 3};  // last 5: 0 three times, 2 once, 3 once
  s.sample(logits, history);
  EXPECT_FLOAT_EQ(logits[0], 3.0f - 3 * 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[1], 2.0f);
  EXPECT_FLOAT_EQ(logits[2], -1.0f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(logits[3], 1.0f - 0.5f - 0.25f);
}

TEST(Sampler, RepeatPenaltyComesBeforeTheOpenAIPenalties) {
  SamplingParams p = no_filters(0.0f, 1);
  p.repeat_penalty = 2.0f;
  p.frequency_penalty = 1.0f;
  Sampler s(p, 2);
  std::vector<float> logits = {4.0f, 0.0f};
  const std::vector<int32_t> history = {0, 0};
  s.sample(logits, history);
  EXPECT_FLOAT_EQ(logits[0], 4.0f / 2.0f - 2.0f);  // divided once, then minus its count
}

// log softmax computed here in long double.
TEST(Sampler, TokenLogprobsAreTheLogSoftmaxOfTheLogits) {
  const std::vector<float> logits = {1.0f, 3.5f, -2.0f, 3.5f, 0.25f};
  long double z = 0;
  for (float x : logits) z += std::exp(static_cast<long double>(x));
  const auto expected = [&](size_t i) { return static_cast<double>(logits[i] - std::log(z)); };
  const TokenLogprobs lp = token_logprobs(logits, 4, 3);
  EXPECT_EQ(lp.chosen.id, 4);
  EXPECT_NEAR(lp.chosen.logprob, expected(4), 1e-6);
  ASSERT_EQ(lp.top.size(), 3u);
  EXPECT_EQ(lp.top[0].id, 1);  // 1 and 3 tie: the lower id first
  EXPECT_EQ(lp.top[1].id, 3);
  EXPECT_EQ(lp.top[2].id, 0);
  EXPECT_NEAR(lp.top[2].logprob, expected(0), 1e-6);
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) total += std::exp(token_logprobs(logits, static_cast<int32_t>(i), 0).chosen.logprob);
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_TRUE(token_logprobs(logits, 0, 0).top.empty());
  EXPECT_EQ(token_logprobs(logits, 0, 99).top.size(), logits.size());
  EXPECT_THROW(token_logprobs(logits, 5, 1), std::out_of_range);
}

// --- The top k only (what a device sends back) ------------------------------------------------

// The definition: sort every index by value, largest first, the lower index first among equals,
// NaNs left out; {-1, -inf} past the values there are.
std::vector<TopLogit> sorted_top(const std::vector<float>& values, size_t k) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isnan(values[i])) ids.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return values[static_cast<size_t>(a)] > values[static_cast<size_t>(b)]; });
  std::vector<TopLogit> top;
  for (size_t e = 0; e < k; ++e) {
    top.push_back(e < ids.size() ? TopLogit{ids[e], values[static_cast<size_t>(ids[e])]} : TopLogit{-1, -INFINITY});
  }
  return top;
}

TEST(TopK, SelectTopKMatchesAFullSort) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = 1 + rng() % 400;
    std::vector<float> values(n);
    for (float& v : values) v = static_cast<float>(static_cast<int>(rng() % 30) - 15) / 2.0f;  // many ties
    if (trial % 3 == 1) values[rng() % n] = NAN;
    if (trial % 5 == 2) values[rng() % n] = INFINITY;
    if (trial % 7 == 3) values[rng() % n] = -INFINITY;
    const size_t k = 1 + rng() % 70;  // past n too
    std::vector<TopLogit> got(k);
    select_top_k(values, got);
    const std::vector<TopLogit> want = sorted_top(values, k);
    for (size_t e = 0; e < k; ++e) {
      ASSERT_EQ(got[e].id, want[e].id) << "trial " << trial << " n " << n << " k " << k << " pick " << e;
      if (want[e].id >= 0) {
        ASSERT_EQ(got[e].logit, want[e].logit);
      }
    }
  }
}

TEST(TopK, CandidatesNeededOnlyWhenTheTopKDecidesTheDraw) {
  SamplingParams p = no_filters(0.0f, 1);
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 1);  // greedy
  p.temperature = 0.8f;
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 0);  // the whole vocabulary may be drawn
  p.top_k = 40;
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 40);
  p.top_k = Sampler::kMaxCandidates + 1;
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 0);
  p.top_k = 40;
  p.repeat_penalty = 1.1f;  // penalties change logits that may not be among the top k
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 0);
  p.repeat_last_n = 0;  // ... unless they look at no token
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 40);
  p.repeat_penalty = 1.0f;
  p.repeat_last_n = 64;
  p.presence_penalty = 0.5f;
  p.temperature = 0.0f;
  EXPECT_EQ(Sampler(p, 100).candidates_needed(), 0);
}

// sample_top from the k best draws the very token sample() draws from the whole vocabulary,
// draw after draw, with the same seed: greedy and top-k with top-p, min-p and temperatures.
TEST(TopK, SampleTopDrawsWhatSampleDraws) {
  std::mt19937 rng(5);
  for (int setting = 0; setting < 12; ++setting) {
    SamplingParams p;
    p.temperature = setting == 0 ? 0.0f : 0.3f + 0.2f * static_cast<float>(setting);
    p.top_k = std::vector<int>{1, 2, 5, 40, 64, 17}[static_cast<size_t>(setting % 6)];
    p.top_p = setting % 3 == 0 ? 1.0f : 0.9f;
    p.min_p = setting % 4 == 0 ? 0.0f : 0.05f;
    p.seed = 100 + static_cast<uint64_t>(setting);
    const int n_vocab = 500;
    Sampler whole(p, n_vocab), top_only(p, n_vocab);
    const int k = top_only.candidates_needed();
    ASSERT_GT(k, 0);
    for (int step = 0; step < 60; ++step) {
      std::vector<float> logits(static_cast<size_t>(n_vocab));
      for (float& v : logits) v = static_cast<float>(static_cast<int>(rng() % 200) - 100) / 25.0f;  // ties at the k-th too
      std::vector<TopLogit> top(static_cast<size_t>(k));
      select_top_k(logits, top);
      const int32_t from_top = top_only.sample_top(top);
      ASSERT_EQ(whole.sample(logits, {}), from_top) << "setting " << setting << " step " << step;
    }
  }
}

}  // namespace
}  // namespace ringlm
