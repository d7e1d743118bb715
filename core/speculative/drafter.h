// What speculative decoding asks of a guesser: the tokens it expects to follow the text so far.
// Prompt lookup (prompt_lookup.h) guesses from the text itself; a draft model (draft_model.h)
// runs a smaller model of the same vocabulary. The target model then checks a draft in one pass
// (core/session/generation.h), so a guesser only decides how fast the text comes, never what
// it says.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/sampling/sampler.h"

namespace ringlm {

struct Draft {
  std::vector<int32_t> tokens;
  // The distribution each token was drawn from, when the guesser drew them at a temperature
  // (Sampler::check_draft's q). Empty when every guess was certain: prompt lookup's, or a draft
  // model's greedy ones.
  std::vector<std::vector<Sampler::Candidate>> q;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // At most `limit` tokens guessed to follow `history` (the prompt and every token taken so
  // far, the one about to be evaluated included); empty for no guess.
  virtual Draft guess(std::span<const int32_t> history, int limit) = 0;
  // The target has just evaluated `prompt` (in one pass): a guesser with a model of its own
  // evaluates it too, so that the first guess does not (a draft model's prefill then counts as
  // the prompt's time, as llama.cpp counts it). Optional: guess() follows any history anyway.
  virtual void start(std::span<const int32_t> prompt) { (void)prompt; }
};

}  // namespace ringlm
