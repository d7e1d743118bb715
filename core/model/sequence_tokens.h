// One sequence's share of a forward pass: its tokens, its cache, and what the pass hands back
// for it. A single-sequence pass and a batched one are described the same way, and run the same
// way (LlamaModel: one output path), on one process or across pipeline stages.
#pragma once

#include <cstdint>
#include <span>

#include "backends/top_k.h"

namespace ringlm {

class KvCache;

// How a sequence's final hidden states (after the output norm: llama.cpp's result_norm) become one
// vector, an embedding. The values are llama.cpp's (<arch>.pooling_type); kNone and kRank are
// what a file may say, never what a pass can do (a reranker's classification head is not run here).
enum class Pooling : int32_t { kNone = 0, kMean = 1, kCls = 2, kLast = 3, kRank = 4 };

// "none", "mean", "cls", "last" or "rank" (the names llama.cpp's --pooling takes).
inline const char* pooling_name(Pooling pooling) {
  switch (pooling) {
    case Pooling::kNone: return "none";
    case Pooling::kMean: return "mean";
    case Pooling::kCls: return "cls";
    case Pooling::kLast: return "last";
    case Pooling::kRank: return "rank";
  }
  return "unknown";
}

// Whether a pass can pool its rows this way (mean, cls or last).
inline bool pooling_runs(Pooling pooling) {
  return pooling == Pooling::kMean || pooling == Pooling::kCls || pooling == Pooling::kLast;
}

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
  // Its rows' final hidden states pooled into `embedding` ([n_embd]), with no vocabulary
  // projection for them (kNone: not wanted). A prompt longer than one pass is pooled chunk by
  // chunk: `pooled_before` rows of it went into `embedding` in earlier passes (its mean so far,
  // for kMean), and this pass folds its own rows in (kCls keeps the first chunk's first row;
  // kLast takes this chunk's last).
  Pooling pooling = Pooling::kNone;
  float* embedding = nullptr;
  int64_t pooled_before = 0;

  bool wants_top() const { return !top.empty(); }
  bool wants_pooling() const { return pooling != Pooling::kNone; }
  // How many of its last rows the pass hands back (their logits, or the top of the last one).
  size_t rows_wanted() const {
    if (!wants_top() && logits == nullptr) return 0;
    return (steps || all_logits) && !wants_top() ? tokens.size() : 1;
  }
};

}  // namespace ringlm
