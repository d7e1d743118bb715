// Continuous batching (iteration-level scheduling, as in Orca): up to n_parallel sequences
// advance together, one forward pass per step with a row for every decoding sequence plus
// chunks of joining prompts, at most prefill_chunk prompt tokens per step (several short
// prompts join in one step; a long one is spread over several). A sequence that finishes leaves
// at once and a waiting request takes its slot in the same step.
//
// Every prompt is prefilled in the same fixed chunks (prefill_chunk tokens from its start)
// whatever else runs, and a row's result does not depend on the other rows of a pass
// (LlamaModel::forward_batch), so greedy outputs do not depend on n_parallel.
//
// n > 1 samples of one request share its prompt (the segment KV cache): the prompt is evaluated
// once into a cache of its own, which every sample reads as the prefix of its cache
// (KvCache::attach_prefix) while holding only its own response; each sample has its own sampler
// (seed + sample index). The prompt's memory is freed when its last sample finishes.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/kv/kv_cache.h"
#include "core/sampling/sampler.h"
#include "core/session/generation.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

class LlamaModel;

struct GenerationRequest {
  size_t index = 0;               // the caller's handle, echoed in the results
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 256;
  std::vector<std::string> stop;  // the text ends before the first of these it contains
  int n_samples = 1;
  int first_sample = 0;           // the sample index of the first of these samples
};

struct GenerationResult {
  size_t index = 0;
  int sample = 0;
  std::string text;
  int n_tokens = 0;               // generated
  int prompt_tokens = 0;
  std::string finish_reason;      // "stop" (end of generation or a stop string), "length" (max_tokens or context)
  double queue_ms = 0;            // submitted -> first prompt chunk
  double prefill_ms = 0;          // first prompt chunk -> first token
  double decode_ms = 0;           // first token -> finished
};

struct BatchOptions {
  int n_parallel = 4;
  int n_ctx = 2048;        // per sequence: prompt + generated tokens
  int prefill_chunk = 64;  // prompt tokens per chunk, and per step
  KvType cache_type = KvType::kF16;
  // false: n samples are n independent sequences, each prefilling and holding the prompt (the
  // baseline that the segment cache is measured against).
  bool share_prompt = true;
};

class BatchScheduler {
 public:
  BatchScheduler(LlamaModel& model, const Tokenizer& tokenizer, const BatchOptions& options);
  ~BatchScheduler();

  // Queues a request. std::invalid_argument when it can never run (an empty prompt, a prompt
  // that leaves no room in the context, more samples than parallel slots).
  void submit(GenerationRequest request);
  // Runs one step (one forward pass) and hands every sequence that finished in it to
  // `on_done`. Returns false when nothing is queued or running.
  bool step(const std::function<void(GenerationResult)>& on_done);

  bool idle() const;
  int n_running() const;
  size_t n_queued() const { return queue_.size(); }
  int64_t generated_tokens() const { return generated_tokens_; }
  int64_t steps() const { return steps_; }
  // Prompt tokens not prefilled again thanks to sharing: (n - 1) x prompt for n samples.
  int64_t shared_prefill_tokens() const { return shared_prefill_tokens_; }
  // The most KV cache memory the running sequences held at once (after a step), and what the
  // same sequences would have held with a whole copy of the prompt each.
  size_t peak_kv_bytes() const { return peak_kv_bytes_; }
  size_t peak_kv_bytes_unshared() const { return peak_kv_bytes_unshared_; }

 private:
  struct Slot;
  using Clock = std::chrono::steady_clock;

  struct Queued {
    GenerationRequest request;
    Clock::time_point submitted;
  };

  void admit();
  // Hands the result of the slot's finished generation to on_done and frees the slot.
  void finish(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // Samples the next token of a slot whose logits are fresh; false once it has finished.
  bool advance(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // advance() split in two: draw_tokens samples every slot's token at once, in parallel;
  // take_token then ends the slot or queues its drawn token, one slot at a time.
  static void draw_tokens(std::span<Slot* const> slots);
  bool take_token(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // The prompt that `owner` prefilled becomes the shared prefix of every one of its samples.
  void share_prompt(Slot& owner, const std::function<void(GenerationResult)>& on_done);
  void account_memory();

  LlamaModel& model_;
  const Tokenizer& tokenizer_;
  BatchOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::deque<Queued> queue_;
  int64_t generated_tokens_ = 0;
  int64_t steps_ = 0;
  int64_t shared_prefill_tokens_ = 0;
  size_t peak_kv_bytes_ = 0, peak_kv_bytes_unshared_ = 0;
};

}  // namespace ringlm
