// A draft model (Leviathan et al. 2023; llama.cpp's llama-speculative and `-md`): a smaller
// model of the same vocabulary guesses the next tokens one decode step at a time, and the
// target checks them all in one pass. Its KV cache follows the target's text: each guess first
// rolls back the draft tokens the target rejected and evaluates the tokens the target took
// since, so that the draft model sees exactly the target's history before it guesses on.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/kv/kv_cache.h"
#include "core/model/llama.h"
#include "core/sampling/sampler.h"
#include "core/speculative/drafter.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

// llama.cpp's names and defaults (--draft-max, --draft-min, --draft-p-min).
struct DraftModelOptions {
  int max_draft = 16;   // tokens per draft at most
  int min_draft = 0;    // a shorter draft is not worth a checking pass: none is proposed
  float p_min = 0.75f;  // drafting stops before a token the draft model gives less probability
};

// Throws std::invalid_argument unless the draft model's vocabulary can stand for the target's:
// the same token, id by id, over the smaller of the two (llama.cpp allows the sizes to differ by
// padding, up to 128 tokens: Qwen2.5's 0.5B and 7B do), the message naming the first differing one.
void check_same_vocabulary(const Tokenizer& target, const Tokenizer& draft);

class DraftModel : public Drafter {
 public:
  // Guesses with `model` over a cache like the target's (`n_ctx`, `cache`: the same sinks and
  // shifts). Greedy targets get greedy drafts; at a temperature, the draft model samples with
  // the target's parameters and its own generator, and each draft token carries its q.
  DraftModel(LlamaModel& model, int n_ctx, const KvCacheOptions& cache, const SamplingParams& sampling,
             const DraftModelOptions& options);

  Draft guess(std::span<const int32_t> history, int limit) override;
  void start(std::span<const int32_t> prompt) override;

  // Tokens the draft model has evaluated: the history it followed and its own drafts.
  int64_t evaluated() const { return evaluated_; }
  const KvCache& cache() const { return cache_; }

 private:
  // Brings the cache to hold `history` (rolling back what it guessed and the target did not
  // take) and leaves in logits_ the scores after its last token.
  void follow(std::span<const int32_t> history);
  void evaluate(std::span<const int32_t> tokens);

  LlamaModel& model_;
  KvCache cache_;
  Sampler sampler_;
  DraftModelOptions options_;
  bool greedy_;
  std::vector<int32_t> fed_;  // the tokens the cache has seen, in order (those a shift dropped included)
  std::vector<float> logits_;
  std::vector<int32_t> context_;  // history and draft, for the sampler's penalties
  int64_t evaluated_ = 0;
};

}  // namespace ringlm
