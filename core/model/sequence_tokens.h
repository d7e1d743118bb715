// One sequence's share of a forward pass: its tokens, its cache, and what the pass hands back
// for it. A single-sequence pass and a batched one are described the same way, and run the same
// way (LlamaModel: one output path), on one process or across pipeline stages.
#pragma once

#include <cstdint>
#include <span>

#include "backends/top_k.h"

namespace ringlm {

class KvCache;

struct SequenceTokens {
  SequenceTokens() = default;
  SequenceTokens(std::span<const int32_t> tokens_, KvCache* cache_, float* logits_ = nullptr,
                 std::span<TopLogit> top_ = {}, bool steps_ = false)
      : tokens(tokens_), cache(cache_), logits(logits_), top(top_), steps(steps_) {}
  std::span<const int32_t> tokens;  // appended to `cache` at its next positions
  KvCache* cache = nullptr;
  float* logits = nullptr;  // [n_vocab]: the logits of its last token; nullptr: not wanted
  // Or, when not empty, only its last token's top.size() most likely next tokens
  // (select_top_k's order; at most Sampler::kMaxCandidates), instead of the logits.
  std::span<TopLogit> top;
  // A speculative draft's checking pass (forward_steps): every row's logits, [tokens][n_vocab]
  // in `logits`, each row computed as the decode step of its token.
  bool steps = false;
  // Every row's logits, [tokens][n_vocab] in `logits` (a perplexity run), attending as a prompt.
  bool all_logits = false;

  bool wants_top() const { return !top.empty(); }
  // How many of its last rows the pass hands back (their logits, or the top of the last one).
  size_t rows_wanted() const {
    if (!wants_top() && logits == nullptr) return 0;
    return (steps || all_logits) && !wants_top() ? tokens.size() : 1;
  }
};

}  // namespace ringlm
