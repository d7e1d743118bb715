// Conversations with tools, as each format's template writes them (see chat_template.h and
// tool_calls.h). tests/reference/check_chat_templates.py renders the real templates with tools
// and compares.
//
//   Qwen 2.5 / 3 (ChatML):  the tools as JSON lines in the system message; calls as <tool_call>
//                           blocks; results as <tool_response> blocks in a user message.
//   Llama 3.1:              "Environment: ipython" in the system header, the tools (JSON, indent
//                           4) in the first user message; a call as the reply's JSON; each
//                           result as an "ipython" message.
//   Mistral v0.3 / Nemo:    [AVAILABLE_TOOLS] before the last user message; calls after
//                           [TOOL_CALLS]; each result in [TOOL_RESULTS].
//   Every other format:     Qwen's description of the tools and of <tool_call> appended to the
//                           system message (folded into the first user message where the format
//                           has no system role), calls and results written as Qwen's.
#include <stdexcept>

#include "core/session/chat_template.h"
#include "core/session/chat_text.h"

namespace ringlm {
namespace {

using namespace chat_text;

// Qwen's (Hermes') description of the tools and of how to call them.
std::string hermes_tools_prompt(std::span<const ToolDefinition> tools) {
  std::string text =
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const ToolDefinition& tool : tools) {
    text += '\n';
    text += python_json(tool.definition);
  }
  return text +
         "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
         "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
         "<args-json-object>}\n</tool_call>";
}

std::string join_system(std::string_view system, std::string_view tools_prompt) {
  return system.empty() ? std::string(tools_prompt) : concat({system, "\n\n", tools_prompt});
}

std::string llama3_tools_prompt(std::span<const ToolDefinition> tools) {
  std::string text =
      "Given the following functions, please respond with a JSON for a function call with its proper arguments "
      "that best answers the given prompt.\n\n"
      "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
      "value}.Do not use variables.\n\n";
  for (const ToolDefinition& tool : tools) {
    text += python_json(tool.definition, 4);
    text += "\n\n";
  }
  return text;
}

// Mistral's template writes each function's members itself: strings between quotes as they are
// (unescaped), anything else as JSON, "return" left out.
std::string mistral_tools(std::span<const ToolDefinition> tools) {
  std::string text = "[AVAILABLE_TOOLS][";
  for (size_t i = 0; i < tools.size(); ++i) {
    text += i == 0 ? "" : ", ";
    text += "{\"type\": \"function\", \"function\": {";
    bool first = true;
    for (const auto& [key, value] : tools[i].definition.at("function").items()) {
      if (key == "return") continue;
      text += first ? "" : ", ";
      first = false;
      text += value.is_string() ? concat({"\"", key, "\": \"", value.get_ref<const std::string&>(), "\""})
                                : concat({"\"", key, "\": ", python_json(value)});
    }
    text += "}}";
  }
  return text + "][/AVAILABLE_TOOLS]";
}

std::string hermes_call(const ToolCall& call) {
  return concat({"<tool_call>\n{\"name\": \"", call.name, "\", \"arguments\": ", arguments_for_template(call.arguments),
                 "}\n</tool_call>"});
}

}  // namespace

std::string ChatTemplate::render_with_tools(std::span<const ChatMessage> messages,
                                            std::span<const ToolDefinition> tools) const {
  if (format_ == ChatFormat::kHarmony) {
    throw std::invalid_argument("tool calls are not supported with the harmony chat format (gpt-oss) yet");
  }
  const bool has_system = !messages.empty() && messages[0].role == "system";
  std::string system = has_system ? messages[0].content : "";
  if (!native_tools_ && !tools.empty()) system = join_system(system, hermes_tools_prompt(tools));
  size_t last_user = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role == "user") last_user = i;
  }
  std::string text = tools_conversation_start(system, tools);
  bool first_user = true;
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role == "user") {
      text += tools_user_turn(message.content, first_user, i == last_user, system, tools);
      first_user = false;
    } else if (message.role == "assistant") {
      text += message.tool_calls.empty() ? assistant_reply(message.content) : tool_calls_reply(message);
    } else {  // tool results, read as one group
      size_t end = i;
      while (end < messages.size() && messages[end].role == "tool") ++end;
      text += tool_results_turn(messages.subspan(i, end - i), system);
      i = end - 1;
    }
  }
  return text;
}

std::string ChatTemplate::tools_conversation_start(std::string_view system, std::span<const ToolDefinition> tools) const {
  if (!native_tools_ || tools.empty()) return conversation_start(system);
  switch (tool_syntax_) {
    case ToolSyntax::kHermes:
      return concat({"<|im_start|>system\n", join_system(system, hermes_tools_prompt(tools)), "<|im_end|>\n"});
    case ToolSyntax::kLlama3:
      return concat({llama3_header("system"), "Environment: ipython\n", kLlama3DatedHeader, python_strip(system),
                     "<|eot_id|>"});
    case ToolSyntax::kMistral:
      return conversation_start(system);  // the tools go before the last user message
  }
  return "";
}

std::string ChatTemplate::tools_user_turn(std::string_view content, bool first, bool last, std::string_view system,
                                          std::span<const ToolDefinition> tools) const {
  if (native_tools_ && !tools.empty()) {
    if (tool_syntax_ == ToolSyntax::kLlama3 && first) {
      return concat({llama3_header("user"), llama3_tools_prompt(tools), python_strip(content), "<|eot_id|>",
                     llama3_header("assistant")});
    }
    if (tool_syntax_ == ToolSyntax::kMistral && last) return mistral_tools(tools) + user_turn(content, first, system);
  }
  return user_turn(content, first, system);
}

std::string ChatTemplate::tool_calls_reply(const ChatMessage& message) const {
  const std::vector<ToolCall>& calls = message.tool_calls;
  if (native_tools_ && tool_syntax_ == ToolSyntax::kLlama3) {  // the content is not written
    if (calls.size() != 1) {
      throw std::invalid_argument("this model's chat template (Llama 3.1) takes one tool call per assistant message, not " +
                                  std::to_string(calls.size()));
    }
    return concat({"{\"name\": \"", calls[0].name, "\", \"parameters\": ", arguments_for_template(calls[0].arguments),
                   "}<|eot_id|>"});
  }
  if (native_tools_ && tool_syntax_ == ToolSyntax::kMistral) {  // nor here
    std::string text = "[TOOL_CALLS][";
    for (size_t i = 0; i < calls.size(); ++i) {
      OrderedJson arguments = OrderedJson::parse(calls[i].arguments, nullptr, /*allow_exceptions=*/false);
      if (arguments.is_discarded()) arguments = calls[i].arguments;
      std::string function = python_json(OrderedJson{{"name", calls[i].name}, {"arguments", std::move(arguments)}});
      function.pop_back();  // the closing brace: the id goes inside
      text += concat({i == 0 ? "" : ", ", function, ", \"id\": \"", calls[i].id, "\"}"});
    }
    return concat({text, "]", special_.eos});
  }
  std::string text = message.content;
  for (size_t i = 0; i < calls.size(); ++i) text += concat({text.empty() ? "" : "\n", hermes_call(calls[i])});
  return assistant_reply(text);
}

std::string ChatTemplate::tool_results_turn(std::span<const ChatMessage> results, std::string_view system) const {
  std::string text;
  if (native_tools_ && tool_syntax_ == ToolSyntax::kLlama3) {
    // The template writes a result that is iterable as JSON, and a string is: quoted.
    for (const ChatMessage& result : results) {
      text += concat({llama3_header("ipython"), python_json(OrderedJson(result.content)), "<|eot_id|>"});
    }
    return text + llama3_header("assistant");
  }
  if (native_tools_ && tool_syntax_ == ToolSyntax::kMistral) {
    for (const ChatMessage& result : results) {
      text += concat({"[TOOL_RESULTS]{\"content\": ", result.content, ", \"call_id\": \"", result.tool_call_id,
                      "\"}[/TOOL_RESULTS]"});
    }
    return text;
  }
  for (const ChatMessage& result : results) {
    text += concat({text.empty() ? "" : "\n", "<tool_response>\n", result.content, "\n</tool_response>"});
  }
  return user_turn(text, /*first=*/false, system);
}

}  // namespace ringlm
