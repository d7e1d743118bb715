// Harmony's channels read from a streamed reply (see reply_parser.h).
#include "core/session/reply_parser.h"

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

namespace ringlm {

namespace {

// The markers a harmony reply holds, as its tokens render, in the order of ReplyParser::Marker.
constexpr std::array<std::string_view, 7> kMarkers = {"<|start|>",   "<|channel|>", "<|constrain|>", "<|message|>",
                                                      "<|end|>",     "<|return|>",  "<|call|>"};

// The marker `text` starts with (its index in kMarkers), if any.
std::optional<size_t> marker_at(std::string_view text) {
  for (size_t i = 0; i < kMarkers.size(); ++i) {
    if (text.substr(0, kMarkers[i].size()) == kMarkers[i]) return i;
  }
  return std::nullopt;
}

// Whether `text` is the start of a marker, shorter than it.
bool starts_a_marker(std::string_view text) {
  for (std::string_view marker : kMarkers) {
    if (text.size() < marker.size() && marker.substr(0, text.size()) == text) return true;
  }
  return false;
}

// The name after `key` in a header ("to=functions.get_weather", "<|channel|>final"): up to a
// space, the next marker or the end.
std::string_view name_after(std::string_view header, size_t key_end) {
  const std::string_view rest = header.substr(key_end);
  return rest.substr(0, std::min(rest.find_first_of(" <"), rest.size()));
}

constexpr std::string_view kRecipient = " to=";  // a recipient right after the role
constexpr std::string_view kFunctions = "functions.";  // the namespace of the tools a request offers

// The function a header's recipient names ("to=functions.get_weather": "get_weather").
std::string function_called(std::string_view header) {
  const size_t to = header.find(std::string("to=") + std::string(kFunctions));
  if (to == std::string_view::npos) return "";
  return std::string(name_after(header, to + 3).substr(kFunctions.size()));
}

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kSpace = " \t\r\n";

// How many bytes at the end of `text` could still become `tag` with more text: the longest
// suffix that is a proper prefix of it.
size_t tag_start_at_end(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

ReplyDelta ReplyParser::push_think(std::string_view text) {
  ReplyDelta out;
  held_ += text;
  for (;;) {
    switch (think_) {
      case Think::kStart: {
        const size_t first = held_.find_first_not_of(kSpace);
        if (first == std::string::npos) return out;  // only whitespace yet
        const std::string_view rest = std::string_view(held_).substr(first);
        if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
          held_.erase(0, first + kThinkOpen.size());
          think_ = Think::kReasoningStart;
          continue;
        }
        if (kThinkOpen.substr(0, rest.size()) == rest) return out;  // may still be <think>
        think_ = Think::kAnswer;  // no thinking: the reply as it came
        continue;
      }
      case Think::kReasoningStart:
      case Think::kAnswerStart: {
        const size_t first = held_.find_first_not_of(kSpace);
        held_.erase(0, first == std::string::npos ? held_.size() : first);
        if (held_.empty()) return out;
        think_ = think_ == Think::kReasoningStart ? Think::kReasoning : Think::kAnswer;
        continue;
      }
      case Think::kReasoning: {
        const size_t close = held_.find(kThinkClose);
        std::string_view reasoning = std::string_view(held_).substr(0, std::min(close, held_.size()));
        // Held back: what may still become </think>, and the whitespace before it (trimmed
        // when the tag comes).
        if (close == std::string::npos) reasoning.remove_suffix(tag_start_at_end(reasoning, kThinkClose));
        const size_t end = reasoning.find_last_not_of(kSpace);
        reasoning = reasoning.substr(0, end == std::string_view::npos ? 0 : end + 1);
        reasoning_ += reasoning;
        out.reasoning += reasoning;
        if (close == std::string::npos) {
          held_.erase(0, reasoning.size());
          return out;
        }
        held_.erase(0, close + kThinkClose.size());
        think_ = Think::kAnswerStart;
        continue;
      }
      case Think::kAnswer:
        content_ += held_;
        out.content += held_;
        held_.clear();
        return out;
    }
  }
}

ReplyDelta ReplyParser::push(std::string_view text) {
  if (think_tags_) return push_think(text);
  ReplyDelta out;
  if (!channels_) {
    content_ += text;
    out.content = std::string(text);
    return out;
  }
  held_ += text;
  const std::string_view all = held_;
  size_t done = 0;  // what has been read: text before it handed on, markers taken
  for (size_t at = all.find('<'); at != std::string_view::npos; at = all.find('<', at)) {
    if (const std::optional<size_t> marker = marker_at(all.substr(at))) {
      on_text(all.substr(done, at - done), out);
      on_marker(static_cast<Marker>(*marker));
      at += kMarkers[*marker].size();
      done = at;
    } else if (starts_a_marker(all.substr(at))) {
      on_text(all.substr(done, at - done), out);
      held_.erase(0, at);
      return out;
    } else {
      ++at;
    }
  }
  on_text(all.substr(done), out);
  held_.clear();
  return out;
}

ReplyDelta ReplyParser::finish() {
  ReplyDelta out;
  if (think_tags_) {
    // What was held back: the start of a reply that never became <think> is the answer; the end
    // of reasoning that was never closed (a reply cut short) is reasoning, trimmed.
    if (think_ == Think::kStart) {
      content_ += held_;
      out.content = held_;
    } else if (think_ == Think::kReasoning) {
      const size_t end = held_.find_last_not_of(kSpace);
      out.reasoning = held_.substr(0, end == std::string::npos ? 0 : end + 1);
      reasoning_ += out.reasoning;
    }
    held_.clear();
    return out;
  }
  if (!channels_) return out;
  std::string rest = std::move(held_);
  held_.clear();
  on_text(rest, out);
  // A reply that is only the start of " to=" was plain text after all.
  if (!in_message_ && at_reply_start_ && !header_.empty()) {
    route_ = Route::kContent;
    route(header_, out);
    header_.clear();
  }
  end_message();  // a call ends with <|call|>, which ends the generation: not in the text
  return out;
}

void ReplyParser::end_message() {
  if (route_ != Route::kCall) return;
  const size_t begin = call_.arguments.find_first_not_of(kSpace);
  const size_t end = call_.arguments.find_last_not_of(kSpace);
  call_.arguments = begin == std::string::npos ? "{}" : call_.arguments.substr(begin, end - begin + 1);
  calls_.push_back(std::move(call_));
  call_ = {};
  route_ = Route::kNone;
}

ReplyDelta ReplyParser::parse(const ChatTemplate& chat_template, std::string_view reply) {
  ReplyParser parser(chat_template);
  parser.push(reply);
  parser.finish();
  return {parser.content(), parser.reasoning()};
}

void ReplyParser::on_text(std::string_view text, ReplyDelta& out) {
  if (text.empty()) return;
  if (in_message_) {
    route(text, out);
    return;
  }
  header_ += text;
  if (!at_reply_start_) return;
  // The header the generation prompt began ("<|start|>assistant") goes on with a recipient or a
  // marker; anything else is a reply without headers.
  if (header_.substr(0, kRecipient.size()) == kRecipient) {
    at_reply_start_ = false;
  } else if (kRecipient.substr(0, header_.size()) != header_) {
    at_reply_start_ = false;
    in_message_ = true;
    route_ = Route::kContent;
    route(header_, out);
    header_.clear();
  }
}

void ReplyParser::on_marker(Marker marker) {
  switch (marker) {
    case Marker::kStart:  // a new message: its header follows
      end_message();
      in_message_ = false;
      header_.clear();
      break;
    case Marker::kChannel:  // a header's channel; in a message's text, a new message
      if (in_message_) header_.clear(), end_message();
      in_message_ = false;
      header_ += kMarkers[static_cast<size_t>(marker)];
      break;
    case Marker::kConstrain:  // part of a header (the type of a tool call's arguments)
      if (!in_message_) header_ += kMarkers[static_cast<size_t>(marker)];
      break;
    case Marker::kMessage:  // the header ends, the message's text begins
      if (!in_message_) {
        route_ = route_of(header_);
        if (route_ == Route::kCall) call_.name = function_called(header_);
        header_.clear();
        in_message_ = true;
      }
      break;
    case Marker::kEnd:
    case Marker::kReturn:
    case Marker::kCall:  // the message ends
      end_message();
      in_message_ = false;
      header_.clear();
      break;
  }
  at_reply_start_ = false;
}

void ReplyParser::route(std::string_view text, ReplyDelta& out) {
  if (route_ == Route::kContent) {
    content_ += text;
    out.content += text;
  } else if (route_ == Route::kReasoning) {
    reasoning_ += text;
    out.reasoning += text;
  } else if (route_ == Route::kCall) {
    call_.arguments += text;
  }
}

ReplyParser::Route ReplyParser::route_of(std::string_view header) {
  // A recipient other than the assistant: a tool call, whose arguments are no answer.
  for (size_t to = header.find("to="); to != std::string_view::npos; to = header.find("to=", to + 1)) {
    if (to > 0 && header[to - 1] != ' ') continue;  // inside a word
    const std::string_view recipient = name_after(header, to + 3);
    if (recipient.substr(0, kFunctions.size()) == kFunctions && recipient.size() > kFunctions.size()) return Route::kCall;
    if (recipient != "assistant") return Route::kNone;
  }
  // The last channel named (gpt-oss sometimes writes "<|channel|>commentary" before the real one).
  constexpr std::string_view kChannel = "<|channel|>";
  const size_t channel = header.rfind(kChannel);
  if (channel != std::string_view::npos && name_after(header, channel + kChannel.size()) == "analysis") {
    return Route::kReasoning;
  }
  return Route::kContent;  // final, commentary (a preamble to the answer), or none
}

ChatReplyReader::ChatReplyReader(const ChatTemplate& chat_template, bool read_calls, bool forced)
    : parts_(chat_template), read_calls_(read_calls) {
  if (!read_calls || chat_template.tool_syntax() == ToolSyntax::kHarmony) return;
  calls_.emplace(chat_template.tool_syntax());
  if (forced) calls_->push(forced_call_prefix(chat_template.tool_syntax()));  // (hands nothing out)
}

ChatReplyDelta ChatReplyReader::take_calls(ReplyDelta parts, bool last) {
  ChatReplyDelta out{std::move(parts.content), std::move(parts.reasoning), parts_.take_calls()};
  if (!read_calls_) out.calls.clear();  // (no tools offered: a message to a function is nothing)
  for (ToolCall& call : out.calls) call.id = new_tool_call_id(ToolSyntax::kHarmony, random_);
  if (!calls_) return out;
  ToolCallParser::Delta answer = calls_->push(out.content);
  if (last) {
    ToolCallParser::Delta rest = calls_->finish();
    answer.content += rest.content;
    answer.calls.insert(answer.calls.end(), rest.calls.begin(), rest.calls.end());
  }
  out.content = std::move(answer.content);
  out.calls = std::move(answer.calls);
  return out;
}

ChatReplyDelta ChatReplyReader::push(std::string_view text) { return take_calls(parts_.push(text), false); }

ChatReplyDelta ChatReplyReader::finish() { return take_calls(parts_.finish(), true); }

ChatReplyDelta ChatReplyReader::read(const ChatTemplate& chat_template, bool read_calls, bool forced,
                                     std::string_view reply) {
  ChatReplyReader reader(chat_template, read_calls, forced);
  ChatReplyDelta out = reader.push(reply);
  ChatReplyDelta rest = reader.finish();
  out.content += rest.content;
  out.reasoning += rest.reasoning;
  out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
  return out;
}

}  // namespace ringlm
