// Tool calls: definitions, the forcing grammar and the streaming parser (see tool_calls.h).
#include "core/session/tool_calls.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <utility>

#include "core/grammar/grammar.h"
#include "core/grammar/json_schema.h"

namespace ringlm {
namespace {

constexpr std::string_view kHermesOpen = "<tool_call>", kHermesClose = "</tool_call>";
constexpr std::string_view kMistralMarker = "[TOOL_CALLS]";
constexpr std::string_view kPythonTag = "<|python_tag|>";  // Llama 3.1 may start a call with it
constexpr std::string_view kSpace = " \t\r\n";

// How many bytes at the end of `text` could still become `tag`: the longest suffix that is a
// proper prefix of it.
size_t tag_start_at_end(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

bool is_space_only(std::string_view text) { return text.find_first_not_of(kSpace) == std::string_view::npos; }

std::string_view trim_end(std::string_view text) {
  const size_t last = text.find_last_not_of(kSpace);
  return last == std::string_view::npos ? std::string_view() : text.substr(0, last + 1);
}

std::string_view trim(std::string_view text) {
  const size_t begin = text.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return text.substr(begin, text.find_last_not_of(kSpace) - begin + 1);
}

// --- python_json -------------------------------------------------------------------------------

void write_python_json(const OrderedJson& value, int indent, int depth, std::string& out) {
  const bool structured = value.is_object() || value.is_array();
  if (!structured || value.empty()) {
    out += structured ? (value.is_object() ? "{}" : "[]") : value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
    return;
  }
  // json.dumps: ", " and ": " without indent; with one, "," at line ends and ": ".
  const std::string item_separator = indent > 0 ? "," : ", ";
  const auto new_line = [&](int level) {
    if (indent > 0) out += "\n" + std::string(static_cast<size_t>(indent * level), ' ');
  };
  out += value.is_object() ? '{' : '[';
  bool first = true;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!first) out += item_separator;
    first = false;
    new_line(depth + 1);
    if (value.is_object()) {
      out += OrderedJson(it.key()).dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
      out += ": ";
    }
    write_python_json(*it, indent, depth + 1, out);
  }
  new_line(depth);
  out += value.is_object() ? '}' : ']';
}

// --- The forcing grammar -----------------------------------------------------------------------

// Points every local "$ref" of a tool's parameters at where they now live: under `base`.
void rebase_refs(OrderedJson& schema, const std::string& base) {
  if (schema.is_object()) {
    for (auto it = schema.begin(); it != schema.end(); ++it) {
      if (it.key() == "$ref" && it->is_string()) {
        const std::string ref = it->get<std::string>();
        if (!ref.empty() && ref[0] == '#') *it = base + ref.substr(1);
      } else {
        rebase_refs(*it, base);
      }
    }
  } else if (schema.is_array()) {
    for (OrderedJson& item : schema) rebase_refs(item, base);
  }
}

// Each tool's parameters as $defs/tool-<i> of one document, their own $refs pointed there.
OrderedJson tool_defs(std::span<const ToolDefinition> tools) {
  OrderedJson defs = OrderedJson::object();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string key = "tool-" + std::to_string(i);
    OrderedJson parameters = tools[i].parameters;
    rebase_refs(parameters, "#/$defs/" + key);
    defs[key] = std::move(parameters);
  }
  return defs;
}

// One schema for every call of `tools`: {"name": <its name>, <arguments_key>: <its parameters>},
// each tool's parameters kept under $defs (so that their own $refs still resolve).
OrderedJson calls_schema(std::span<const ToolDefinition> tools, const std::string& arguments_key) {
  OrderedJson alternatives = OrderedJson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string key = "tool-" + std::to_string(i);
    alternatives.push_back({{"type", "object"},
                            {"properties", {{"name", {{"const", tools[i].name}}}, {arguments_key, {{"$ref", "#/$defs/" + key}}}}},
                            {"required", {"name", arguments_key}},
                            {"additionalProperties", false}});
  }
  return {{"$defs", tool_defs(tools)}, {"anyOf", std::move(alternatives)}};
}

std::string schema_gbnf(const OrderedJson& schema, const std::string& root_name) {
  return json_schema_to_gbnf(nlohmann::json::parse(schema.dump()), root_name);
}

// gpt-oss's call, after the generation prompt's "<|start|>assistant": perhaps a reasoning message
// first (without '<', which would start a marker), then a message to one function with its
// arguments. Each tool's parameters are a $def of one schema, so that its arguments' rule is the
// converter's "ref-tool-<i>".
std::string harmony_call_gbnf(std::span<const ToolDefinition> tools) {
  OrderedJson refs = OrderedJson::array();
  for (size_t i = 0; i < tools.size(); ++i) refs.push_back({{"$ref", "#/$defs/tool-" + std::to_string(i)}});
  std::string gbnf = schema_gbnf({{"$defs", tool_defs(tools)}, {"anyOf", std::move(refs)}}, "any-arguments");
  std::string calls;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string rule = "ref-tool-" + std::to_string(i);
    if (gbnf.find("\n" + rule + " ::= ") == std::string::npos) {
      throw std::logic_error("tool calls: the arguments of tool " + std::to_string(i) + " have no rule " + rule);
    }
    calls += (i == 0 ? "" : " | ") + OrderedJson(tools[i].name + " <|constrain|>json<|message|>").dump() + " " + rule;
  }
  return gbnf + R"(root ::= ( "<|channel|>analysis<|message|>" [^<]* "<|end|><|start|>assistant" )? )" +
         R"("<|channel|>commentary to=functions." ( )" + calls + " )\n";
}

}  // namespace

ToolDefinition ToolDefinition::from_openai(const OrderedJson& tool) {
  if (!tool.is_object()) throw std::invalid_argument("must be an object {\"type\": \"function\", \"function\": {...}}");
  if (const auto type = tool.find("type"); type != tool.end() && *type != "function") {
    throw std::invalid_argument("type must be \"function\"");
  }
  const auto function = tool.find("function");
  if (function == tool.end() || !function->is_object()) throw std::invalid_argument("function must be an object");
  const auto name = function->find("name");
  if (name == function->end() || !name->is_string() || name->get<std::string>().empty()) {
    throw std::invalid_argument("function.name must be a non-empty string");
  }
  // OpenAI's rule for a function's name; it is also what every template can write unquoted
  // (harmony's "to=functions.NAME" ends at a space or a marker).
  const std::string& text = name->get_ref<const std::string&>();
  const bool valid = text.size() <= 64 && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
  if (!valid) throw std::invalid_argument("function.name must be 1 to 64 letters, digits, underscores or dashes");
  ToolDefinition definition;
  definition.name = text;
  definition.definition = tool;
  const auto parameters = function->find("parameters");
  if (parameters != function->end() && !parameters->is_object()) {
    throw std::invalid_argument("function.parameters must be a JSON Schema object");
  }
  // No parameters, or an empty schema: any arguments object.
  definition.parameters = parameters == function->end() || parameters->empty() ? OrderedJson{{"type", "object"}} : *parameters;
  return definition;
}

std::string python_json(const OrderedJson& value, int indent) {
  std::string out;
  write_python_json(value, indent, 0, out);
  return out;
}

std::string arguments_for_template(const std::string& arguments) {
  const OrderedJson parsed = OrderedJson::parse(arguments, nullptr, /*allow_exceptions=*/false);
  return parsed.is_discarded() ? arguments : python_json(parsed);
}

std::string tool_call_gbnf(ToolSyntax syntax, std::span<const ToolDefinition> tools, bool parallel, bool with_marker) {
  if (tools.empty()) throw GrammarError("tool calls: no tools to call");
  try {
    switch (syntax) {
      case ToolSyntax::kHermes: {
        // (The line breaks around the JSON are Qwen's; a model that leaves them out is read too.)
        const std::string call = R"("<tool_call>" "\n"? tool-call "\n"? "</tool_call>")";
        return schema_gbnf(calls_schema(tools, "arguments"), "tool-call") + "root ::= " + call +
               (parallel ? R"( ( "\n" )" + call + " )*" : "") + "\n";
      }
      case ToolSyntax::kLlama3:  // one call: Llama 3.1's template takes no more per reply
        return schema_gbnf(calls_schema(tools, "parameters"), "root");
      case ToolSyntax::kHarmony:  // one call (its template writes one per message)
        return harmony_call_gbnf(tools);
      case ToolSyntax::kMistral: {
        OrderedJson schema = calls_schema(tools, "arguments");
        OrderedJson array = {{"$defs", std::move(schema["$defs"])},
                             {"type", "array"},
                             {"items", {{"anyOf", std::move(schema["anyOf"])}}},
                             {"minItems", 1}};
        if (!parallel) array["maxItems"] = 1;
        if (!with_marker) return schema_gbnf(array, "root");
        return schema_gbnf(array, "tool-calls") + R"(root ::= "[TOOL_CALLS]" tool-calls)" + "\n";
      }
    }
  } catch (const GrammarError& e) {
    // Name the tool: the converter's place ("/$defs/tool-2/...") says only its index.
    std::string what = e.what();
    for (size_t i = tools.size(); i-- > 0;) {
      const std::string place = "/$defs/tool-" + std::to_string(i);
      if (const size_t at = what.find(place); at != std::string::npos) {
        what.replace(at, place.size(), "tool '" + tools[i].name + "' parameters ");
        break;
      }
    }
    throw GrammarError(what);
  }
  return "";
}

ToolCallTrigger tool_call_trigger(ToolSyntax syntax) {
  switch (syntax) {
    case ToolSyntax::kHermes: return {kHermesOpen};
    case ToolSyntax::kMistral: return {kMistralMarker};
    case ToolSyntax::kLlama3: return {"{", /*at_start=*/true};
    case ToolSyntax::kHarmony: return {};
  }
  return {};
}

std::string_view forced_call_prefix(ToolSyntax syntax) { return syntax == ToolSyntax::kMistral ? kMistralMarker : ""; }

std::string new_tool_call_id(ToolSyntax syntax, std::mt19937_64& random) {
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  const size_t length = syntax == ToolSyntax::kMistral ? 9 : 24;
  std::string id = syntax == ToolSyntax::kMistral ? "" : "call_";
  std::uniform_int_distribution<size_t> pick(0, kAlphabet.size() - 1);
  for (size_t i = 0; i < length; ++i) id += kAlphabet[pick(random)];
  return id;
}

// --- ToolCallParser ----------------------------------------------------------------------------

ToolCallParser::ToolCallParser(ToolSyntax syntax, uint64_t seed) : syntax_(syntax), random_(seed) {}

bool ToolCallParser::read_call(const OrderedJson& call, ToolCall& out) {
  if (!call.is_object()) return false;
  const auto name = call.find("name");
  if (name == call.end() || !name->is_string() || name->get<std::string>().empty()) return false;
  auto arguments = call.find("arguments");
  if (arguments == call.end()) arguments = call.find("parameters");  // Llama 3.1's word
  out.name = name->get<std::string>();
  if (arguments == call.end()) {
    out.arguments = "{}";
  } else if (arguments->is_string()) {  // some models write the arguments' JSON as a string
    out.arguments = arguments->get<std::string>();
  } else {
    out.arguments = arguments->dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  }
  const auto id = call.find("id");
  out.id = id != call.end() && id->is_string() && !id->get<std::string>().empty() ? id->get<std::string>()
                                                                                    : new_tool_call_id(syntax_, random_);
  return true;
}

bool ToolCallParser::read_calls(std::string_view text, std::vector<ToolCall>& out) {
  const OrderedJson parsed = OrderedJson::parse(trim(text), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return false;
  std::vector<ToolCall> calls;
  const OrderedJson list = parsed.is_array() ? parsed : OrderedJson::array({parsed});
  if (list.empty()) return false;
  for (const OrderedJson& item : list) {
    ToolCall call;
    if (!read_call(item, call)) return false;
    calls.push_back(std::move(call));
  }
  out.insert(out.end(), std::make_move_iterator(calls.begin()), std::make_move_iterator(calls.end()));
  return true;
}

ToolCallParser::Delta ToolCallParser::push_hermes(std::string_view text) {
  Delta out;
  held_ += text;
  for (;;) {
    if (state_ == State::kInCall) {
      const size_t close = held_.find(kHermesClose);
      if (close == std::string::npos) return out;
      const std::string inner = held_.substr(0, close);
      if (!read_calls(inner, out.calls)) out.content += std::string(kHermesOpen) + inner + std::string(kHermesClose);
      held_.erase(0, close + kHermesClose.size());
      state_ = State::kCallsToEnd;  // (here: after a call, where space alone is dropped)
      continue;
    }
    // Space right before a call is dropped with it, so text that ends in space waits to see
    // what follows; so does the start of what may be a marker.
    const size_t open = held_.find(kHermesOpen);
    if (open != std::string::npos) {
      out.content += trim_end(std::string_view(held_).substr(0, open));
      held_.erase(0, open + kHermesOpen.size());
      state_ = State::kInCall;
      continue;
    }
    size_t end = held_.size() - tag_start_at_end(held_, kHermesOpen);
    while (end > 0 && kSpace.find(held_[end - 1]) != std::string_view::npos) --end;
    out.content += held_.substr(0, end);
    held_.erase(0, end);
    if (end > 0) state_ = State::kText;
    return out;
  }
}

ToolCallParser::Delta ToolCallParser::push(std::string_view text) {
  if (syntax_ == ToolSyntax::kHermes) return push_hermes(text);
  Delta out;
  held_ += text;
  if (state_ == State::kText) {
    if (syntax_ == ToolSyntax::kMistral) {  // text until the marker, then calls to the end
      const size_t marker = held_.find(kMistralMarker);
      if (marker != std::string::npos) {
        out.content = held_.substr(0, marker);
        held_.erase(0, marker);
        state_ = State::kCallsToEnd;
        return out;
      }
      const size_t keep = tag_start_at_end(held_, kMistralMarker);
      out.content = held_.substr(0, held_.size() - keep);
      held_.erase(0, held_.size() - keep);
      return out;
    }
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  if (state_ != State::kStart) return out;  // kCallsToEnd: read at finish()
  // The start decides: a reply that begins as a call is one to its end.
  const std::string_view start = trim(held_);
  if (start.empty()) return out;
  const std::string_view marker = syntax_ == ToolSyntax::kMistral ? kMistralMarker : kPythonTag;
  const bool is_call = start.substr(0, marker.size()) == marker || (syntax_ == ToolSyntax::kLlama3 && start[0] == '{');
  if (is_call) {
    state_ = State::kCallsToEnd;
    return out;
  }
  if (start.size() < marker.size() && marker.substr(0, start.size()) == start) return out;  // may still be the marker
  state_ = State::kText;
  return push("");
}

ToolCallParser::Delta ToolCallParser::finish() {
  Delta out;
  std::string rest = std::move(held_);
  held_.clear();
  if (syntax_ == ToolSyntax::kHermes) {
    if (state_ == State::kInCall) {  // the reply ended inside a call: its JSON may still be whole
      if (!read_calls(rest, out.calls)) out.content = std::string(kHermesOpen) + rest;
    } else if (!(state_ == State::kCallsToEnd && is_space_only(rest))) {
      out.content = std::move(rest);
    }
    return out;
  }
  if (state_ == State::kCallsToEnd) {
    std::string_view calls = trim(rest);
    const std::string_view marker = syntax_ == ToolSyntax::kMistral ? kMistralMarker : kPythonTag;
    if (calls.substr(0, marker.size()) == marker) calls.remove_prefix(marker.size());
    if (read_calls(calls, out.calls)) return out;
  }
  out.content = std::move(rest);
  return out;
}

ToolCallParser::Delta ToolCallParser::parse(ToolSyntax syntax, std::string_view text) {
  ToolCallParser parser(syntax);
  Delta out = parser.push(text);
  Delta rest = parser.finish();
  out.content += rest.content;
  out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
  return out;
}

}  // namespace ringlm
