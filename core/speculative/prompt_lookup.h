// Prompt lookup decoding (Saxena 2023; llama.cpp's llama-lookup): a draft without a second
// model. The text being written often repeats the text it was given (a summary quotes its
// source, a rewrite or a code edit copies most of it, a chat about a document cites it), so
// the tokens that followed an earlier occurrence of the last few tokens are a good guess of
// what comes next. The model then checks the guess in one pass (speculative decoding).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/speculative/drafter.h"

namespace ringlm {

class PromptLookup : public Drafter {
 public:
  // Drafts of at most max_draft tokens, from matches of the last max_ngram tokens, or, when
  // they occur nowhere earlier, of fewer, down to min_ngram. (A single token's earlier
  // occurrence, a common word's, guesses badly: on bench/speculative.py's prompts, min_ngram 2
  // accepted as many tokens as 1 in a third to a half of the checking passes.)
  explicit PromptLookup(int max_draft, int max_ngram = 3, int min_ngram = 2);

  // The tokens that followed the latest earlier occurrence of the longest n-gram ending
  // `history` (the prompt and the text so far), at most `limit` (and max_draft) of them; empty
  // when no n-gram of min_ngram or more tokens occurs earlier.
  std::vector<int32_t> propose(std::span<const int32_t> history, int limit) const;
  Draft guess(std::span<const int32_t> history, int limit) override { return {propose(history, limit), {}}; }

 private:
  int max_draft_, max_ngram_, min_ngram_;
};

}  // namespace ringlm
