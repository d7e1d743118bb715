// The Llama-family decoder: embedding, then per layer RMSNorm -> grouped-query attention with
// RoPE -> residual -> RMSNorm -> SwiGLU FFN -> residual, then a final RMSNorm and the output
// projection (tied to the embedding when the file has no output.weight). Every hyperparameter
// comes from the GGUF metadata; the families that share this decoder (llama, qwen2, qwen3,
// gemma3, phi3) are entries of kSupportedArchs (llama.cpp), each saying what it adds to the layer.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/gguf/gguf.h"
#include "core/kv/kv_cache.h"
#include "core/model/hparams.h"
#include "core/model/pipeline.h"

namespace ringlm {

class LlamaModel {
 public:
  // Checks every tensor's presence, type and shape, and prepares the matrices on `backend`: all
  // of them, or with a pipeline stage only its layers' (and the embedding on the first stage,
  // the output on the last), the other layers' tensors left unread in the file.
  LlamaModel(const GgufFile& gguf, Backend& backend, const PipelineStage& stage = {});
  ~LlamaModel();

  const LlamaHparams& hparams() const { return hp_; }
  size_t weight_bytes() const { return weight_bytes_; }
  int64_t n_params() const { return n_params_; }

  // Runs `tokens` at positions cache.next_position().. (appending them to the cache) and writes
  // the logits of the last token to `logits` ([n_vocab]); with all_logits, `logits` gets
  // [tokens.size()][n_vocab]. Long inputs are processed in chunks of at most max_batch().
  // When the cache fills: with the cache's context_shift, shift_context() and go on; without,
  // std::length_error before anything runs.
  void forward(std::span<const int32_t> tokens, KvCache& cache, float* logits, bool all_logits = false);
  // The same pass, leaving instead the top.size() most likely next tokens in `top` (select_top_k's
  // order, at most Sampler::kMaxCandidates): on a device they are picked there, and the
  // vocabulary's logits never cross to the host.
  void forward_top(std::span<const int32_t> tokens, KvCache& cache, std::span<TopLogit> top);
  // forward() with every row's logits ([tokens.size()][n_vocab]), each row computed exactly (bit
  // for bit) as the decode step of its token would compute it, one token at a time: what checks
  // a speculative draft, so that the tokens it accepts are those plain decoding would take.
  // (A plain pass of several rows attends with the prefill kernel, whose sums round otherwise.)
  void forward_steps(std::span<const int32_t> tokens, KvCache& cache, float* logits);

  // One sequence's share of a batched pass.
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
  };
  // Runs the tokens of several sequences in one pass (continuous batching): every matrix
  // multiplies all their rows at once, attention runs per sequence over its own cache. A row's
  // result does not depend on the other rows of the batch, so a sequence gets the same logits
  // batched or alone (given the same chunks of its own tokens). At most max_batch() tokens in
  // all, each sequence's fitting its cache without a shift (contiguous_free()), each cache used
  // once; std::invalid_argument otherwise, before anything runs.
  void forward_batch(std::span<const SequenceTokens> batch);
  // forward_batch() in two halves, so that the stages of a pipeline work at once: begin_batch()
  // runs this stage's share of the pass and returns before the later stages have given its
  // results; finish_batch() waits for the oldest pass begun and writes its results out. The first
  // stage may begin up to pipeline_depth() passes (on disjoint caches) before it finishes the
  // first: the later stages then run one pass while it runs the next. Alone, begin_batch() runs
  // the whole pass. begin_batch() returns false (and nothing is begun) when the batch is empty.
  bool begin_batch(std::span<const SequenceTokens> batch);
  void finish_batch();
  size_t batches_in_flight() const { return pending_batches_.size(); }
  int pipeline_depth() const { return stage_.count; }

  // StreamingLLM: drops cache.shift_size() tokens after the sinks and re-rotates the keys of
  // every token after them by minus that many positions, in place ("shift-RoPE": a rotation by
  // θ·p followed by one by θ·(-d) is the rotation by θ·(p - d)). Nothing is recomputed.
  void shift_context(KvCache& cache) const;

  // Decode attention with FlashDecoding++'s asynchronized softmax (one unified max per head,
  // learned from the previous step; exact fallback) or the exact online softmax (false).
  void set_async_softmax(bool on) { async_softmax_ = on; }
  bool async_softmax() const { return async_softmax_; }

  int max_batch() const { return max_batch_; }

  // Pipeline parallelism (pipeline.h). Every stage connects its link after loading; the first
  // stage then runs the model as usual and each pass runs across the stages, while every other
  // stage calls serve_pipeline(), which runs the passes the first stage announces until it calls
  // close_pipeline() (which finishes the passes still in flight first).
  const PipelineStage& stage() const { return stage_; }
  void connect_pipeline(PipelineLink& link);
  void serve_pipeline();
  void close_pipeline();
  KvCache make_cache(int n_ctx, const KvCacheOptions& options = {}) const;

 private:
  struct Layer;
  struct Scratch;
  // A sequence's rows in the pass: rows [row0, row0 + tokens.size()) of the activations.
  struct Rows {
    std::span<const int32_t> tokens;
    KvCache* cache;
    int row0;
    int64_t pos0;    // position of its first token
    int first_slot;   // slot of its first token in the cache's full ring
    int window_slot;  // ... in its window ring (the run may wrap around the ring's end)
    bool steps = false;  // each row attends as its decode step (forward_steps)
  };
  // Appends `tokens` to `cache` and returns where their rows go (rows row0..).
  static Rows append_rows(std::span<const int32_t> tokens, KvCache& cache, int row0);
  // Index of a sequence's ring in the scratch's kv_views.
  static size_t kv_view_index(size_t sequence, KvRing ring) { return 2 * sequence + (ring == KvRing::kWindow ? 1 : 0); }
  // Writes the keys and values of the pass's sequence-th sequence into layer `layer` of its cache.
  void store_kv(int layer, size_t sequence, const Rows& rows);
  // The transformer over `rows` (appended to their caches); leaves the final hidden states in
  // the scratch activations.
  void run_layers(std::span<const Rows> rows, int n_rows);
  // x += input · weightᵀ (normalised by post_norm first, when the family has post-norms).
  void residual(const PreparedWeight& weight, const float* input, int n, const float* post_norm);
  // Fills the scratch's KV views and attention calls of the pass's sequences.
  void describe_sequences(std::span<const Rows> rows);
  // Final norm + vocabulary projection of n hidden-state rows starting at `row`, into the
  // scratch's logits (activation memory), which it returns.
  const float* project_logits(int row, int n);
  // What a pass hands back: every row's logits or the last row's (logits), or the last row's
  // most likely tokens (top, when not empty), or nothing.
  struct PassOutput {
    float* logits = nullptr;
    bool all_logits = false;
    std::span<TopLogit> top;
    bool wanted() const { return logits != nullptr || !top.empty(); }
  };
  void forward_tokens(std::span<const int32_t> tokens, KvCache& cache, PassOutput out);
  void forward_chunk(std::span<const int32_t> tokens, KvCache& cache, PassOutput out);
  void embed(std::span<const int32_t> tokens, float* out);
  void attention(int layer, std::span<const Rows> rows);
  void attention_stepwise(int layer, int index, const AttentionShape& shape, std::span<const Rows> rows);
  // cos and sin of the rotation angles of n_tokens positions from pos0, for rows row0.., of a
  // sequence whose cache holds n_ctx positions.
  void rope_angles(int row0, int64_t pos0, int n_tokens, int n_ctx);
  // The inverse frequencies of a RoPE set for a cache of n_ctx positions.
  const std::vector<double>& rope_inv_freq(size_t set, int n_ctx) const;
  // Angle tables in this model's RoPE layout.
  RopeAngles rope_layout(const float* cos, const float* sin) const;

  LlamaHparams hp_;
  Backend& backend_;
  const GgufTensorInfo* token_embd_ = nullptr;
  std::vector<Layer> layers_;
  std::unique_ptr<ActivationBuffer> constants_;  // every layer's norm weights and biases
  const float* output_norm_ = nullptr;
  std::unique_ptr<PreparedWeight> output_;
  bool tied_output_ = false;  // output_ is token_embd: embeddings are read through the backend
  // [set][n_rot / 2]: position p turns rotary pair i by p * rope_inv_freq_[set][i], every scaling
  // folded in (all are linear in p). Set 0: every layer's; 1: sliding-window layers'.
  std::vector<std::vector<double>> rope_inv_freq_;
  // LongRoPE (Phi-3 128k): set 0's frequencies for caches longer than rope_n_ctx_orig, where
  // rope_inv_freq_[0] has the short factors' (as llama.cpp picks by context size). Empty: none.
  std::vector<double> rope_inv_freq_long_;

  static constexpr int kWindowedMaxBatch = 256;  // max_batch of a model with sliding-window layers
  int max_batch_ = 512;
  PipelineStage stage_;
  PipelineLink* link_ = nullptr;
  // What the first stage tells the others before each pass (POD: they cross as bytes).
  struct PipelineCommand;
  struct PipelineSequence;
  // Another stage's copies of the first stage's caches, by the first stage's KvCache::id(), kept
  // in step by running the same passes (a cache the first stage cleared starts over here too;
  // one it dropped goes here too). Shared: a copy may be another one's prefix.
  std::map<uint64_t, std::shared_ptr<KvCache>> pipeline_caches_;
  std::vector<float> pipeline_hidden_;  // hidden states on their way between stages
  static PipelineSequence describe_for_pipeline(const KvCache& cache, size_t n_tokens);
  void announce_pass(int32_t op, std::vector<PipelineSequence>& sequences);
  void announce_tokens(const KvCache& cache, size_t n_tokens, const PassOutput& out);
  void announce_batch(std::span<const SequenceTokens> batch);
  KvCache& pipeline_cache(const PipelineSequence& q);
  uint64_t copied_id(uint64_t id) const;
  bool async_softmax_ = true;
  bool stepwise_attention_ = false;  // forward_steps(): each query row as its decode step
  std::unique_ptr<Scratch> scratch_;
  std::vector<Rows> batch_rows_;       // forward_batch's, reused
  // What a pass begun on the first stage hands out when it finishes: the top k of the sequences
  // that want them, then the logits of those that want all of them, and where each goes.
  struct PendingBatch {
    int k_max = 0;
    std::vector<TopLogit> picks;  // [sequences wanting their top][k_max]
    std::vector<float> logits;    // [sequences wanting logits][n_vocab]
    std::vector<std::span<TopLogit>> top_out;
    std::vector<float*> logits_out;
  };
  std::deque<PendingBatch> pending_batches_;  // begun, oldest first
  std::vector<PendingBatch> spare_batches_;   // finished: their buffers kept for the next
  PendingBatch take_spare_batch();
  size_t weight_bytes_ = 0;
  int64_t n_params_ = 0;
};

}  // namespace ringlm
