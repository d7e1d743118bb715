// A reply read back as its parts: the answer (content) and the reasoning that a format keeps
// apart from it.
//
// Harmony (gpt-oss) writes a reply as messages on channels, each a header and a text:
//
//   <|channel|>analysis<|message|>...reasoning...<|end|><|start|>assistant<|channel|>final<|message|>...answer...
//
// (the generation prompt already wrote the first "<|start|>assistant"; the <|return|> that ends
// the reply is an end-of-generation token, not text). ReplyParser reads that text as it streams
// and hands out the final channel's text as content and the analysis channel's as reasoning, as
// llama-server does (its reasoning_content). No marker and no header reaches either part, and
// text that could still be the start of a marker ("<", "<|mes") is held back until it is one or
// cannot be one any more. The rest goes where llama-server's gpt-oss parser puts it: the
// commentary channel (a preamble) to content; a message addressed to a function
// ("to=functions.get_weather") is a tool call, handed out by take_calls() once it ends (its
// text the arguments); one to any other recipient (a built-in tool, which ringlm does not run)
// goes to neither.
// Text before any header is content: a reply that ignores the format is still an answer.
// A marker in the middle of a message is read as the format means it even where the model left
// out the one before it (a <|channel|> without <|end|><|start|>assistant starts a new message).
//
// A format whose model thinks in tags first (ChatTemplate::has_think_tags(): Qwen3) writes
//
//   <think>\n...reasoning...\n</think>\n\n...answer...
//
// and the text between the tags is the reasoning, the rest the answer, each without the
// whitespace around it, as llama-server's reasoning_content and content. A reply that does not
// begin with <think> (after whitespace) is all content, as it came.
//
// Every other format's reply is all content, handed out as it comes. ChatReplyReader (below)
// then takes the tool calls out of the content when the request offered tools (tool_calls.h).
#pragma once

#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/session/chat_template.h"

namespace ringlm {

struct ReplyDelta {
  std::string content;
  std::string reasoning;
  bool empty() const { return content.empty() && reasoning.empty(); }
};

class ReplyParser {
 public:
  explicit ReplyParser(const ChatTemplate& chat_template)
      : channels_(chat_template.has_channels()), think_tags_(chat_template.has_think_tags()) {}

  // What the next piece of the reply's text (any cut: a marker or a UTF-8 character may be
  // split between pieces) adds to each part.
  ReplyDelta push(std::string_view text);
  // The reply has ended: what was held back (text that never became a marker) goes to the part
  // it belongs to.
  ReplyDelta finish();

  // The tool calls whose messages ended since the last call (harmony; no ids yet).
  std::vector<ToolCall> take_calls() { return std::exchange(calls_, {}); }

  // Everything handed out so far: the whole parts once finished.
  const std::string& content() const { return content_; }
  const std::string& reasoning() const { return reasoning_; }

  // A whole reply's parts.
  static ReplyDelta parse(const ChatTemplate& chat_template, std::string_view reply);

 private:
  enum class Route { kContent, kReasoning, kCall, kNone };
  enum class Marker { kStart, kChannel, kConstrain, kMessage, kEnd, kReturn, kCall };

  // Where a think-tag reply is: before its first text, in the reasoning (nothing of it handed
  // out yet, or some), between the tags and the answer, in the answer.
  enum class Think { kStart, kReasoningStart, kReasoning, kAnswerStart, kAnswer };
  ReplyDelta push_think(std::string_view text);

  void on_text(std::string_view text, ReplyDelta& out);
  void on_marker(Marker marker);
  void route(std::string_view text, ReplyDelta& out);
  static Route route_of(std::string_view header);
  void end_message();  // a call's message is complete

  bool channels_;
  bool think_tags_;
  Think think_ = Think::kStart;
  std::string held_;            // the end of the text, which may be the start of a marker
  bool in_message_ = false;     // reading a message's text (else a header)
  bool at_reply_start_ = true;  // no header nor marker read yet
  std::string header_;          // the header being read (role, recipient, channel, markers)
  Route route_ = Route::kContent;
  std::string content_, reasoning_;
  ToolCall call_;                // the call being read (Route::kCall): its name, its arguments so far
  std::vector<ToolCall> calls_;  // complete, not taken yet
};

// A chat reply read into its parts as it streams: the reasoning apart (ReplyParser), then, when
// the request offered tools, the tool calls out of the answer (ToolCallParser, in the
// template's tool_syntax()).
struct ChatReplyDelta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> calls;
  bool empty() const { return content.empty() && reasoning.empty() && calls.empty(); }
};

class ChatReplyReader {
 public:
  // `read_calls`: tools were offered. `forced`: the prompt began the reply with the template's
  // forced_call_prefix(), which the parser must read first.
  ChatReplyReader(const ChatTemplate& chat_template, bool read_calls, bool forced);

  ChatReplyDelta push(std::string_view text);
  ChatReplyDelta finish();
  // A whole reply's parts.
  static ChatReplyDelta read(const ChatTemplate& chat_template, bool read_calls, bool forced, std::string_view reply);

 private:
  ChatReplyDelta take_calls(ReplyDelta parts, bool last);

  ReplyParser parts_;
  std::optional<ToolCallParser> calls_;  // (not for harmony, whose calls ReplyParser reads)
  bool read_calls_;
  std::mt19937_64 random_{std::random_device{}()};  // harmony's call ids
};

}  // namespace ringlm
