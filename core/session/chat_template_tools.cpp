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
//   gpt-oss (harmony):      the tools as a TypeScript namespace in the developer message; a
//                           call as a message to "functions.NAME" on the commentary channel,
//                           its result as that function's message to the assistant.
//   Every other format:     Qwen's description of the tools and of <tool_call> appended to the
//                           system message (folded into the first user message where the format
//                           has no system role), calls and results written as Qwen's.
#include <algorithm>
#include <stdexcept>
#include <utility>

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

// --- Harmony's TypeScript (the template's render_typescript_type and render_tool_namespace) ---

bool is(const OrderedJson& spec, std::string_view key, std::string_view value) {
  const auto it = spec.find(key);
  return it != spec.end() && it->is_string() && it->get_ref<const std::string&>() == value;
}

bool truthy(const OrderedJson& spec, std::string_view key) {
  const auto it = spec.find(key);
  return it != spec.end() && !it->is_null() && !(it->is_boolean() && !it->get<bool>()) && !(it->is_structured() && it->empty()) &&
         !(it->is_string() && it->get_ref<const std::string&>().empty());
}

std::string text_of(const OrderedJson& value) {  // a value as Jinja's "+" and join write it
  return value.is_string() ? value.get<std::string>() : python_json(value);
}

bool required(const OrderedJson& object, const std::string& name) {
  const auto list = object.find("required");
  if (list == object.end() || !list->is_array()) return false;
  return std::find(list->begin(), list->end(), OrderedJson(name)) != list->end();
}

std::string typescript_type(const OrderedJson& spec) {
  const std::string nullable = truthy(spec, "nullable") ? " | null" : "";
  if (is(spec, "type", "array")) {
    const auto items = spec.find("items");
    if (items == spec.end() || !truthy(spec, "items")) return "any[]" + nullable;
    for (const auto& [json_type, ts] : {std::pair{"string", "string"}, {"number", "number"}, {"integer", "number"},
                                        {"boolean", "boolean"}}) {
      if (is(*items, "type", json_type)) return std::string(ts) + "[]" + nullable;
    }
    const std::string inner = typescript_type(*items);
    return (inner == "object | object" || inner.size() > 50 ? "any" : inner) + "[]" + nullable;
  }
  if (const auto types = spec.find("type"); types != spec.end() && types->is_array() && !types->empty()) {
    std::string joined;
    for (const OrderedJson& type : *types) joined += (joined.empty() ? "" : " | ") + text_of(type);
    return joined;
  }
  if (truthy(spec, "oneOf")) {
    const OrderedJson& variants = spec["oneOf"];
    const bool objects = std::any_of(variants.begin(), variants.end(), [](const OrderedJson& v) { return is(v, "type", "object"); });
    if (objects && variants.size() > 1) return "any";
    std::string joined;  // (the template's comments on each variant are left out)
    for (const OrderedJson& variant : variants) joined += (joined.empty() ? "" : " | ") + typescript_type(variant);
    return joined;
  }
  if (is(spec, "type", "string")) {
    if (!truthy(spec, "enum")) return "string" + nullable;
    std::string joined;
    for (const OrderedJson& value : spec["enum"]) joined += (joined.empty() ? "\"" : "\" | \"") + text_of(value);
    return joined + "\"";
  }
  if (is(spec, "type", "number") || is(spec, "type", "integer")) return "number";
  if (is(spec, "type", "boolean")) return "boolean";
  if (is(spec, "type", "object")) {
    if (!truthy(spec, "properties")) return "object";
    // (The template writes a line break and its own indentation before each member's type.)
    std::string text = "{\n";
    bool first = true;
    for (const auto& [name, member] : spec["properties"].items()) {
      text += concat({first ? "" : ", ", name, required(spec, name) ? "" : "?", ": \n                ", typescript_type(member)});
      first = false;
    }
    return text + "}";
  }
  return "any";
}

// One parameter's line(s): its description, name, type and default, as the template writes them.
std::string typescript_parameter(const std::string& name, const OrderedJson& spec, const OrderedJson& parameters) {
  std::string text = truthy(spec, "description") ? concat({"// ", text_of(spec["description"]), "\n"}) : "";
  text += concat({name, required(parameters, name) ? "" : "?", ": ", typescript_type(spec)});
  if (const auto value = spec.find("default"); value != spec.end()) {
    if (truthy(spec, "enum")) {
      text += ", // default: " + text_of(*value);
    } else if (truthy(spec, "oneOf")) {
      text += "// default: " + text_of(*value);
    } else {
      text += ", // default: " + python_json(*value);
    }
  }
  return text + ",\n";
}

std::string harmony_tools(std::span<const ToolDefinition> tools) {
  std::string text = "# Tools\n\n## functions\n\nnamespace functions {\n\n";
  for (const ToolDefinition& tool : tools) {
    const OrderedJson& function = tool.definition.at("function");
    text += concat({"// ", function.contains("description") ? text_of(function["description"]) : "", "\ntype ", tool.name, " = "});
    const auto parameters = function.find("parameters");
    if (parameters == function.end() || !truthy(*parameters, "properties")) {
      text += "() => any;\n\n";
      continue;
    }
    text += "(_: {\n";
    for (const auto& [name, spec] : (*parameters)["properties"].items()) text += typescript_parameter(name, spec, *parameters);
    text += "}) => any;\n\n";
  }
  return text + "} // namespace functions";
}

std::string hermes_call(const ToolCall& call) {
  return concat({"<tool_call>\n{\"name\": \"", call.name, "\", \"arguments\": ", arguments_for_template(call.arguments),
                 "}\n</tool_call>"});
}

}  // namespace

std::string ChatTemplate::render_with_tools(std::span<const ChatMessage> messages,
                                            std::span<const ToolDefinition> tools) const {
  const bool has_system = !messages.empty() && messages[0].role == "system";
  std::string system = has_system ? messages[0].content : "";
  if (!native_tools_ && !tools.empty()) system = join_system(system, hermes_tools_prompt(tools));
  size_t last_user = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role == "user") last_user = i;
  }
  std::string text = tools_conversation_start(system, tools);
  bool first_user = true;
  std::string_view called;  // the function the last calls named
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& message = messages[i];
    if (message.role == "user") {
      text += tools_user_turn(message.content, first_user, i == last_user, system, tools);
      first_user = false;
    } else if (message.role == "assistant" && message.tool_calls.empty()) {
      text += assistant_reply(message.content);
    } else if (message.role == "assistant") {
      const bool answered = std::any_of(messages.begin() + static_cast<std::ptrdiff_t>(i) + 1, messages.end(),
                                        [](const ChatMessage& m) { return m.role == "assistant" && m.tool_calls.empty(); });
      text += tool_calls_reply(message, answered);
      called = message.tool_calls.front().name;
    } else {  // tool results, read as one group
      size_t end = i;
      while (end < messages.size() && messages[end].role == "tool") ++end;
      text += tool_results_turn(messages.subspan(i, end - i), system, called);
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
    case ToolSyntax::kHarmony: {
      std::string text = harmony_system_block(harmony_date(), reasoning_effort_, /*tools=*/true) +
                         "<|start|>developer<|message|>";
      if (!system.empty()) text += concat({"# Instructions\n\n", system, "\n\n"});
      return concat({text, harmony_tools(tools), "<|end|>"});
    }
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

std::string ChatTemplate::tool_calls_reply(const ChatMessage& message, bool answered) const {
  const std::vector<ToolCall>& calls = message.tool_calls;
  const bool one_call = native_tools_ && (tool_syntax_ == ToolSyntax::kLlama3 || tool_syntax_ == ToolSyntax::kHarmony);
  if (one_call && calls.size() != 1) {
    throw std::invalid_argument(concat({"this model's chat template (", name(), ") takes one tool call per assistant message, not ",
                                        std::to_string(calls.size())}));
  }
  if (tool_syntax_ == ToolSyntax::kHarmony) {
    // The content is the call's reasoning, kept until an answer follows (then dropped, as every
    // past reasoning is); the generation prompt already wrote "<|start|>assistant".
    const bool reasoning = !message.content.empty() && !answered;
    return concat({reasoning ? concat({"<|channel|>analysis<|message|>", message.content, "<|end|><|start|>assistant"}) : "",
                   " to=functions.", calls[0].name, "<|channel|>commentary json<|message|>",
                   arguments_for_template(calls[0].arguments), "<|call|>"});
  }
  if (native_tools_ && tool_syntax_ == ToolSyntax::kLlama3) {  // the content is not written
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

std::string ChatTemplate::tool_results_turn(std::span<const ChatMessage> results, std::string_view system,
                                            std::string_view called) const {
  std::string text;
  if (tool_syntax_ == ToolSyntax::kHarmony) {  // each result as the function's message (its text as JSON)
    for (const ChatMessage& result : results) {
      text += concat({"<|start|>functions.", called, " to=assistant<|channel|>commentary<|message|>",
                      python_json(OrderedJson(result.content)), "<|end|>"});
    }
    return text + "<|start|>assistant";
  }
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
