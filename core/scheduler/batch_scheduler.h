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
//
// With a prompt cache (BatchOptions::prompt_cache_bytes, what a server wants), prefilled prompts
// stay as read-only segments, the least recently used dropped past that size: a request whose
// prompt begins with the same tokens as a kept one reads that beginning from it and prefills only
// the rest (the same prompt again: nothing, its logits are kept too).
//
// On a pipeline of several stages (LlamaModel::pipeline_depth()), the slots form as many groups,
// which take turns: the first stage begins one group's pass while the later stages still run the
// previous groups' (micro-batches in flight), so that every stage works. Each group's pass is
// what the step would be for its slots alone, so the results do not change.
//
// A request for beam search (GenerationRequest::beams) holds `beams` slots: its first prefills
// the prompt, which becomes the segment every beam reads (BeamSequences), and its live beams'
// tokens join each step's pass as rows of their own; the others only hold the places. It takes
// no token listener events (a beam's text is known only at the end) and hands back its best
// hypotheses as its samples.
//
// A request for an embedding (GenerationRequest::pooling) holds one slot while its prompt is
// prefilled in the same chunks as any other, its rows pooled pass by pass, beside every other
// slot's rows; then it hands back the L2-normalised vector and frees the slot. It draws no token,
// reads no kept prompt (the rows it pools must all be computed) and keeps none.
//
// Callers that stream (a server) listen to every token taken (set_token_listener) and may
// cancel a request between steps (cancel).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/kv/kv_cache.h"
#include "core/model/llama.h"
#include "core/sampling/sampler.h"
#include "core/session/generation.h"
#include "core/speculative/draft_length.h"
#include "core/grammar/token_constraint.h"
#include "core/speculative/drafter.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

struct GenerationRequest {
  size_t index = 0;               // the caller's handle, echoed in the results
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 256;           // -1: until the end of generation or the context
  std::vector<std::string> stop;  // the text ends before the first of these it contains
  int n_samples = 1;
  int first_sample = 0;           // the sample index of the first of these samples
  int top_logprobs = -1;          // >= 0: each token's log-probability and this many alternatives
  std::vector<int32_t> end_tokens;  // end the text besides the vocabulary's end-of-generation tokens
  int draft_max = -1;  // speculative decoding: drafts of at most this many tokens (-1: the guesser's; 0: none)
  // Beam search of this many beams instead of sampling (0: off): the request holds as many slots,
  // and its n_samples results are the best hypotheses, best first (sample 0 the best).
  int beams = 0;
  float length_penalty = 1.0f;  // a hypothesis scores log-probability / length^this
  // The text is held to this grammar (null: none); such a sequence draws from the whole
  // vocabulary's logits and without a guesser's drafts.
  std::shared_ptr<const Grammar> grammar;
  // With it, the grammar is lazy: the text is free until it holds this (a tool call's marker).
  std::string grammar_trigger;
  bool grammar_trigger_at_start = false;  // ... and only at the text's start (Generation::constrain)
  // Embeds the prompt instead of generating from it (kNone: generates): its final hidden states
  // pooled this way (mean, cls or last) and L2-normalised, in the result's `embedding`.
  Pooling pooling = Pooling::kNone;
  bool embeds() const { return pooling != Pooling::kNone; }
  int slots_needed() const { return std::max(n_samples, beams); }
};

// A token a sequence took (or its end), as a streaming caller sees it.
struct TokenEvent {
  size_t index = 0;
  int sample = 0;
  int32_t token = -1;                     // -1: no token (the end released the text held back)
  std::string_view text;                  // the text safe to show now, maybe empty
  const TokenLogprobs* logprobs = nullptr;  // when the request asked for them
};

struct GenerationResult {
  size_t index = 0;
  int sample = 0;
  std::string text;
  int n_tokens = 0;               // generated
  int prompt_tokens = 0;
  std::string finish_reason;      // "stop" (end of generation or a stop string), "length" (max_tokens or context)
  std::vector<float> embedding;   // an embedding request's: n_embd floats of unit length
  double queue_ms = 0;            // submitted -> first prompt chunk
  double prefill_ms = 0;          // first prompt chunk -> first token
  double decode_ms = 0;           // first token -> finished
};

struct BatchOptions {
  int n_parallel = 4;
  int n_ctx = 2048;        // per sequence: prompt + generated tokens
  int prefill_chunk = 64;  // prompt tokens per chunk, and per step
  KvTypes cache_type = KvType::kF16;
  // false: n samples are n independent sequences, each prefilling and holding the prompt (the
  // baseline that the segment cache is measured against).
  bool share_prompt = true;
  // KV memory of prefilled prompts kept for reuse by later requests (0: none kept).
  size_t prompt_cache_bytes = 0;
  int min_reused_tokens = 16;  // a kept prompt is read when at least this many tokens match
  // Speculative decoding: each sequence's guesser, made when it starts (null, or returning null:
  // none). A sequence's draft goes into the next pass with its token, and the rows it accepts are
  // decode steps saved (generate()'s rule, per sequence).
  std::function<std::unique_ptr<Drafter>(const GenerationRequest&)> make_drafter;
  // What a checking pass of one sequence costs, which sets its drafts' lengths (DraftLength).
  PassCost pass_cost;
  // false: requests for beam search are refused (a device backend keeps the caches' rows, and a
  // beam's fork copies them on the host).
  bool allow_beams = true;
};

class BatchScheduler {
 public:
  BatchScheduler(LlamaModel& model, const Tokenizer& tokenizer, const BatchOptions& options);
  ~BatchScheduler();

  // Queues a request. std::invalid_argument when it can never run (an empty prompt, a prompt
  // that leaves no room in the context, more samples than parallel slots).
  void submit(GenerationRequest request);
  // submit()'s checks alone (reads only the options: callable from any thread).
  void check(const GenerationRequest& request) const;
  void check_beams(const GenerationRequest& request) const;
  // Runs one step (one forward pass) and hands every sequence that finished in it to
  // `on_done`. Returns false when nothing is queued or running.
  bool step(const std::function<void(GenerationResult)>& on_done);
  // Called for every token a sequence takes and for the end of each, during step().
  void set_token_listener(std::function<void(const TokenEvent&)> listener) { on_token_ = std::move(listener); }
  // Drops request `index` (its queued entry, or its running samples, whose slots are free for the
  // next step), without a result. Not to be called from inside step(). Returns whether it was there.
  bool cancel(size_t index);

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
  // KV memory the running sequences hold now (their prefixes counted once), and the prompt cache's.
  size_t kv_bytes_in_use() const;
  size_t prompt_cache_bytes_in_use() const;
  size_t prompt_cache_entries() const { return segments_.size(); }
  // Prompt tokens read from the prompt cache instead of prefilled.
  int64_t reused_prompt_tokens() const { return reused_prompt_tokens_; }
  // Speculative decoding's drafts, over every sequence.
  const SpeculationStats& speculation() const { return speculation_; }

 private:
  struct Slot;
  using Clock = std::chrono::steady_clock;

  struct Queued {
    GenerationRequest request;
    Clock::time_point submitted;
  };

  struct Pass {
    int group = 0;
    std::vector<LlamaModel::SequenceTokens> batch;
    std::vector<Slot*> slots;  // batch[i] is slots[i]'s
    std::vector<Slot*> beam_owners;  // and the rows after those are these beam searches' live beams
  };
  // Begins the pass of the next group that has work and is not in flight; false when none has.
  bool begin_pass();
  Pass gather_pass(int group);
  size_t even_prompt_budget(int group) const;
  // Finishes the oldest pass in flight: its slots take their tokens.
  void finish_pass(const std::function<void(GenerationResult)>& on_done);
  void admit(const std::function<void(GenerationResult)>& on_done);
  void check_embedding(const GenerationRequest& request) const;
  // The slot takes an embedding request: its prompt is prefilled and pooled, nothing is drawn.
  void start_embedding(Slot& slot, const Queued& queued);
  // A slot's result and step state, fresh for the request it starts.
  void start_result(Slot& slot, const Queued& queued);
  // Its prompt has run: the vector, normalised, to on_done; the slot is free.
  void finish_embedding(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // Hands the result of the slot's finished generation to on_done and frees the slot.
  void finish(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // Frees the slot (finished or cancelled): its sequence state and KV memory go.
  static void release(Slot& slot);
  // Samples the next token of a slot whose logits are fresh; false once it has finished.
  bool advance(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // advance() split in two: draw_tokens samples every slot's token at once, in parallel;
  // take_token then ends the slot or queues its drawn token, one slot at a time.
  static void draw_tokens(std::span<Slot* const> slots);
  bool take_token(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // The draft a decoding slot sends with its token, within `budget` tokens (empty: none).
  Draft propose_draft(Slot& slot, size_t budget);
  // Checks the slot's draft against its pass's rows (generate()'s rule): takes the accepted tokens
  // and the one after, and rolls the rejected ones back. False once the slot has finished.
  bool take_checked(Slot& slot, const std::function<void(GenerationResult)>& on_done);
  // The prompt that `owner` prefilled becomes the shared prefix of every one of its samples (and
  // is kept in the prompt cache, when there is one).
  void share_prompt(Slot& owner, const std::function<void(GenerationResult)>& on_done);
  // The owner's prompt, moved out of its cache into a read-only segment that its cache reads.
  std::shared_ptr<const KvCache> detach_prompt(Slot& owner);
  // The kept prompt whose beginning this request's prompt shares the most of (what it can read:
  // one token short of the whole prompt, unless the kept logits follow the whole of it).
  struct Reuse;
  std::optional<Reuse> find_reuse(const GenerationRequest& request, const KvCache& cache);
  void keep_prompt(std::shared_ptr<const KvCache> prompt, const Slot& owner);
  // The slot reads the kept prompt (and starts decoding when it was the whole prompt).
  void read_kept_prompt(Slot& slot, const Reuse& reuse, const std::function<void(GenerationResult)>& on_done);
  void emit(const Slot& slot, int32_t token, const GenerationStep& step);
  // A beam request's prompt is in `prompt` with `logits` after it: its beams start.
  void start_beams(Slot& owner, std::shared_ptr<const KvCache> prompt, std::span<const float> logits,
                   const std::function<void(GenerationResult)>& on_done);
  // The beam search's pass has run: it steps, and hands back its best hypotheses when done.
  void step_beams(Slot& owner, const std::function<void(GenerationResult)>& on_done);
  void finish_beams(Slot& owner, const std::function<void(GenerationResult)>& on_done);
  void account_memory();

  LlamaModel& model_;
  const Tokenizer& tokenizer_;
  // Every token's text for grammars, decoded when the first request with a grammar starts.
  std::shared_ptr<const GrammarVocabulary> grammar_vocabulary_;
  const std::shared_ptr<const GrammarVocabulary>& grammar_vocabulary();
  BatchOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  int n_groups_ = 1;  // passes in flight at most (the pipeline's stages)
  int next_group_ = 0;
  std::deque<Pass> in_flight_;
  std::deque<Queued> queue_;
  std::function<void(const TokenEvent&)> on_token_;
  // The prompt cache: prefilled prompts, their tokens and the logits after them.
  struct PromptSegment {
    std::vector<int32_t> tokens;
    std::shared_ptr<const KvCache> cache;
    std::vector<float> logits;
    int64_t last_used = 0;  // steps_ when last read
  };
  std::vector<PromptSegment> segments_;
  int64_t reused_prompt_tokens_ = 0;
  SpeculationStats speculation_;
  int64_t generated_tokens_ = 0;
  int64_t steps_ = 0;
  int64_t shared_prefill_tokens_ = 0;
  size_t peak_kv_bytes_ = 0, peak_kv_bytes_unshared_ = 0;
};

}  // namespace ringlm
