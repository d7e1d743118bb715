// The Llama-family decoder: embedding, then per layer RMSNorm -> grouped-query attention with
// RoPE -> residual -> RMSNorm -> SwiGLU FFN -> residual, then a final RMSNorm and the output
// projection (tied to the embedding when the file has no output.weight). Every hyperparameter
// comes from the GGUF metadata; the families that share this decoder (llama, qwen2, qwen3,
// gemma3, phi3) are entries of kSupportedArchs (hparams.cpp), each saying what it adds to the layer;
// the tensors of a layer are the schema of layer_weights.cpp.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "core/gguf/gguf.h"
#include "core/kv/kv_cache.h"
#include "core/model/hparams.h"
#include "core/model/layer_weights.h"
#include "core/model/pipeline.h"
#include "core/model/rope_tables.h"
#include "core/model/sequence_tokens.h"

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

  using SequenceTokens = ringlm::SequenceTokens;

  // Runs a sequence's tokens at positions cache.next_position().. (appending them to the cache)
  // and hands back what it asks for (SequenceTokens): its last token's logits or top tokens,
  // or every row's logits, and (or only) its rows pooled into an embedding. Long inputs are
  // processed in chunks of at most max_batch(). When the cache fills: with the cache's
  // context_shift, shift_context() and go on; without, std::length_error before anything runs.
  void forward(const SequenceTokens& sequence);
  // The logits of the last token to `logits` ([n_vocab]); with all_logits, every token's
  // ([tokens.size()][n_vocab]).
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
  // A sequence's buffers are written by the time finish_batch() returns, not before.
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
  // Activations for one chunk of up to max_batch tokens, allocated once in the backend's memory
  // (one allocation each: a device backend keeps each one's copies in step separately).
  struct Scratch {
    std::unique_ptr<ActivationBuffer> x, xn, q, k, v, attn, gate;
    // A mixture of experts: the router's logits ([tokens][n_expert]), from which the backend picks
    // each row's experts (Backend::route) for the host (routes). (The experts' weighted sum goes
    // to xn.)
    std::unique_ptr<ActivationBuffer> router_logits;
    // ... and, on a device (where the seam's default runs the experts op by op), the gathered
    // rows, hidden units and products of every route a pass can have.
    std::unique_ptr<ActivationBuffer> expert_rows, expert_hidden, expert_products, expert_up;
    std::vector<int32_t> route_experts;
    std::vector<float> route_weights;
    // [rope set][tokens][n_rot / 2]: each row's RoPE angles, per set of frequencies; computed on
    // the host (host_cos, host_sin) and written to the backend's (rope_cos, rope_sin) once per pass.
    std::vector<std::unique_ptr<ActivationBuffer>> rope_cos, rope_sin;
    std::vector<std::vector<float>> host_cos, host_sin;
    // The logits of the rows that want them, read back to the caller's buffer; grown on demand.
    std::unique_ptr<ActivationBuffer> logits;
    std::vector<float> host_rows;  // embedding rows dequantized on the host, before write()
    std::vector<float> host_normed;  // the normed hidden states of pooled rows, read back
    // The pass's sequences as the backend sees them: their caches' rings ([sequence][ring]), the
    // rings of their prefixes, and one attention call each (reused, sized before any pointer into
    // them is taken).
    std::vector<KvView> kv_views, prefix_views;
    std::vector<AttentionCall> attention_calls;
    std::vector<AttentionCall> attention_steps;  // one row of each sequence (stepwise attention)
    std::vector<float*> step_phi;                 // each checking row's maxima of this layer
  };
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
  // What a pass hands back, gathered so that the vocabulary projection is one matrix product:
  // first the last rows of the sequences that want their top k (picked in one call for all of
  // them, at the largest k: a row's top k is the start of its top k_max), then the rows of those
  // that want logits. One sequence's results land in its own buffers; several sequences' in the
  // pass's, copied out when it finishes.
  struct PendingBatch {
    int k_max = 0, n_top = 0, n_logit_rows = 0;
    std::vector<int> rows;  // the hidden-state rows to project, in that order
    std::vector<TopLogit> picks;  // [sequences wanting their top][k_max], when shared
    std::vector<float> logits;    // [rows wanting logits][n_vocab], when shared
    std::span<TopLogit> picks_to;  // where the projection's picks go: `picks` or the one top
    std::span<float> logits_to;    // ... and its logits: `logits` or the one sequence's buffer
    std::vector<std::span<TopLogit>> top_out;  // where shared results are copied when it finishes
    std::vector<float*> logits_out;
    // The sequences that pool their rows (SequenceTokens::pooling), with no vocabulary projection:
    // which rows each one's part comes from (all of them for mean, else one), that part
    // ([sequence][n_embd]: the sum of those rows after the output norm, or the one row), and how
    // it folds into the sequence's embedding when the pass finishes.
    struct PooledRows {
      int first_row = 0, n_rows = 0;
    };
    struct PoolInto {
      float* embedding = nullptr;
      Pooling pooling = Pooling::kNone;
      int64_t pooled_before = 0;  // rows of the same input already in `embedding`
      int n_rows = 0;             // the sequence's rows in this pass
    };
    std::vector<PooledRows> pooled_rows;
    std::vector<PoolInto> pool_into;
    std::vector<float> pooled;
    int wanted() const { return n_top + n_logit_rows; }
    bool hands_back() const { return wanted() > 0 || !pool_into.empty(); }
  };

  void check_stage() const;
  void read_weights(ModelTensors& tensors, WeightPlan& plan);
  void allocate_scratch();
  void check_batch(std::span<const SequenceTokens> batch) const;
  // Appends `tokens` to `cache` and returns where their rows go (rows row0..).
  static Rows append_rows(std::span<const int32_t> tokens, KvCache& cache, int row0);
  // This stage's share of one pass: the layers over every sequence's rows, then what it hands
  // back (projected on the last stage, its receipt begun on the first), for finish_pass().
  PendingBatch run_pass(std::span<const SequenceTokens> batch);
  void finish_pass(PendingBatch pass);
  // The transformer over `rows` (appended to their caches); leaves the final hidden states in
  // the scratch activations.
  void run_layers(std::span<const Rows> rows, int n_rows);
  void embed(std::span<const int32_t> tokens, float* out);
  // x += input · weightᵀ + bias (normalised by post_norm first, when the family has post-norms).
  void residual(const PreparedWeight& weight, const float* input, int n, const float* bias, const float* post_norm);
  // The feed-forward block of a layer: down(act(gate(x)) * up(x)), or a mixture of experts.
  void feed_forward(const LayerWeights& layer, int n);
  // x += the experts the router picks for each of the n rows, weighted (Backend::moe_ffn).
  void mixture_of_experts(const LayerWeights& layer, int n);
  // Index of a sequence's ring in the scratch's kv_views.
  static size_t kv_view_index(size_t sequence, KvRing ring) { return 2 * sequence + (ring == KvRing::kWindow ? 1 : 0); }
  // Fills the scratch's KV views and attention calls of the pass's sequences.
  void describe_sequences(std::span<const Rows> rows);
  // Writes the keys and values of the pass's sequence-th sequence into layer `layer` of its cache.
  void store_kv(int layer, size_t sequence, const Rows& rows);
  void attention(int layer, std::span<const Rows> rows);
  void attention_by_rows(int layer, int index, const AttentionShape& shape, std::span<const Rows> rows);
  void attention_stepwise(int layer, int index, const AttentionShape& shape, std::span<const Rows> rows);
  // Whether this pass sets the key scales (core/model/key_scales.h): the first pass that stores
  // into a cache whose keys are turned, on a backend that keeps scales; and setting layer
  // `layer`'s from the pass's n rows of queries and keys (after RoPE).
  bool calibrates_key_scales(std::span<const Rows> rows) const;
  void calibrate_key_scales(int layer, const KvCache& cache, int n);
  // A ring's key scales for its views (KvView::key_scales): none on a backend that keeps none.
  const float* ring_key_scales(KvRing ring) const;
  static size_t ring_slot(KvRing ring) { return ring == KvRing::kWindow ? 1 : 0; }
  // cos and sin of the rotation angles of n_tokens positions from pos0, for rows row0.., of a
  // sequence whose cache holds n_ctx positions, in the backend's memory.
  void rope_angles(int row0, int64_t pos0, int n_tokens, int n_ctx);
  // The output path: which rows a pass hands back and where, their projection, and their
  // results handed out.
  PendingBatch plan_output(std::span<const SequenceTokens> batch, std::span<const Rows> rows);
  void project_output(PendingBatch& pass);
  // The pooled sequences' rows through the output norm, read back, and each one's part of its
  // embedding (the rows' sum, or the one row) into pass.pooled.
  void pool_hidden_states(PendingBatch& pass);
  static void fold_pooled(const PendingBatch::PoolInto& into, const float* part, size_t n_embd);
  void check_pooling(const SequenceTokens& sequence) const;
  // Final norm + vocabulary projection of n hidden-state rows at x, into the scratch's logits
  // (activation memory), which it returns.
  const float* project_logits(const float* x, int n);
  PendingBatch take_spare_batch();

  LlamaHparams hp_;
  Backend& backend_;
  const GgufTensorInfo* token_embd_ = nullptr;
  std::vector<LayerWeights> layers_;
  std::unique_ptr<ActivationBuffer> constants_;  // every layer's norm weights and biases
  const float* output_norm_ = nullptr;
  std::unique_ptr<PreparedWeight> output_;
  bool tied_output_ = false;  // output_ is token_embd: embeddings are read through the backend
  std::unique_ptr<RopeTables> rope_;

  static constexpr int kWindowedMaxBatch = 256;  // max_batch of a model with sliding-window layers
  int max_batch_ = 512;
  PipelineStage stage_;
  std::unique_ptr<PipelineHook> pipeline_;  // connected: the protocol between the stages
  bool async_softmax_ = true;
  // The key scales every cache's views carry (KvView::key_scales), per ring ([ring's layer
  // index][kv_dim], 1 until set): set by the first pass into a turned cache, never again.
  std::vector<float> key_scales_[2];
  bool key_scales_set_ = false;
  std::unique_ptr<Scratch> scratch_;
  std::vector<Rows> batch_rows_;              // run_pass's, reused
  std::deque<PendingBatch> pending_batches_;  // begun on the first stage, oldest first
  std::vector<PendingBatch> spare_batches_;   // finished: their buffers kept for the next
  size_t weight_bytes_ = 0;
  int64_t n_params_ = 0;
};

}  // namespace ringlm
