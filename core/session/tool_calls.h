// Tool calls: the functions a chat offers its model, the calls a reply makes, and the ways chat
// families write them.
//
// A model that calls a tool writes the call as text in its family's syntax; the client gets it
// back as OpenAI's tool_calls (a name and its arguments as JSON text), runs the function and
// sends the result as a "tool" message, which the template writes into the next prompt.
//
//   Hermes (Qwen 2.5 and 3, Hermes):  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//                                     (one block per call; text may come before them)
//   Llama 3.1+:                       {"name": "f", "parameters": {...}}  (the whole reply)
//   Mistral (v0.3, Nemo):             [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
//   gpt-oss (harmony):                <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}
//
// A template that knows no tools gets Hermes' syntax, described in the system message, as
// llama.cpp does for its generic format (chat_template_tools.cpp).
//
// The grammar here makes a reply nothing but calls (tool_choice "required" or a named tool): the
// arguments follow each tool's JSON Schema (json_schema.h). With tool_choice "auto" the model is
// free until it starts a call (tool_call_trigger), and held to the grammar from there; the
// parser reads whatever calls it wrote.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ringlm {

// JSON that keeps its members in the order they came: the templates write a tool's definition
// as the client gave it.
using OrderedJson = nlohmann::ordered_json;

// kHarmony: gpt-oss's messages to "functions.NAME" on the commentary channel, read by
// ReplyParser (reply_parser.h), not by ToolCallParser.
enum class ToolSyntax { kHermes, kLlama3, kMistral, kHarmony };

struct ToolCall {
  std::string id;         // the client answers the call with this id ("call_..."; Mistral: 9 letters and digits)
  std::string name;       // the function's
  std::string arguments;  // a JSON object's text, as OpenAI's function.arguments
};

// One tool offered: OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}.
struct ToolDefinition {
  std::string name;
  OrderedJson definition;  // the whole object, as the client wrote it
  // The function's parameters: a JSON Schema of its arguments ({"type": "object"} when absent).
  OrderedJson parameters;

  // From OpenAI's object; std::invalid_argument naming what is wrong ("function.name is required").
  static ToolDefinition from_openai(const OrderedJson& tool);
};

// Python's json.dumps(value, ensure_ascii=False), which is what the templates' tojson writes:
// ", " and ": " between items, members in their order; with indent > 0, one item per line.
std::string python_json(const OrderedJson& value, int indent = -1);

// A call's arguments as the templates write them: the JSON the text holds, written by
// python_json; text that is not JSON as it is.
std::string arguments_for_template(const std::string& arguments);

// GBNF for a reply made only of calls to `tools` in `syntax`, each call's arguments valid under
// its tool's parameters: one call, or (`parallel`) one or more. Mistral's marker is part of it
// only `with_marker` (a forced reply gets it from forced_call_prefix(), in the prompt). Throws
// GrammarError naming the tool whose parameters the JSON Schema converter refuses.
std::string tool_call_gbnf(ToolSyntax syntax, std::span<const ToolDefinition> tools, bool parallel,
                           bool with_marker = false);

// The text that starts a call in `syntax`, where a reply free to call or not (tool_choice
// "auto") can be held to tool_call_gbnf(..., with_marker = true) from there on: a lazy grammar
// (Generation::constrain). Llama 3.1's call is the whole reply, a JSON object: its trigger is
// "{" at the reply's start only (`at_start`). None ("") for harmony, whose calls ReplyParser
// reads from message headers that come in several forms.
struct ToolCallTrigger {
  std::string_view text;
  bool at_start = false;
};
ToolCallTrigger tool_call_trigger(ToolSyntax syntax);

// What the prompt ends with when a reply must be calls, so that the model's own marker token
// starts it (Mistral's [TOOL_CALLS], a control token the grammar cannot write); "" otherwise.
std::string_view forced_call_prefix(ToolSyntax syntax);

// A new call id: "call_" and 24 letters and digits (OpenAI's form), or 9 of them for Mistral,
// whose template refuses any other.
std::string new_tool_call_id(ToolSyntax syntax, std::mt19937_64& random);

// Reads the calls out of a reply's answer as it streams (after ReplyParser has taken the
// reasoning out). Text that may still become a call's marker is held back until it does or
// cannot; a call is handed out whole once its text is complete, with a fresh id. A call that is
// not valid JSON (or names no function) stays text, as the model wrote it.
class ToolCallParser {
 public:
  explicit ToolCallParser(ToolSyntax syntax, uint64_t seed = std::random_device{}());

  struct Delta {
    std::string content;
    std::vector<ToolCall> calls;
    bool empty() const { return content.empty() && calls.empty(); }
  };
  Delta push(std::string_view text);
  Delta finish();  // the reply ended: what was held back

  // The whole reply at once.
  static Delta parse(ToolSyntax syntax, std::string_view text);

 private:
  enum class State { kStart, kText, kInCall, kCallsToEnd };
  Delta push_hermes(std::string_view text);
  // A JSON call ({"name", "arguments" or "parameters"}) as a ToolCall; false if it is not one.
  bool read_call(const OrderedJson& call, ToolCall& out);
  // The calls of a JSON text that is one call or an array of them; false if it holds none.
  bool read_calls(std::string_view text, std::vector<ToolCall>& out);

  ToolSyntax syntax_;
  State state_ = State::kStart;
  std::string held_;  // text not handed out yet
  std::mt19937_64 random_;
};

}  // namespace ringlm
