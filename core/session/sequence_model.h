// One sequence of a model in its own KV cache: the forward passes of its prompt and of every
// step, the scores the sampler reads after them, the rows of a speculative draft's checking pass
// and its rollback, and the token ids the cache holds.
//
// `run` and `chat` drive it through GenerationModel (generate()), each pass run alone. The
// scheduler of `batch` and `serve` (core/scheduler) holds one per slot and runs every slot's next
// pass together in one LlamaModel::forward_batch: plan() or plan_check() describes a pass,
// passed() takes its outcome back. Prompts prefilled once and read by several sequences (the
// segment cache) go through share_cache() and read_prefix().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backends/backend.h"
#include "core/kv/kv_cache.h"
#include "core/model/llama.h"
#include "core/sampling/sampler.h"
#include "core/session/generation.h"
#include "core/speculative/drafter.h"

namespace ringlm {

// A decode pass that generate() ran (recorded on request: run's --stats).
struct DecodePass {
  double ms = 0;
  int tokens = 0;         // 1, or a token and the draft after it (a checking pass)
  DeviceCounters device;  // what it did on the device (SequenceModel::record_passes)
};

class SequenceModel final : public GenerationModel {
 public:
  // `top_k` > 0: each evaluate() leaves only the top_k most likely tokens' scores
  // (LlamaModel::forward_top: a device sends back those instead of the vocabulary's logits),
  // which is all a sampler whose candidates_needed() is top_k reads; 0: the whole vocabulary's
  // logits. `drafter` (null: no speculative decoding) is the caller's and must outlive this.
  SequenceModel(LlamaModel& model, KvCache cache, int top_k = 0, Drafter* drafter = nullptr);

  // A new sequence in the same cache: empty, counting from zero, with these scores and guesser.
  void reset(int top_k, Drafter* drafter);

  // What a pass leaves for the sampler.
  enum class Scores {
    kNone,     // nothing (a prompt's chunk before its last)
    kSampled,  // the top_k most likely tokens' when the sequence keeps only those, else the logits
    kLogits,   // the whole vocabulary's logits
  };
  // The pass of `tokens` at the end of the sequence, for the caller to run (alone:
  // LlamaModel::forward; with other sequences: forward_batch), then to hand back to passed().
  // `tokens` must live until then.
  SequenceTokens plan(std::span<const int32_t> tokens, Scores scores);
  // A speculative draft's checking pass: `token`, then the draft, every row's logits
  // (checked_rows()), each as the decode step of its token computes it.
  SequenceTokens plan_check(int32_t token, std::span<const int32_t> draft);
  // The planned pass has run: its tokens join the sequence. Returns what a context shift dropped.
  DroppedTokens passed();
  // The last checking pass's logits, a row per token.
  std::span<float> checked_rows() { return draft_rows_; }

  // Shared prompts. share_cache() moves what the cache holds into a read-only cache, which the
  // sequence then reads as the prefix of `fresh` (an empty cache of the same shape), and returns
  // it for other sequences to read too. read_prefix() starts this sequence, empty, on the first
  // tokens.size() tokens of such a cache (`tokens` are their ids), with `logits_after` as its
  // scores when they are kept (the whole prompt read: the next token is drawn from them).
  std::shared_ptr<const KvCache> share_cache(KvCache fresh);
  void read_prefix(std::shared_ptr<const KvCache> prefix, std::span<const int32_t> tokens,
                   std::span<const float> logits_after = {});

  // Evaluates `tokens` (a prompt, a chat's new turn) at the end of the sequence in one pass;
  // the scores are then the last one's. Returns what the context shifts dropped meanwhile.
  DroppedTokens prefill(std::span<const int32_t> tokens);

  TokenScores scores() override { return {logits_, scores_in_top_ ? std::span<const TopLogit>(top_) : std::span<const TopLogit>()}; }
  DroppedTokens evaluate(int32_t token) override;
  bool has_room() const override { return cache_.has_room(); }
  Drafter* drafter() const override { return drafter_; }
  std::span<float> evaluate_draft(std::span<const int32_t> tokens) override;
  // Also sets the scores to the row of the token now last (logits() reads it as if that token
  // had been evaluated alone) when the last checking pass evaluated it and the scores are the
  // vocabulary's logits. generate() never reads them after a rollback: it has drawn the next
  // token from the rows already.
  void rollback(int n) override;
  int draft_room() const override { return cache_.draft_room(); }

  // From now on, keeps the time of every pass that evaluate() and evaluate_draft() run (passes())
  // and, with a `device` backend (not null), what each did there.
  void record_passes(const Backend* device);
  const std::vector<DecodePass>& passes() const { return passes_; }

  // Empties the cache (a new conversation); keeps what it has evaluated.
  void clear();
  // Replaces the cache with an empty one (other options), as clear() does.
  void replace_cache(KvCache cache);

  const KvCache& cache() const { return cache_; }
  // The logits after the last evaluated token (with top_k 0: what the next token is drawn from).
  std::span<const float> logits() const { return logits_; }
  // Token ids in the cache, oldest first (sinks and a prefix included):
  // tokens().size() == cache().context_size().
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Tokens evaluated and kept so far (a rejected draft's are not counted; a shift's are).
  int64_t evaluated() const { return evaluated_; }

 private:
  // Runs `tokens` through the model alone into the scores (plan, forward, passed).
  DroppedTokens forward(std::span<const int32_t> tokens);
  DecodePass begin_pass(int tokens) const;
  void end_pass(DecodePass pass, double ms);

  LlamaModel& model_;
  KvCache cache_;
  Drafter* drafter_;
  std::vector<float> logits_;
  std::vector<TopLogit> top_;      // empty: the scores are always logits_
  bool scores_in_top_ = false;     // the last pass left its scores in top_
  std::vector<float> draft_rows_;  // the last checking pass's logits, a row per token
  size_t draft_pass_ = 0;          // ... and how many of its tokens are still the cache's newest
  std::vector<int32_t> pass_tokens_;  // a checking pass's token and draft
  // The pass planned and not yet passed().
  struct PlannedPass {
    std::span<const int32_t> tokens;
    bool check = false;
    bool top = false;
    int64_t discarded_before = 0;  // the cache's discarded() when it was planned
  };
  PlannedPass planned_;
  std::vector<int32_t> tokens_;
  int64_t evaluated_ = 0;
  bool recording_ = false;
  const Backend* device_ = nullptr;
  std::vector<DecodePass> passes_;
};

}  // namespace ringlm
