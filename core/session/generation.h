// Generating one sequence: what every command repeats for every token, in one place.
//
// A Generation is the per-sequence state: it draws the next token over the sequence's history,
// decides whether a token ends the sequence (end-of-generation tokens, extra end tokens such as
// a chat template's end-of-turn marker, the token limit, stop strings), and turns the tokens
// it takes into text that is safe to show while streaming:
//  - only complete UTF-8 (Utf8StreamDecoder holds back a character split across tokens);
//  - never a stop string nor any part of one: the tail of the text that could still become
//    the start of a stop string is held back until it either completes one (it is cut, and
//    never shown) or cannot any more (it is released), as llama-server does.
// The pieces a sequence hands out, joined, are its final text.
//
// Drawing and taking are separate calls: the batch scheduler draws every sequence's token at
// once, in parallel, then takes them one by one. generate() is the loop for one sequence on
// its own (run, chat): draw, take, show, forward, until the sequence ends.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/grammar/token_constraint.h"
#include "core/sampling/sampler.h"
#include "core/speculative/draft_length.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

// Why a sequence ended. Each command names these in its own words (finish_reason_name() gives
// the OpenAI API's, which batch and serve use).
enum class FinishReason {
  kNone,         // still going
  kEndToken,     // an end-of-generation or extra end token (not part of the text)
  kStopString,   // a stop string appeared; the text ends before it
  kMaxTokens,    // the token limit
  kContextFull,  // the context cannot take another token (full, and it does not shift)
  kInterrupted,  // the caller asked it to stop (Ctrl-C)
};

// "stop" (an end token or a stop string), "length" (the token limit or a full context),
// "interrupted", or "" while still going.
std::string_view finish_reason_name(FinishReason reason);

struct StopConditions {
  int max_tokens = -1;                    // tokens to take at most (-1: no limit)
  bool ignore_eos = false;                // no token ends the sequence
  std::vector<int32_t> end_tokens;        // end it besides the vocabulary's end-of-generation tokens
  std::vector<std::string> stop_strings;  // the text ends before the first of these (empty ones ignored)
};

// What taking a token (or finishing) hands out: what a streaming reply sends next. (Per-token
// log-probabilities, when they are wanted, would come from draw() and travel here too.)
struct GenerationStep {
  std::string text;                          // safe to show now; may be empty
  FinishReason finish = FinishReason::kNone;  // set when the sequence ended with this step
  bool finished() const { return finish != FinishReason::kNone; }
};

class Generation {
 public:
  // `history`: the tokens before the first one generated (the prompt, or a chat's context),
  // which the sampler's repetition penalty sees; taken tokens are appended. The sampler is the
  // caller's (a chat's goes on from reply to reply) and must outlive the generation. With
  // max_tokens 0 the generation is finished from the start.
  Generation(const Tokenizer& tokenizer, Sampler& sampler, StopConditions stop, std::vector<int32_t> history);

  // Constrains the text to `grammar` (a GBNF grammar): only tokens it allows are drawn, an end
  // token only once the text is a whole sentence of it, and the sequence ends when nothing more
  // can follow. draw() then needs the whole vocabulary's logits (not draw_top()).
  //
  // With a `trigger`, the grammar is lazy (llama.cpp's lazy grammars, for tool calls the model
  // may or may not make): the text is free until it contains the trigger, then the grammar reads
  // the text from the trigger's start and holds the rest. Where it cannot read the text from an
  // occurrence of the trigger on (the model wrote its own way), it waits for the next one.
  // `trigger_at_start`: only a trigger that starts the text (after space) counts; a text that
  // starts otherwise drops the grammar.
  void constrain(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary,
                 std::string trigger = {}, bool trigger_at_start = false);
  bool constrained() const { return grammar_.has_value(); }
  // What the grammar cost: the time spent checking and masking tokens, and how many draws needed
  // the whole vocabulary masked (the token sampled first was not allowed).
  struct GrammarCost {
    double seconds = 0.0;
    int masked_draws = 0;
  };
  GrammarCost grammar_cost() const { return grammar_cost_; }

  // The next token, drawn from `logits` (modified in place) over the history. Changes nothing
  // but this generation's sampler, so separate generations may draw in parallel.
  int32_t draw(std::span<float> logits);
  // The same draw from only the most likely tokens (Sampler::sample_top).
  int32_t draw_top(std::span<const TopLogit> top);
  // Whether `token` ends the sequence instead of being taken.
  bool is_end_token(int32_t token) const;
  // Takes a drawn token (or ends on it): the text it makes safe to show and whether the
  // sequence ended. Not to be called once finished.
  GenerationStep take(int32_t token);
  // Ends the sequence for a reason of the caller's (kContextFull, kInterrupted, kMaxTokens):
  // the text still held back is released. Nothing happens once finished.
  GenerationStep finish(FinishReason reason);

  // A context shift dropped history[first, first + count) from what the model sees; the
  // repetition penalty stops seeing them too (a chat session keeps the two in step).
  void drop_history(size_t first, size_t count);

  bool finished() const { return finish_ != FinishReason::kNone; }
  FinishReason finish_reason() const { return finish_; }
  int n_tokens() const { return n_tokens_; }  // taken (end tokens are not)
  // Tokens it may still take before its token limit (-1: no limit).
  int tokens_left() const { return stop_.max_tokens < 0 ? -1 : std::max(0, stop_.max_tokens - n_tokens_); }
  // The text handed out so far: the final text once finished.
  std::string_view text() const { return std::string_view(text_).substr(0, released_); }
  std::span<const int32_t> history() const { return history_; }
  // Checks a speculative draft's token against the scores of the row before it
  // (Sampler::check_draft): the token taken next either way, and whether it was the draft's.
  Sampler::Verdict check(std::span<float> logits, int32_t drafted, std::span<const Sampler::Candidate> q) {
    return sampler_->check_draft(logits, history_, drafted, q);
  }

 private:
  // Cuts the text before the earliest complete stop string; false if there is none.
  bool cut_at_stop_string();
  // Hands out the text up to `end` (at most text_.size()).
  std::string release(size_t end);
  // draw() under a grammar: the token drawn first if the grammar allows it (most often);
  // otherwise, greedy, the most likely token it allows when one is among the kCandidatesTried
  // most likely (exactly the masked argmax), and at a temperature a draw from the first draw's
  // candidates (after top-k, top-p, min-p) that it allows, renormalised; only when none is, a
  // draw from the logits with every token it does not allow masked out, as llama.cpp resamples.
  // Each token tried costs microseconds; the whole vocabulary masked, milliseconds.
  int32_t draw_constrained(std::span<float> logits);
  // A lazy grammar whose trigger the text now holds starts reading there.
  void wake_lazy_grammar(size_t searched_from);
  void wake_lazy_grammar_at_start();
  static constexpr size_t kCandidatesTried = 64;
  // The most likely token (largest logit, lowest id among equals) of the kCandidatesTried most
  // likely that `allowed` takes; -1 if none.
  template <typename Allowed>
  int32_t most_likely_allowed(std::span<const float> logits, Allowed allowed);
  // What a draw returns when the grammar leaves no token: an end token (take() ends the text).
  int32_t an_end_token() const;

  const Tokenizer* tokenizer_;
  Sampler* sampler_;
  StopConditions stop_;
  std::vector<int32_t> history_;
  Utf8StreamDecoder utf8_;
  std::string text_;     // everything decoded: handed out, then held back
  size_t released_ = 0;  // bytes of text_ handed out
  int n_tokens_ = 0;
  FinishReason finish_ = FinishReason::kNone;
  std::optional<TokenConstraint> grammar_;
  std::string grammar_trigger_;  // a lazy grammar's, until it holds the text ("" then)
  bool trigger_at_start_ = false;
  bool grammar_stuck_ = false;  // no token could follow: the next take() ends the sequence
  std::vector<float> unmasked_;  // the logits before a penalised first draw, for a masked second one
  std::vector<Sampler::Candidate> kept_;  // the first draw's candidates the grammar allows
  std::vector<int32_t> order_;            // token ids by logit (most_likely_allowed)
  GrammarCost grammar_cost_;
};

// Where generate() finds the scores of the sequence's next token, which every evaluate
// replaces: the whole vocabulary's logits or, when `top` is not empty, only the most likely
// tokens (the sampler's candidates_needed() of them, as LlamaModel::forward_top leaves them).
struct TokenScores {
  std::span<float> logits;
  std::span<const TopLogit> top;
};

// Tokens a context shift dropped from what the model sees: the sequence's [first, first + count).
struct DroppedTokens {
  size_t first = 0;
  size_t count = 0;
};

class Drafter;

// The model side of one sequence, as generate() drives it. SequenceModel (sequence_model.h) is
// the one implementation; the tests script others.
class GenerationModel {
 public:
  virtual ~GenerationModel() = default;

  // The scores of the sequence's next token: its last evaluated token's.
  virtual TokenScores scores() = 0;
  // Runs the forward pass of `token` at the end of the sequence (scores() are then its); returns
  // what a context shift dropped to make room for it.
  virtual DroppedTokens evaluate(int32_t token) = 0;
  // Whether the context can take one more token.
  virtual bool has_room() const = 0;

  // Speculative decoding: the guesser (null: none, and the three below are never called);
  // - evaluate_draft runs `tokens` (a token and the draft after it) in one pass whose rows are
  //   exactly the decode steps of those tokens (LlamaModel::forward_steps), and returns every
  //   row's logits;
  // - rollback forgets the n newest tokens (a rejected draft's);
  // - draft_room says how many draft tokens may follow the next token in one pass
  //   (KvCache::draft_room).
  virtual Drafter* drafter() const = 0;
  virtual std::span<float> evaluate_draft(std::span<const int32_t> tokens) = 0;
  virtual void rollback(int n) = 0;
  virtual int draft_room() const = 0;
};

// What speculative decoding did: draft tokens proposed and accepted, and the passes that checked them.
struct SpeculationStats {
  int64_t drafted = 0, accepted = 0, passes = 0;
  double acceptance() const { return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0; }
};

struct GenerateOptions {
  // Each piece of text as soon as it is safe to show (never empty).
  std::function<void(std::string_view)> on_text;
  // When it becomes true (a signal handler may set it), the sequence ends after the token being
  // generated. May be null.
  const std::atomic<bool>* interrupt = nullptr;
  // Every token taken is evaluated, the last one too, and a token the context has no room for
  // is not taken: the cache then holds exactly the text shown, and a chat continues from it.
  // Otherwise the last token is not evaluated (nothing reads its logits), and a token that
  // does not fit is still shown before the sequence ends.
  bool evaluate_every_token = false;
  // The tokens a context shift drops leave the history too, so that the repetition penalty sees
  // what the model sees (a chat); otherwise it sees every token of the sequence.
  bool forget_dropped_history = false;
  // Where speculative decoding (with the model's drafter()) counts its drafts. May be null.
  SpeculationStats* speculation = nullptr;
  // What a checking pass costs, which sets the drafts' lengths (DraftLength).
  PassCost pass_cost;
};

// Generates until the sequence ends, from the model's scores: at first those of the sequence's
// last evaluated token (a prefilled prompt). Returns why it ended.
//
// With a guesser, each evaluated token goes with a draft of the tokens guessed to follow it,
// all checked in one pass: the draft's tokens are taken for as long as the row before each
// accepts it (Sampler::check_draft: when greedy, when it is the most likely token; at a
// temperature, by the speculative sampling rule), the first rejected one is replaced by the
// token the check drew, and the rest are rolled back out of the cache. Each row is what the
// decode step of its token computes, bit for bit, so greedy text is exactly plain decoding's,
// and sampled text follows the model's own distribution, only in fewer passes.
FinishReason generate(Generation& generation, GenerationModel& model, const GenerateOptions& options);

}  // namespace ringlm
