// Token sampling: the penalties for recent tokens (repetition, then OpenAI's frequency and
// presence), then top-k, top-p, min-p and temperature, then a draw from the remaining
// distribution with a seeded generator (llama.cpp's order). A temperature of 0 or below is
// greedy. The same seed and the same logits give the same tokens.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "backends/top_k.h"

namespace ringlm {

struct SamplingParams {
  float temperature = 0.8f;
  int top_k = 40;            // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  // OpenAI's penalties: a recent token's logit minus frequency_penalty times its count and
  // presence_penalty once (0: off).
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  int repeat_last_n = 64;    // how many recent tokens the penalties look at (0: none, -1: all)
  uint64_t seed = 0xFFFFFFFF;  // 0xFFFFFFFF: pick a random seed
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, int n_vocab);

  // Picks the next token from `logits` ([n_vocab], modified in place) given the tokens so far.
  int32_t sample(std::span<float> logits, std::span<const int32_t> history);

  // The most likely tokens this sampler ever needs to see: k when it draws from the top k only
  // (1 when greedy) and no penalty changes logits, so that the k best logits (select_top_k's)
  // decide the draw exactly as the whole vocabulary would; 0 when it needs every logit. A device
  // then sends back k pairs instead of the vocabulary.
  int candidates_needed() const;
  static constexpr int kMaxCandidates = 64;  // RINGLM_TOP_K_MAX: what a device picks at most
  // The same draw as sample() from the candidates_needed() most likely tokens (select_top_k's
  // order): the same token for the same seed and logits.
  int32_t sample_top(std::span<const TopLogit> top);

  struct Candidate {
    int32_t id;
    float logit;
    float p;
  };
  // The order of candidates: the largest logit first, the lowest id among equals.
  static bool ranks_before(const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }

  // The distribution sample() draws from: the tokens the penalties and filters leave, most
  // likely first, with their probabilities at the temperature (greedy: the most likely token
  // alone, p = 1). `logits` is modified in place; the span lives until the next call.
  std::span<const Candidate> distribution(std::span<float> logits, std::span<const int32_t> history);
  // A draw from a distribution() (or any list of candidates whose p sum to 1).
  int32_t draw_from(std::span<const Candidate> distribution);

  // Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): `drafted` was guessed from the
  // distribution q (empty: guessed with certainty, q = 1 for it). With p the distribution of
  // `logits` (after penalties and filters, as sample()), it is accepted with probability
  // min(1, p/q); otherwise the token is drawn from the residual max(0, p - q), normalised.
  // The token returned then follows p exactly, whatever q was. Greedy: accepted when it is the
  // most likely token, which is returned otherwise (no random draw).
  struct Verdict {
    int32_t token;
    bool accepted;
  };
  Verdict check_draft(std::span<float> logits, std::span<const int32_t> history, int32_t drafted,
                      std::span<const Candidate> q);

  uint64_t seed() const { return seed_; }
  const SamplingParams& params() const { return params_; }

 private:
  void apply_penalties(std::span<float> logits, std::span<const int32_t> history);
  void keep_top_k(size_t k);
  void keep_top_p();
  void keep_min_p();
  // Top-p, min-p and temperature over the candidates (sorted, largest logit first): the
  // probabilities draw_from() draws by.
  void filter_sorted();
  // sample()'s candidates, before filter_sorted(): the top k of the penalised logits, sorted.
  void gather_candidates(std::span<float> logits, std::span<const int32_t> history);

  SamplingParams params_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<Candidate> candidates_;  // reused between calls: no allocation per token
  std::vector<Candidate> residual_;    // check_draft's max(0, p - q)
  std::vector<Candidate> q_by_id_;     // check_draft's q, sorted by id for lookups
  std::vector<int32_t> recent_;                         // reused by apply_penalties
  std::vector<std::pair<int32_t, int>> recent_counts_;  // ... (token, count)
};

// The log-probability of `token` under the model's distribution, softmax(logits) (before any
// penalty or filter, as OpenAI's logprobs), and the `top_n` most likely tokens with theirs,
// most likely first (the lowest id first among equals).
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};
struct TokenLogprobs {
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int top_n);

}  // namespace ringlm
