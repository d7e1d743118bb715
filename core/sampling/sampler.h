// Token sampling: repetition penalty, then top-k, top-p, min-p and temperature, then a draw
// from the remaining distribution with a seeded generator (llama.cpp's order). A temperature
// of 0 or below is greedy. The same seed and the same logits give the same tokens.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace ringlm {

struct SamplingParams {
  float temperature = 0.8f;
  int top_k = 40;            // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  int repeat_last_n = 64;    // how many recent tokens the penalty looks at (0: none, -1: all)
  uint64_t seed = 0xFFFFFFFF;  // 0xFFFFFFFF: pick a random seed
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, int n_vocab);

  // Picks the next token from `logits` ([n_vocab], modified in place) given the tokens so far.
  int32_t sample(std::span<float> logits, std::span<const int32_t> history);

  struct Candidate {
    int32_t id;
    float logit;
    float p;
  };

  uint64_t seed() const { return seed_; }
  const SamplingParams& params() const { return params_; }

 private:
  void apply_repeat_penalty(std::span<float> logits, std::span<const int32_t> history) const;
  void keep_top_k(size_t k);
  void keep_top_p();
  void keep_min_p();

  SamplingParams params_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<Candidate> candidates_;  // reused between calls: no allocation per token
};

// Index of the largest logit (the lowest index among equals).
int32_t argmax(std::span<const float> logits);

}  // namespace ringlm
