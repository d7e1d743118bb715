#include "core/session/generation.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "core/speculative/draft_length.h"
#include "core/speculative/drafter.h"

namespace ringlm {

namespace {

// The length of the longest end of `text` that is the beginning of a stop string (shorter than
// it: a whole one is cut before this is asked). That much text must wait for the next token.
size_t stop_string_prefix_at_end(std::string_view text, const std::vector<std::string>& stops) {
  size_t longest = 0;
  for (const std::string& s : stops) {
    for (size_t n = std::min(s.size() - 1, text.size()); n > longest; --n) {
      if (text.ends_with(std::string_view(s).substr(0, n))) {
        longest = n;
        break;
      }
    }
  }
  return longest;
}

bool is_utf8_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

std::string_view finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "";
    case FinishReason::kEndToken:
    case FinishReason::kStopString: return "stop";
    case FinishReason::kMaxTokens:
    case FinishReason::kContextFull: return "length";
    case FinishReason::kInterrupted: return "interrupted";
  }
  return "";
}

Generation::Generation(const Tokenizer& tokenizer, Sampler& sampler, StopConditions stop, std::vector<int32_t> history)
    : tokenizer_(&tokenizer), sampler_(&sampler), stop_(std::move(stop)), history_(std::move(history)) {
  std::erase_if(stop_.stop_strings, [](const std::string& s) { return s.empty(); });
  if (stop_.max_tokens == 0) finish_ = FinishReason::kMaxTokens;
}

void Generation::constrain(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const GrammarVocabulary> vocabulary,
                           std::string trigger, bool trigger_at_start) {
  grammar_.emplace(std::move(grammar), std::move(vocabulary));
  grammar_trigger_ = std::move(trigger);
  trigger_at_start_ = trigger_at_start;
}

void Generation::wake_lazy_grammar_at_start() {
  const size_t start = text_.find_first_not_of(" \t\r\n");
  if (start == std::string::npos) return;  // only space so far
  const std::string_view head = std::string_view(text_).substr(start);
  const size_t n = std::min(head.size(), grammar_trigger_.size());
  if (head.compare(0, n, grammar_trigger_, 0, n) == 0 && head.size() < grammar_trigger_.size()) return;  // may still be
  const bool held = head.compare(0, n, grammar_trigger_, 0, n) == 0 && grammar_->take_text(head);
  grammar_trigger_.clear();
  if (!held) grammar_.reset();  // the text starts otherwise: free to its end
}

void Generation::wake_lazy_grammar(size_t searched_from) {
  // The trigger may end in this token's text and begin in an earlier one's. Where the grammar
  // cannot read the text from an occurrence on (a model quoting the marker, "<tool_call></tool_call>"),
  // it waits for the next one.
  size_t at = searched_from >= grammar_trigger_.size() ? searched_from - grammar_trigger_.size() + 1 : 0;
  while ((at = text_.find(grammar_trigger_, at)) != std::string::npos) {
    if (grammar_->take_text(std::string_view(text_).substr(at))) {
      grammar_trigger_.clear();
      return;
    }
    ++at;
  }
}

int32_t Generation::draw(std::span<float> logits) {
  if (!grammar_ || !grammar_trigger_.empty()) return sampler_->sample(logits, history_);
  try {
    return draw_constrained(logits);
  } catch (const GrammarError&) {  // (more parses at once than the matcher follows: the text ends here)
    grammar_stuck_ = true;
    return an_end_token();
  }
}

int32_t Generation::draw_top(std::span<const TopLogit> top) {
  if (grammar_) throw std::logic_error("Generation::draw_top: a grammar needs the whole vocabulary's logits");
  return sampler_->sample_top(top);
}

int32_t Generation::draw_constrained(std::span<float> logits) {
  // The penalties change the logits in place: a masked draw starts again from them as they were.
  const SamplingParams& p = sampler_->params();
  const bool penalised = p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
  if (penalised) unmasked_.assign(logits.begin(), logits.end());
  const bool greedy = sampler_->params().temperature <= 0.0f;
  std::span<const Sampler::Candidate> drawn_from;
  int32_t first = 0;
  if (greedy) {
    first = sampler_->sample(logits, history_);  // (the penalties applied to `logits`)
  } else {
    drawn_from = sampler_->distribution(logits, history_);
    first = sampler_->draw_from(drawn_from);
  }
  const auto start = std::chrono::steady_clock::now();
  const auto count_time = [&] {
    grammar_cost_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const auto allowed = [&](int32_t t) { return grammar_->allows(t, is_end_token(t)); };
  if (allowed(first)) {
    count_time();
    return first;
  }
  if (greedy) {  // the masked argmax: the most likely token the grammar allows, if one is near the top
    const int32_t best = most_likely_allowed(logits, allowed);
    count_time();
    if (best >= 0) return best;
  } else if (drawn_from.size() <= kCandidatesTried) {  // the draw's own candidates the grammar allows
    kept_.clear();
    double total = 0.0;
    for (const Sampler::Candidate& c : drawn_from) {
      if (allowed(c.id)) kept_.push_back(c), total += c.p;
    }
    count_time();
    if (total > 0.0) {
      for (Sampler::Candidate& c : kept_) c.p = static_cast<float>(c.p / total);
      return sampler_->draw_from(kept_);
    }
  }
  ++grammar_cost_.masked_draws;
  const auto mask_start = std::chrono::steady_clock::now();
  if (penalised) std::copy(unmasked_.begin(), unmasked_.end(), logits.begin());
  const size_t n_allowed = grammar_->mask(logits, [&](int32_t t) { return is_end_token(t); });
  grammar_cost_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - mask_start).count();
  if (n_allowed == 0) {  // (the grammar wants a character no token has)
    grammar_stuck_ = true;
    return an_end_token();
  }
  return sampler_->sample(logits, history_);
}

template <typename Allowed>
int32_t Generation::most_likely_allowed(std::span<const float> logits, Allowed allowed) {
  order_.resize(logits.size());
  std::iota(order_.begin(), order_.end(), 0);
  const auto n = std::min<std::ptrdiff_t>(kCandidatesTried, static_cast<std::ptrdiff_t>(order_.size()));
  std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), [&](int32_t a, int32_t b) {
    return Sampler::ranks_before({a, logits[static_cast<size_t>(a)], 0.0f}, {b, logits[static_cast<size_t>(b)], 0.0f});
  });
  for (std::ptrdiff_t i = 0; i < n; ++i) {
    if (allowed(order_[static_cast<size_t>(i)])) return order_[static_cast<size_t>(i)];
  }
  return -1;
}

int32_t Generation::an_end_token() const {
  if (tokenizer_->eos_id() >= 0) return tokenizer_->eos_id();
  return stop_.end_tokens.empty() ? 0 : stop_.end_tokens.front();
}

bool Generation::is_end_token(int32_t token) const {
  if (stop_.ignore_eos) return false;
  return tokenizer_->is_end_of_generation(token) ||
         std::find(stop_.end_tokens.begin(), stop_.end_tokens.end(), token) != stop_.end_tokens.end();
}

GenerationStep Generation::take(int32_t token) {
  if (is_end_token(token) || grammar_stuck_) return finish(FinishReason::kEndToken);
  const bool lazy = grammar_ && !grammar_trigger_.empty();
  if (grammar_ && !lazy) {
    const auto start = std::chrono::steady_clock::now();
    grammar_->take(token);
    grammar_cost_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  history_.push_back(token);
  ++n_tokens_;
  const size_t text_before = text_.size();
  text_ += utf8_.push(tokenizer_->token_to_piece(token));
  if (lazy) trigger_at_start_ ? wake_lazy_grammar_at_start() : wake_lazy_grammar(text_before);
  if (cut_at_stop_string()) {
    // What the decoder still holds comes after the stop string: it is dropped with the rest.
    finish_ = FinishReason::kStopString;
    return {release(text_.size()), finish_};
  }
  if (stop_.max_tokens >= 0 && n_tokens_ >= stop_.max_tokens) return finish(FinishReason::kMaxTokens);
  if (grammar_ && grammar_->finished()) return finish(FinishReason::kEndToken);  // nothing more can follow
  const std::string_view unreleased = std::string_view(text_).substr(released_);
  return {release(text_.size() - stop_string_prefix_at_end(unreleased, stop_.stop_strings)), FinishReason::kNone};
}

GenerationStep Generation::finish(FinishReason reason) {
  if (finished()) return {};
  text_ += utf8_.flush();
  finish_ = reason;
  return {release(text_.size()), reason};
}

bool Generation::cut_at_stop_string() {
  // Text before released_ cannot hold the start of a stop string (it would have been held
  // back), so the search starts there: each token costs its own text, not the whole text's.
  size_t at = std::string::npos;
  for (const std::string& s : stop_.stop_strings) at = std::min(at, text_.find(s, released_));
  if (at == std::string::npos) return false;
  text_.resize(at);
  return true;
}

std::string Generation::release(size_t end) {
  // Never split a character: a stop string that is not valid UTF-8 could end inside one.
  while (end > released_ && end < text_.size() && is_utf8_continuation(text_[end])) --end;
  std::string piece = text_.substr(released_, end - released_);
  released_ = end;
  return piece;
}

void Generation::drop_history(size_t first, size_t count) {
  first = std::min(first, history_.size());
  count = std::min(count, history_.size() - first);
  const auto begin = history_.begin() + static_cast<std::ptrdiff_t>(first);
  history_.erase(begin, begin + static_cast<std::ptrdiff_t>(count));
}

namespace {

// One sequence's loop, plain or speculative.
class GenerationLoop {
 public:
  GenerationLoop(Generation& g, GenerationModel& model, const GenerateOptions& options)
      : g_(g), model_(model), options_(options), draft_length_(options.pass_cost) {}

  FinishReason run() {
    int32_t token = draw(model_.scores());
    while (!g_.finished()) {
      // Takes the token; false when the sequence ended without anything left to evaluate.
      if (!take(token)) break;
      const Draft draft = guess();
      if (draft.tokens.empty()) {
        evaluate(token);
        if (g_.finished() || interrupted()) break;
        token = draw(model_.scores());
      } else {
        token = check_draft(token, draft);
        if (token < 0 || interrupted()) break;
      }
    }
    return g_.finish_reason();
  }

 private:
  int32_t draw(TokenScores scores) { return scores.top.empty() ? g_.draw(scores.logits) : g_.draw_top(scores.top); }

  void evaluate(int32_t token) {
    const DroppedTokens dropped = model_.evaluate(token);
    if (options_.forget_dropped_history) g_.drop_history(dropped.first, dropped.count);
  }

  void show(const GenerationStep& step) {
    if (!step.text.empty() && options_.on_text) options_.on_text(step.text);
  }

  // Takes `token` (or ends on it). True when it is to be evaluated next: a text token, and the
  // sequence goes on (or ended, but the cache is to hold every token shown).
  bool take(int32_t token) {
    const bool keep_cache_in_step = options_.evaluate_every_token;
    if (keep_cache_in_step && !g_.is_end_token(token) && !model_.has_room()) {
      show(g_.finish(FinishReason::kContextFull));
      return false;
    }
    const int taken_before = g_.n_tokens();
    show(g_.take(token));
    if (g_.n_tokens() == taken_before) return false;  // an end token: nothing to evaluate
    if (g_.finished() && !keep_cache_in_step) return false;
    if (!g_.finished() && !model_.has_room()) {
      show(g_.finish(FinishReason::kContextFull));
      return false;
    }
    return true;
  }

  bool interrupted() {
    if (g_.finished() || options_.interrupt == nullptr || !options_.interrupt->load()) return false;
    show(g_.finish(FinishReason::kInterrupted));
    return true;
  }

  // The draft to check with the token just taken: none without a guesser, when the sequence has
  // ended (the last token is evaluated alone), or when the cache has no room for one.
  Draft guess() {
    Drafter* drafter = model_.drafter();
    if (drafter == nullptr || g_.finished()) return {};
    int limit = std::min(draft_length_.next_limit(), model_.draft_room());
    if (g_.tokens_left() >= 0) limit = std::min(limit, g_.tokens_left());  // no guess past the token limit
    if (limit <= 0) return {};
    return drafter->guess(g_.history(), limit);
  }

  // Evaluates `token` and `draft` in one pass and takes the draft's tokens while the row before
  // each accepts it. Returns the next token to take (the replacement of the first rejected one,
  // or drawn from the row after the last, not yet evaluated), or -1 when the sequence ended on
  // an accepted token.
  int32_t check_draft(int32_t token, const Draft& draft) {
    const auto k = static_cast<int>(draft.tokens.size());
    std::vector<int32_t> pass(1, token);
    pass.insert(pass.end(), draft.tokens.begin(), draft.tokens.end());
    const std::span<float> rows = model_.evaluate_draft(pass);
    const size_t vocab = rows.size() / pass.size();
    SpeculationStats* stats = options_.speculation;
    if (stats != nullptr) {
      stats->drafted += k;
      ++stats->passes;
    }
    for (int j = 0;; ++j) {  // row j: the scores after pass[j]
      const std::span<float> row = rows.subspan(static_cast<size_t>(j) * vocab, vocab);
      if (j == k) {
        draft_length_.record(k, k);
        return g_.draw(row);
      }
      const auto q = draft.q.empty() ? std::span<const Sampler::Candidate>() : draft.q[static_cast<size_t>(j)];
      const auto [next, accepted] = g_.check(row, draft.tokens[static_cast<size_t>(j)], q);
      if (!accepted) {
        model_.rollback(k - j);  // draft[j..] never happened
        draft_length_.record(k, j);
        return next;
      }
      if (stats != nullptr) ++stats->accepted;
      // Accepted: the token is in the cache already. If it ends the sequence, what follows it goes.
      if (!take(next)) {
        const bool evaluated = !g_.is_end_token(next);
        model_.rollback(k - j - (evaluated ? 1 : 0));
        return -1;
      }
      if (g_.finished()) {  // ended on a text token that the cache keeps (evaluate_every_token)
        model_.rollback(k - j - 1);
        return -1;
      }
    }
  }

  Generation& g_;
  GenerationModel& model_;
  const GenerateOptions& options_;
  DraftLength draft_length_;
};

}  // namespace

FinishReason generate(Generation& g, GenerationModel& model, const GenerateOptions& options) {
  return GenerationLoop(g, model, options).run();
}

}  // namespace ringlm
