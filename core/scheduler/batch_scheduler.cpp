#include "core/scheduler/batch_scheduler.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <stdexcept>

#include "core/model/llama.h"
#include "core/session/beam_search.h"
#include "core/session/sequence_model.h"

namespace ringlm {

namespace {

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}


KvCache make_slot_cache(const LlamaModel& model, const BatchOptions& o) {
  return model.make_cache(o.n_ctx, KvCacheOptions{o.cache_type, 0, 0, false});
}

// To unit length (llama-server's default for embeddings), so that a dot product is the cosine.
void l2_normalize(std::vector<float>& v) {
  double sum = 0;
  for (const float x : v) sum += static_cast<double>(x) * x;
  if (sum == 0) return;
  const double inv = 1.0 / std::sqrt(sum);
  for (float& x : v) x = static_cast<float>(x * inv);
}

}  // namespace

// One sequence being generated: its model state (cache, scores, draft rows), sampler and
// generation state.
struct BatchScheduler::Slot {
  // kBeams: a beam search's first slot, whose beams run; kBeamPlace: one of its other slots.
  enum class State { kFree, kWaitingForPrompt, kPrefill, kDecode, kBeams, kBeamPlace };

  Slot(LlamaModel& model, const BatchOptions& o) : sequence(model, make_slot_cache(model, o)) {}

  // Prompt tokens in the cache (while it prefills or reads a prompt).
  size_t prefilled() const { return sequence.tokens().size(); }

  State state = State::kFree;
  int group = 0;            // the passes it runs in (pipeline: groups take turns)
  bool in_flight = false;   // in a pass begun and not finished
  bool cancelled = false;   // cancelled while in flight: released when its pass finishes
  GenerationRequest request;
  int sample = 0;
  Slot* prompt_owner = nullptr;  // a sample waiting for the prompt that this slot prefills
  // Its decode steps keep only the most likely tokens' scores when the sampler needs only those
  // and no log-probabilities are asked for (a device then sends back those instead of the
  // vocabulary). A prompt's last pass always gives the logits (kept and shared with samples).
  SequenceModel sequence;
  std::unique_ptr<Sampler> sampler;
  std::optional<Generation> generation;  // over prompt + generated tokens
  int32_t drawn = -1;                    // sampled from the latest logits, not yet taken
  std::vector<float> raw_logits;         // the logits before the draw, when log-probabilities are wanted
  TokenLogprobs logprobs;                // of the drawn token
  int32_t next_token = -1;               // taken, to be evaluated in the next step
  std::unique_ptr<Drafter> drafter;      // speculative decoding's guesser, when there is one
  DraftLength draft_length;
  Draft draft;                           // sent with next_token in the pass in flight (empty: none)
  GenerationResult result;               // what is known before the end: index, sample, prompt size
  std::unique_ptr<BeamSequences> beams;  // a beam request's search, in its first slot
  std::vector<float> embedding;          // an embedding request's: its rows pooled so far
  Clock::time_point submitted, started, first_token;
};

BatchScheduler::BatchScheduler(LlamaModel& model, const Tokenizer& tokenizer, const BatchOptions& options)
    : model_(model),
      tokenizer_(tokenizer),
      options_(options),
      n_groups_(std::max(1, std::min(model.pipeline_depth(), options.n_parallel))) {
  if (options.n_parallel < 1) throw std::invalid_argument("--parallel must be at least 1");
  if (options.n_parallel > model.max_batch()) {
    throw std::invalid_argument("--parallel " + std::to_string(options.n_parallel) + " exceeds the batch of " +
                                std::to_string(model.max_batch()) + " tokens");
  }
  if (options.prefill_chunk < 1 || options.prefill_chunk + options.n_parallel > model.max_batch()) {
    throw std::invalid_argument("the prefill chunk must be between 1 and " +
                                std::to_string(model.max_batch() - options.n_parallel) + " tokens");
  }
  for (int i = 0; i < options.n_parallel; ++i) {
    slots_.push_back(std::make_unique<Slot>(model, options));
    slots_.back()->group = i % n_groups_;
  }
}

BatchScheduler::~BatchScheduler() {
  // Passes still in flight (a batch stopped early) finish before their slots' buffers go.
  try {
    while (!in_flight_.empty()) {
      in_flight_.pop_front();
      model_.finish_batch();
    }
  } catch (const std::exception&) {  // the pipeline broke: nothing will arrive
  }
}

void BatchScheduler::submit(GenerationRequest request) {
  check(request);
  if (!options_.share_prompt && request.n_samples > 1) {
    const int n = request.n_samples;
    for (int i = 0; i < n; ++i) {
      GenerationRequest one = request;
      one.n_samples = 1;
      one.first_sample = request.first_sample + i;
      one.sampling.seed += static_cast<uint64_t>(i);
      queue_.push_back({std::move(one), Clock::now()});
    }
    return;
  }
  queue_.push_back({std::move(request), Clock::now()});
}

void BatchScheduler::check(const GenerationRequest& request) const {
  if (request.prompt.empty()) throw std::invalid_argument("the prompt is empty");
  if (request.embeds()) return check_embedding(request);
  if (static_cast<int>(request.prompt.size()) >= options_.n_ctx) {
    throw std::invalid_argument("the prompt is " + std::to_string(request.prompt.size()) +
                                " tokens, which leaves no room in the context of " + std::to_string(options_.n_ctx) +
                                " tokens (raise -c)");
  }
  if (request.n_samples < 1 || request.n_samples > options_.n_parallel) {
    throw std::invalid_argument("n = " + std::to_string(request.n_samples) + " samples: must be between 1 and --parallel (" +
                                std::to_string(options_.n_parallel) + ")");
  }
  if (request.beams != 0) check_beams(request);
  if (request.beams != 0 && request.grammar) throw std::invalid_argument("beam search does not combine with a grammar");
  if (request.max_tokens < -1) throw std::invalid_argument("max_tokens must be -1 (no limit) or more");
}

// An embedding fills the context at most (no token follows it), one sequence, nothing sampled.
void BatchScheduler::check_embedding(const GenerationRequest& request) const {
  if (!pooling_runs(request.pooling)) {
    throw std::invalid_argument(std::string("pooling '") + pooling_name(request.pooling) +
                                "' cannot make an embedding (mean, cls or last can)");
  }
  if (static_cast<int>(request.prompt.size()) > options_.n_ctx) {
    throw std::invalid_argument("the input is " + std::to_string(request.prompt.size()) +
                                " tokens, more than the context of " + std::to_string(options_.n_ctx) +
                                " tokens (raise -c)");
  }
  if (request.n_samples != 1 || request.beams != 0 || request.grammar) {
    throw std::invalid_argument("an embedding request is one sequence, without samples, beams or a grammar");
  }
}

const std::shared_ptr<const GrammarVocabulary>& BatchScheduler::grammar_vocabulary() {
  if (!grammar_vocabulary_) grammar_vocabulary_ = std::make_shared<const GrammarVocabulary>(tokenizer_);
  return grammar_vocabulary_;
}

void BatchScheduler::check_beams(const GenerationRequest& request) const {
  if (request.beams < 1 || request.beams > options_.n_parallel) {
    throw std::invalid_argument("beams = " + std::to_string(request.beams) + ": must be between 1 and --parallel (" +
                                std::to_string(options_.n_parallel) + ")");
  }
  if (request.n_samples > request.beams) {
    throw std::invalid_argument("n = " + std::to_string(request.n_samples) + " results of " + std::to_string(request.beams) +
                                " beams: n must not exceed the beams");
  }
  if (model_.pipeline_depth() > 1) throw std::invalid_argument("beam search does not run on a pipeline of MPI ranks yet");
  if (!options_.allow_beams) throw std::invalid_argument("beam search runs on the CPU only (not with a device backend)");
  if (request.top_logprobs >= 0) throw std::invalid_argument("beam search does not give log-probabilities per token");
}

bool BatchScheduler::idle() const { return queue_.empty() && n_running() == 0 && in_flight_.empty(); }

int BatchScheduler::n_running() const {
  int n = 0;
  for (const auto& s : slots_) n += s->state != Slot::State::kFree;
  return n;
}

bool BatchScheduler::cancel(size_t index) {
  bool found = std::erase_if(queue_, [&](const Queued& q) { return q.request.index == index; }) > 0;
  for (auto& s : slots_) {
    if (s->state == Slot::State::kFree || s->request.index != index || s->cancelled) continue;
    if (s->in_flight) {
      s->cancelled = true;
    } else {
      release(*s);
    }
    found = true;
  }
  return found;
}

struct BatchScheduler::Reuse {
  PromptSegment* segment;
  int n;       // its tokens read
  bool whole;  // the prompt is the segment's, whose logits are kept: nothing to prefill
};

std::optional<BatchScheduler::Reuse> BatchScheduler::find_reuse(const GenerationRequest& request, const KvCache& cache) {
  std::optional<Reuse> best;
  const auto prompt_size = static_cast<int>(request.prompt.size());
  for (PromptSegment& seg : segments_) {
    const auto common = static_cast<int>(
        std::mismatch(seg.tokens.begin(), seg.tokens.end(), request.prompt.begin(), request.prompt.end()).first -
        seg.tokens.begin());
    const bool whole = common == prompt_size && common == static_cast<int>(seg.tokens.size());
    // Otherwise the last prompt token is evaluated here, for its logits; n samples share a
    // prompt only when it is all prefilled in one cache (share_prompt).
    const int n = whole ? common : std::min(common, prompt_size - 1);
    if (!whole && (request.slots_needed() > 1 || n < options_.min_reused_tokens)) continue;
    if (!cache.can_read_prefix(*seg.cache, n)) continue;
    if (!best || n > best->n || (n == best->n && whole)) best = Reuse{&seg, n, whole};
  }
  return best;
}

// Requests take free slots in arrival order; one with n samples waits until n slots are free
// (first come, first served: a large request is not overtaken by smaller ones behind it).
void BatchScheduler::admit(const std::function<void(GenerationResult)>& on_done) {
  while (!queue_.empty()) {
    std::vector<Slot*> free;
    for (auto& s : slots_) {
      if (s->state == Slot::State::kFree) free.push_back(s.get());
    }
    const GenerationRequest& next = queue_.front().request;
    if (static_cast<int>(free.size()) < next.slots_needed()) return;
    Queued q = std::move(queue_.front());
    queue_.pop_front();
    if (q.request.embeds()) {
      start_embedding(*free[0], q);
      continue;
    }
    const std::optional<Reuse> reuse =
        segments_.empty() ? std::nullopt : find_reuse(q.request, free[0]->sequence.cache());
    const bool beams = q.request.beams > 0;
    for (int i = 0; i < q.request.slots_needed(); ++i) {
      Slot& s = *free[static_cast<size_t>(i)];
      s.state = i == 0 ? Slot::State::kPrefill : beams ? Slot::State::kBeamPlace : Slot::State::kWaitingForPrompt;
      s.request = q.request;
      s.sample = q.request.first_sample + i;
      s.prompt_owner = i == 0 ? nullptr : free[0];
      SamplingParams params = q.request.sampling;
      params.seed += static_cast<uint64_t>(i);
      s.sampler = std::make_unique<Sampler>(params, model_.hparams().n_vocab);
      StopConditions stop;
      stop.max_tokens = q.request.max_tokens;
      stop.stop_strings = q.request.stop;
      stop.end_tokens = q.request.end_tokens;
      s.generation.emplace(tokenizer_, *s.sampler, std::move(stop), q.request.prompt);
      const bool constrained = q.request.grammar != nullptr;
      if (constrained) {
        s.generation->constrain(q.request.grammar, grammar_vocabulary(), q.request.grammar_trigger,
                                q.request.grammar_trigger_at_start);
      }
      s.drafter = options_.make_drafter && q.request.draft_max != 0 && !constrained ? options_.make_drafter(q.request) : nullptr;
      s.sequence.reset(q.request.top_logprobs >= 0 || constrained ? 0 : s.sampler->candidates_needed(), s.drafter.get());
      s.draft_length = DraftLength(options_.pass_cost);
      start_result(s, q);
      if (reuse && s.state != Slot::State::kBeamPlace) read_kept_prompt(s, *reuse, on_done);
    }
  }
}

void BatchScheduler::start_embedding(Slot& s, const Queued& q) {
  s.state = Slot::State::kPrefill;
  s.request = q.request;
  s.sample = q.request.first_sample;
  s.prompt_owner = nullptr;
  s.sequence.reset(0, nullptr);
  s.embedding.assign(static_cast<size_t>(model_.hparams().n_embd), 0.0f);
  start_result(s, q);
}

void BatchScheduler::start_result(Slot& s, const Queued& q) {
  s.draft = {};
  s.next_token = -1;
  s.result = GenerationResult{};
  s.result.index = q.request.index;
  s.result.sample = s.sample;
  s.result.prompt_tokens = static_cast<int>(q.request.prompt.size());
  s.submitted = q.submitted;
}

void BatchScheduler::finish_embedding(Slot& s, const std::function<void(GenerationResult)>& on_done) {
  const auto now = Clock::now();
  s.result.embedding = std::move(s.embedding);
  l2_normalize(s.result.embedding);
  s.result.finish_reason = "stop";
  s.result.queue_ms = ms_between(s.submitted, s.started);
  s.result.prefill_ms = ms_between(s.started, now);
  release(s);
  on_done(std::move(s.result));
}

void BatchScheduler::read_kept_prompt(Slot& s, const Reuse& reuse, const std::function<void(GenerationResult)>& on_done) {
  const std::span<const int32_t> read = std::span<const int32_t>(s.request.prompt).first(static_cast<size_t>(reuse.n));
  s.sequence.read_prefix(reuse.segment->cache, read, reuse.whole ? reuse.segment->logits : std::span<const float>());
  s.prompt_owner = nullptr;
  reuse.segment->last_used = steps_;
  reused_prompt_tokens_ += reuse.n;
  if (!reuse.whole) {
    s.state = Slot::State::kPrefill;
    return;
  }
  // The whole prompt was kept with the logits after it: the first token is drawn now.
  s.started = Clock::now();
  if (s.request.beams > 0) {
    start_beams(s, reuse.segment->cache, reuse.segment->logits, on_done);
    return;
  }
  s.state = Slot::State::kDecode;
  advance(s, on_done);
}

bool BatchScheduler::step(const std::function<void(GenerationResult)>& on_done) {
  admit(on_done);
  if (idle()) return false;
  // With a pipeline the oldest pass finishes once as many are in flight as there are stages (or
  // when no other group has work): until then the first stage goes on with the next group.
  const bool began = begin_pass();
  if (!in_flight_.empty() && (!began || in_flight_.size() >= static_cast<size_t>(n_groups_))) finish_pass(on_done);
  account_memory();
  return true;
}

bool BatchScheduler::begin_pass() {
  for (int tried = 0; tried < n_groups_; ++tried) {
    const int group = next_group_;
    next_group_ = (next_group_ + 1) % n_groups_;
    const bool busy = std::any_of(in_flight_.begin(), in_flight_.end(), [&](const Pass& p) { return p.group == group; });
    if (busy) continue;
    Pass pass = gather_pass(group);
    if (pass.batch.empty()) continue;
    model_.begin_batch(pass.batch);
    for (Slot* s : pass.slots) s->in_flight = true;
    for (Slot* s : pass.beam_owners) s->in_flight = true;
    in_flight_.push_back(std::move(pass));
    ++steps_;
    return true;
  }
  return false;
}

// The pass of a group: every decoding sequence's pending token, then the next chunks of joining
// prompts, up to prefill_chunk prompt tokens in all. A prompt's chunks are fixed (prefill_chunk
// tokens from its start), so a chunk that does not fit what is left of the pass waits for the
// next one; the first chunk of the pass always goes in.
BatchScheduler::Pass BatchScheduler::gather_pass(int group) {
  Pass pass;
  pass.group = group;
  // Drafts take what the pass has beyond one row per decoding slot and a prompt chunk.
  int n_decoding = 0;
  for (const auto& s : slots_) {
    if (s->group != group) continue;
    n_decoding += s->state == Slot::State::kDecode;
    if (s->state == Slot::State::kBeams) n_decoding += s->beams->live_beams();
  }
  size_t draft_budget = static_cast<size_t>(std::max(0, model_.max_batch() - options_.prefill_chunk - n_decoding));
  for (auto& s : slots_) {
    if (s->group != group || s->state != Slot::State::kDecode) continue;
    s->draft = propose_draft(*s, draft_budget);
    if (s->draft.tokens.empty()) {
      pass.batch.push_back(s->sequence.plan(std::span<const int32_t>(&s->next_token, 1), SequenceModel::Scores::kSampled));
    } else {
      draft_budget -= s->draft.tokens.size();
      pass.batch.push_back(s->sequence.plan_check(s->next_token, s->draft.tokens));
    }
    pass.slots.push_back(s.get());
  }
  const auto now = Clock::now();
  size_t prompt_budget = static_cast<size_t>(options_.prefill_chunk);
  if (n_groups_ > 1) prompt_budget = even_prompt_budget(group);
  for (auto& slot : slots_) {
    Slot& s = *slot;
    if (s.group != group || s.state != Slot::State::kPrefill) continue;
    const size_t prefilled = s.prefilled();
    const size_t n = std::min(static_cast<size_t>(options_.prefill_chunk), s.request.prompt.size() - prefilled);
    if (n > prompt_budget) continue;
    prompt_budget -= n;
    if (prefilled == 0) s.started = now;
    const bool last = prefilled + n == s.request.prompt.size();
    const bool embeds = s.request.embeds();  // pools its rows, draws nothing
    SequenceTokens chunk = s.sequence.plan(std::span<const int32_t>(s.request.prompt).subspan(prefilled, n),
                                           last && !embeds ? SequenceModel::Scores::kLogits : SequenceModel::Scores::kNone);
    if (embeds) {
      chunk.pooling = s.request.pooling;
      chunk.embedding = s.embedding.data();
      chunk.pooled_before = static_cast<int64_t>(prefilled);
    }
    pass.batch.push_back(chunk);
    pass.slots.push_back(&s);
  }
  // Beam searches last: their live beams' rows after every slot's.
  for (auto& s : slots_) {
    if (s->group != group || s->state != Slot::State::kBeams) continue;
    const std::span<const SequenceTokens> rows = s->beams->plan();
    pass.batch.insert(pass.batch.end(), rows.begin(), rows.end());
    pass.beam_owners.push_back(s.get());
  }
  return pass;
}

// In a pipeline, passes of unequal sizes leave a stage idle while the next finishes a larger
// one: a group's prompt tokens go in passes of equal shares, as few as prefill_chunk allows
// (85 tokens: 43 and 42, not 64 and 21), but never less than the first prompt's next chunk.
size_t BatchScheduler::even_prompt_budget(int group) const {
  const auto chunk = static_cast<size_t>(options_.prefill_chunk);
  size_t pending = 0, first_chunk = 0;
  for (const auto& s : slots_) {
    if (s->group != group || s->state != Slot::State::kPrefill) continue;
    const size_t left = s->request.prompt.size() - s->prefilled();
    if (pending == 0) first_chunk = std::min(chunk, left);
    pending += left;
  }
  const size_t passes = std::max<size_t>(1, (pending + chunk - 1) / chunk);
  return std::max((pending + passes - 1) / passes, first_chunk);
}

void BatchScheduler::finish_pass(const std::function<void(GenerationResult)>& on_done) {
  Pass pass = std::move(in_flight_.front());
  in_flight_.pop_front();
  model_.finish_batch();

  // Slots with fresh logits. A prompt's samples take a copy of its logits here, before its own
  // draw changes them.
  std::vector<Slot*> fresh;
  for (size_t i = 0; i < pass.slots.size(); ++i) {
    Slot& s = *pass.slots[i];
    s.in_flight = false;
    s.sequence.passed();
    if (s.cancelled) {
      release(s);
      continue;
    }
    if (s.state == Slot::State::kPrefill) {
      if (s.prefilled() < s.request.prompt.size()) continue;
      if (s.request.embeds()) {
        finish_embedding(s, on_done);
        continue;
      }
      if (s.request.beams > 0) {
        const bool keep = options_.prompt_cache_bytes > 0 && s.sequence.cache().prefix() == nullptr;
        std::shared_ptr<const KvCache> prompt = detach_prompt(s);
        if (keep) keep_prompt(prompt, s);
        start_beams(s, std::move(prompt), s.sequence.logits(), on_done);
        continue;
      }
      s.state = Slot::State::kDecode;
      if (s.request.n_samples > 1) {
        share_prompt(s, on_done);
      } else if (options_.prompt_cache_bytes > 0 && s.sequence.cache().prefix() == nullptr) {
        keep_prompt(detach_prompt(s), s);
      }
    }
    fresh.push_back(&s);
  }
  for (Slot* owner : pass.beam_owners) {
    owner->in_flight = false;
    if (owner->cancelled) {
      release(*owner);
    } else {
      step_beams(*owner, on_done);
    }
  }
  draw_tokens(fresh);
  for (Slot* s : fresh) {
    if (s->draft.tokens.empty()) {
      take_token(*s, on_done);
    } else {
      take_checked(*s, on_done);
    }
  }
}

Draft BatchScheduler::propose_draft(Slot& s, size_t budget) {
  const Generation& g = *s.generation;
  // Log-probabilities come with each drawn token: those sequences go a token at a time.
  if (s.drafter == nullptr || g.finished() || s.request.top_logprobs >= 0) return {};
  int limit = s.draft_length.next_limit();
  limit = std::min({limit, s.sequence.draft_room(), static_cast<int>(std::min<size_t>(budget, 1 << 20))});  // budget <= max_batch
  if (s.request.draft_max > 0) limit = std::min(limit, s.request.draft_max);
  if (g.tokens_left() >= 0) limit = std::min(limit, g.tokens_left());
  if (limit <= 0) return {};
  return s.drafter->guess(g.history(), limit);
}

bool BatchScheduler::take_checked(Slot& s, const std::function<void(GenerationResult)>& on_done) {
  const Draft draft = std::move(s.draft);
  s.draft = {};
  const auto k = static_cast<int>(draft.tokens.size());
  const size_t vocab = static_cast<size_t>(model_.hparams().n_vocab);
  const std::span<float> rows = s.sequence.checked_rows();
  ++speculation_.passes;
  speculation_.drafted += k;
  for (int j = 0;; ++j) {  // row j: the scores after pass_tokens[j]
    const std::span<float> row = rows.subspan(static_cast<size_t>(j) * vocab, vocab);
    if (j == k) {
      s.draft_length.record(k, k);
      s.drawn = s.generation->draw(row);
      return take_token(s, on_done);
    }
    const auto q = draft.q.empty() ? std::span<const Sampler::Candidate>() : draft.q[static_cast<size_t>(j)];
    const auto [next, accepted] = s.generation->check(row, draft.tokens[static_cast<size_t>(j)], q);
    s.drawn = next;
    if (!accepted) {
      s.sequence.rollback(k - j);  // draft[j..] never happened
      s.draft_length.record(k, j);
      return take_token(s, on_done);
    }
    ++speculation_.accepted;
    // Accepted: the token is in the cache already. Ending on it frees the slot, draft and all.
    if (!take_token(s, on_done)) return false;
  }
}

std::shared_ptr<const KvCache> BatchScheduler::detach_prompt(Slot& owner) {
  // The prompt's cache moves out of the owner's slot, which gets an empty one (reserved address
  // space only), and becomes read-only and shared.
  return owner.sequence.share_cache(make_slot_cache(model_, options_));
}

void BatchScheduler::keep_prompt(std::shared_ptr<const KvCache> prompt, const Slot& owner) {
  const std::span<const float> logits = owner.sequence.logits();
  segments_.push_back({owner.request.prompt, std::move(prompt), {logits.begin(), logits.end()}, steps_});
  // The least recently read go first, until the rest fits.
  size_t total = prompt_cache_bytes_in_use();
  while (total > options_.prompt_cache_bytes && !segments_.empty()) {
    const auto oldest = std::min_element(segments_.begin(), segments_.end(),
                                         [](const PromptSegment& a, const PromptSegment& b) { return a.last_used < b.last_used; });
    total -= oldest->cache->bytes_in_use();
    segments_.erase(oldest);
  }
}

size_t BatchScheduler::prompt_cache_bytes_in_use() const {
  size_t total = 0;
  for (const PromptSegment& seg : segments_) total += seg.cache->bytes_in_use();
  return total;
}

void BatchScheduler::share_prompt(Slot& owner, const std::function<void(GenerationResult)>& on_done) {
  const bool keep = options_.prompt_cache_bytes > 0 && owner.sequence.cache().prefix() == nullptr;
  std::shared_ptr<const KvCache> prompt = detach_prompt(owner);
  if (keep) keep_prompt(prompt, owner);
  for (auto& other : slots_) {
    if (other->state != Slot::State::kWaitingForPrompt || other->prompt_owner != &owner) continue;
    other->sequence.read_prefix(prompt, owner.sequence.tokens(), owner.sequence.logits());
    other->started = owner.started;
    other->state = Slot::State::kDecode;
    shared_prefill_tokens_ += static_cast<int64_t>(owner.prefilled());
    advance(*other, on_done);
  }
}

size_t BatchScheduler::kv_bytes_in_use() const {
  size_t held = 0;
  std::vector<const KvCache*> prefixes;
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kFree) continue;
    held += s->sequence.cache().bytes_in_use();
    if (s->beams) held += s->beams->kv_bytes_in_use();
    const KvCache* prefix = s->sequence.cache().prefix();
    if (prefix != nullptr && std::find(prefixes.begin(), prefixes.end(), prefix) == prefixes.end()) {
      prefixes.push_back(prefix);
      held += prefix->bytes_in_use();
    }
  }
  return held;
}

void BatchScheduler::account_memory() {
  size_t held = 0, unshared = 0;
  std::vector<const KvCache*> prefixes;
  for (const auto& s : slots_) {
    if (s->state == Slot::State::kFree) continue;
    const KvCache& c = s->sequence.cache();
    held += c.bytes_in_use();
    unshared += c.bytes_for_tokens(c.context_size());
    if (s->beams) {  // each beam its own tokens; unshared, each its own copy of the prompt too
      held += s->beams->kv_bytes_in_use();
      unshared += s->beams->kv_bytes_in_use() +
                  static_cast<size_t>(std::max(0, s->beams->live_beams() - 1)) * c.bytes_for_tokens(c.prefix_tokens());
    }
    if (c.prefix() != nullptr && std::find(prefixes.begin(), prefixes.end(), c.prefix()) == prefixes.end()) {
      prefixes.push_back(c.prefix());
      held += c.prefix()->bytes_in_use();
    }
  }
  peak_kv_bytes_ = std::max(peak_kv_bytes_, held);
  peak_kv_bytes_unshared_ = std::max(peak_kv_bytes_unshared_, unshared);
}

bool BatchScheduler::advance(Slot& s, const std::function<void(GenerationResult)>& on_done) {
  Slot* const one[] = {&s};
  draw_tokens(one);
  return take_token(s, on_done);
}

void BatchScheduler::draw_tokens(std::span<Slot* const> slots) {
  // Each slot draws with its own sampler from its own logits, so the draws are independent and
  // their order changes nothing. Sixteen argmaxes (or top-k sorts) over a 49152-token vocabulary
  // are the largest serial work of a step after the products: the threads share them.
  const auto n = static_cast<int64_t>(slots.size());
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    Slot& s = *slots[static_cast<size_t>(i)];
    if (s.generation->finished()) {
      s.drawn = -1;
      continue;
    }
    if (!s.draft.tokens.empty()) continue;  // checked row by row (take_checked)
    const TokenScores scores = s.sequence.scores();
    if (!scores.top.empty()) {
      s.drawn = s.generation->draw_top(scores.top);
      continue;
    }
    const bool wants_logprobs = s.request.top_logprobs >= 0;
    // The draw's penalties change the logits in place.
    if (wants_logprobs) s.raw_logits.assign(scores.logits.begin(), scores.logits.end());
    s.drawn = s.generation->draw(scores.logits);
    if (wants_logprobs) s.logprobs = token_logprobs(s.raw_logits, s.drawn, s.request.top_logprobs);
  }
}

bool BatchScheduler::take_token(Slot& s, const std::function<void(GenerationResult)>& on_done) {
  Generation& g = *s.generation;
  if (g.n_tokens() == 0) s.first_token = Clock::now();
  if (!g.finished()) {  // max_tokens 0 finishes before any token
    const int taken_before = g.n_tokens();
    emit(s, s.drawn, g.take(s.drawn));
    generated_tokens_ += g.n_tokens() - taken_before;
    if (!g.finished() && !s.sequence.has_room()) emit(s, -1, g.finish(FinishReason::kContextFull));
  }
  if (g.finished()) {
    finish(s, on_done);
    return false;
  }
  s.next_token = s.drawn;
  return true;
}

void BatchScheduler::emit(const Slot& s, int32_t token, const GenerationStep& step) {
  if (!on_token_) return;
  const bool took = token >= 0 && !s.generation->is_end_token(token);
  if (!took && step.text.empty()) return;
  TokenEvent e;
  e.index = s.request.index;
  e.sample = s.sample;
  e.token = took ? token : -1;
  e.text = step.text;
  e.logprobs = took && s.request.top_logprobs >= 0 ? &s.logprobs : nullptr;
  on_token_(e);
}

void BatchScheduler::finish(Slot& s, const std::function<void(GenerationResult)>& on_done) {
  const auto now = Clock::now();
  const Generation& g = *s.generation;
  s.result.text = std::string(g.text());
  s.result.n_tokens = g.n_tokens();
  s.result.finish_reason = std::string(finish_reason_name(g.finish_reason()));
  s.result.queue_ms = ms_between(s.submitted, s.started);
  s.result.prefill_ms = ms_between(s.started, s.first_token);
  s.result.decode_ms = ms_between(s.first_token, now);
  release(s);
  on_done(std::move(s.result));
}

void BatchScheduler::start_beams(Slot& owner, std::shared_ptr<const KvCache> prompt, std::span<const float> logits,
                                 const std::function<void(GenerationResult)>& on_done) {
  BeamOptions o;
  o.n_beams = owner.request.beams;
  o.length_penalty = owner.request.length_penalty;
  o.max_tokens = owner.request.max_tokens;
  for (int32_t id = 0; id < model_.hparams().n_vocab; ++id) {
    if (owner.generation->is_end_token(id)) o.end_tokens.push_back(id);
  }
  owner.beams = std::make_unique<BeamSequences>(model_, std::move(prompt), logits, options_.n_ctx,
                                                KvCacheOptions{options_.cache_type, 0, 0, false}, o);
  owner.state = Slot::State::kBeams;
  owner.first_token = Clock::now();
  if (owner.beams->done()) finish_beams(owner, on_done);
}

void BatchScheduler::step_beams(Slot& owner, const std::function<void(GenerationResult)>& on_done) {
  generated_tokens_ += owner.beams->live_beams();
  owner.beams->passed();
  if (owner.beams->done()) finish_beams(owner, on_done);
}

// Each of the best n_samples hypotheses is a result, its text cut at the first stop string.
void BatchScheduler::finish_beams(Slot& owner, const std::function<void(GenerationResult)>& on_done) {
  const auto now = Clock::now();
  const std::vector<BeamHypothesis> best = owner.beams->hypotheses();
  const GenerationRequest request = owner.request;
  GenerationResult base = owner.result;
  base.queue_ms = ms_between(owner.submitted, owner.started);
  base.prefill_ms = ms_between(owner.started, owner.first_token);
  base.decode_ms = ms_between(owner.first_token, now);
  for (auto& s : slots_) {
    if (s.get() != &owner && s->state == Slot::State::kBeamPlace && s->request.index == request.index) release(*s);
  }
  release(owner);
  for (int i = 0; i < request.n_samples; ++i) {
    // (Fewer hypotheses than results only when no token was asked for: empty texts.)
    const BeamHypothesis h = i < static_cast<int>(best.size()) ? best[static_cast<size_t>(i)] : BeamHypothesis{};
    std::span<const int32_t> tokens = h.tokens;
    if (h.ended) tokens = tokens.first(tokens.size() - 1);
    GenerationResult r = base;
    r.sample = request.first_sample + i;
    r.text = tokenizer_.decode(tokens);
    r.n_tokens = static_cast<int>(tokens.size());
    r.finish_reason = h.ended ? "stop" : "length";
    for (const std::string& stop : request.stop) {
      const size_t at = stop.empty() ? std::string::npos : r.text.find(stop);
      if (at == std::string::npos) continue;
      r.text.resize(at);
      r.finish_reason = "stop";
    }
    on_done(std::move(r));
  }
}

void BatchScheduler::release(Slot& s) {
  s.state = Slot::State::kFree;
  s.beams.reset();
  s.cancelled = false;
  s.generation.reset();
  s.sampler.reset();
  s.drafter.reset();
  s.draft = {};
  s.sequence.clear();  // its memory goes back now, and its share of a prompt segment with it
}

}  // namespace ringlm
