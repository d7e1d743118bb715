#include "core/session/generation.h"

#include <algorithm>
#include <utility>

#include "core/kv/kv_cache.h"

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

int32_t Generation::draw(std::span<float> logits) { return sampler_->sample(logits, history_); }
int32_t Generation::draw_top(std::span<const TopLogit> top) { return sampler_->sample_top(top); }

bool Generation::is_end_token(int32_t token) const {
  if (stop_.ignore_eos) return false;
  return tokenizer_->is_end_of_generation(token) ||
         std::find(stop_.end_tokens.begin(), stop_.end_tokens.end(), token) != stop_.end_tokens.end();
}

GenerationStep Generation::take(int32_t token) {
  if (is_end_token(token)) return finish(FinishReason::kEndToken);
  history_.push_back(token);
  ++n_tokens_;
  text_ += utf8_.push(tokenizer_->token_to_piece(token));
  if (cut_at_stop_string()) {
    // What the decoder still holds comes after the stop string: it is dropped with the rest.
    finish_ = FinishReason::kStopString;
    return {release(text_.size()), finish_};
  }
  if (stop_.max_tokens >= 0 && n_tokens_ >= stop_.max_tokens) return finish(FinishReason::kMaxTokens);
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

bool has_room(const KvCache& cache) { return cache.can_shift() || cache.context_size() < cache.capacity(); }

FinishReason generate(Generation& g, TokenScores scores, const SequenceModel& model, const GenerateOptions& options) {
  auto show = [&](const GenerationStep& step) {
    if (!step.text.empty() && options.on_text) options.on_text(step.text);
  };
  const bool keep_cache_in_step = options.evaluate_every_token;
  while (!g.finished()) {
    const int32_t token = scores.top.empty() ? g.draw(scores.logits) : g.draw_top(scores.top);
    if (keep_cache_in_step && !g.is_end_token(token) && !model.has_room()) {
      show(g.finish(FinishReason::kContextFull));
      break;
    }
    const int taken_before = g.n_tokens();
    show(g.take(token));
    if (g.n_tokens() == taken_before) break;  // an end token: nothing to evaluate
    if (g.finished() && !keep_cache_in_step) break;
    if (!g.finished() && !model.has_room()) {
      show(g.finish(FinishReason::kContextFull));
      break;
    }
    model.evaluate(token);
    if (!g.finished() && options.interrupt != nullptr && options.interrupt->load()) show(g.finish(FinishReason::kInterrupted));
  }
  return g.finish_reason();
}

}  // namespace ringlm
