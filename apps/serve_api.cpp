#include "apps/serve_api.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string_view>

#include "core/grammar/json_schema.h"

namespace ringlm::serve {

namespace {

constexpr int kMaxStops = 16;
constexpr int kMaxTopLogprobs = 20;

ApiError bad_field(const std::string& param, const std::string& what) {
  return ApiError(400, "'" + param + "': " + what, param);
}

// The field, or nullptr when it is absent or null (OpenAI's clients send null for "not set").
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<double> number(const json& body, const char* name, double lo, double hi) {
  const json* f = field(body, name);
  if (f == nullptr) return std::nullopt;
  if (!f->is_number()) throw bad_field(name, "must be a number");
  const double v = f->get<double>();
  if (!(v >= lo && v <= hi)) {
    throw bad_field(name, "must be between " + json(lo).dump() + " and " + json(hi).dump() + ", got " + f->dump());
  }
  return v;
}

std::optional<int64_t> integer(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* f = field(body, name);
  if (f == nullptr) return std::nullopt;
  const bool whole = f->is_number_integer() || (f->is_number_float() && std::floor(f->get<double>()) == f->get<double>());
  if (!whole) throw bad_field(name, "must be an integer");
  const double v = f->get<double>();
  if (!(v >= static_cast<double>(lo) && v <= static_cast<double>(hi))) {
    throw bad_field(name, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + f->dump());
  }
  return static_cast<int64_t>(v);
}

std::optional<bool> boolean(const json& body, const char* name) {
  const json* f = field(body, name);
  if (f == nullptr) return std::nullopt;
  if (!f->is_boolean()) throw bad_field(name, "must be true or false");
  return f->get<bool>();
}

// A message's content: a string, or an array of text parts ({"type": "text", "text": ...}).
std::string message_content(const json& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw bad_field(param, "must be a string or an array of text parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string at = param + "[" + std::to_string(i) + "]";
    if (!part.is_object() || part.value("type", "") != "text") {
      throw bad_field(at, "only text parts ({\"type\": \"text\", \"text\": ...}) are supported");
    }
    if (!part.contains("text") || !part["text"].is_string()) throw bad_field(at + ".text", "must be a string");
    text += part["text"].get<std::string>();
  }
  return text;
}

// An assistant message's "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}].
std::vector<ToolCall> read_tool_calls(const json& list, const std::string& at) {
  if (!list.is_array()) throw bad_field(at, "must be an array of tool calls");
  std::vector<ToolCall> calls;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string call_at = at + "[" + std::to_string(i) + "]";
    const json& call = list[i];
    const json* function = call.is_object() ? field(call, "function") : nullptr;
    if (function == nullptr || !function->is_object()) throw bad_field(call_at + ".function", "must be an object");
    const json* name = field(*function, "name");
    if (name == nullptr || !name->is_string()) throw bad_field(call_at + ".function.name", "must be a string");
    const json* arguments = field(*function, "arguments");
    if (arguments != nullptr && !arguments->is_string()) {
      throw bad_field(call_at + ".function.arguments", "must be a string (the arguments' JSON)");
    }
    const json* id = field(call, "id");
    if (id != nullptr && !id->is_string()) throw bad_field(call_at + ".id", "must be a string");
    calls.push_back({id != nullptr ? id->get<std::string>() : "", name->get<std::string>(),
                     arguments != nullptr ? arguments->get<std::string>() : "{}"});
  }
  return calls;
}

std::vector<ChatMessage> read_messages(const json& body) {
  const json* list = field(body, "messages");
  if (list == nullptr) throw bad_field("messages", "is required");
  if (!list->is_array() || list->empty()) throw bad_field("messages", "must be a non-empty array");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& m = (*list)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw bad_field(at, "must be an object with a role and a content");
    const json* role = field(m, "role");
    if (role == nullptr || !role->is_string()) throw bad_field(at + ".role", "must be a string");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
      throw bad_field(at + ".role",
                      "must be one of system, developer, user, assistant, tool; got '" + role->get<std::string>() + "'");
    }
    ChatMessage message;
    message.role = r;
    const json* calls = r == "assistant" ? field(m, "tool_calls") : nullptr;
    if (calls != nullptr && !calls->is_null()) message.tool_calls = read_tool_calls(*calls, at + ".tool_calls");
    const json* content = field(m, "content");
    // An assistant message that calls tools may have no content (null).
    const bool content_optional = !message.tool_calls.empty();
    if (content == nullptr || content->is_null()) {
      if (!content_optional) throw bad_field(at + ".content", "is required");
    } else {
      message.content = message_content(*content, at + ".content");
    }
    if (r == "tool") {
      const json* id = field(m, "tool_call_id");
      if (id == nullptr || !id->is_string()) throw bad_field(at + ".tool_call_id", "must be a string (the call's id)");
      message.tool_call_id = id->get<std::string>();
    }
    messages.push_back(std::move(message));
  }
  if (messages.back().role != "user" && messages.back().role != "tool") {
    throw bad_field("messages", "must end with a user message or tool results");
  }
  return messages;
}

// "tools", "tool_choice" and "parallel_tool_calls". The tools are read from the body's text when
// given, so that their members keep the client's order.
void read_tools(const json& body, std::string_view raw_body, CompletionRequest& r) {
  const json* tools = field(body, "tools");
  const json* choice = field(body, "tool_choice");
  if (auto v = boolean(body, "parallel_tool_calls")) r.parallel_tool_calls = *v;
  if (tools == nullptr || tools->is_null()) {
    if (choice != nullptr && !(choice->is_string() && (*choice == "none" || *choice == "auto"))) {
      throw bad_field("tool_choice", "needs \"tools\"");
    }
    return;
  }
  if (!tools->is_array()) throw bad_field("tools", "must be an array of {\"type\": \"function\", \"function\": {...}}");
  const OrderedJson ordered = raw_body.empty() ? OrderedJson::parse(tools->dump()) : OrderedJson::parse(raw_body)["tools"];
  std::vector<ToolDefinition> definitions;
  for (size_t i = 0; i < ordered.size(); ++i) {
    try {
      definitions.push_back(ToolDefinition::from_openai(ordered[i]));
    } catch (const std::invalid_argument& e) {
      throw bad_field("tools[" + std::to_string(i) + "]", e.what());
    }
  }
  std::string named;
  if (choice != nullptr) {
    if (choice->is_string()) {
      const std::string mode = choice->get<std::string>();
      if (mode == "none") return;  // the tools stay out of the prompt
      if (mode != "auto" && mode != "required") throw bad_field("tool_choice", "must be \"none\", \"auto\", \"required\" or a named function");
      r.tool_required = mode == "required";
    } else {
      const json* function = choice->is_object() ? field(*choice, "function") : nullptr;
      const json* name = function != nullptr && function->is_object() ? field(*function, "name") : nullptr;
      if (name == nullptr || !name->is_string()) {
        throw bad_field("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
      }
      named = name->get<std::string>();
      r.tool_required = true;
    }
  }
  if (r.tool_required && definitions.empty()) throw bad_field("tool_choice", "needs at least one tool in \"tools\"");
  if (!named.empty()) {  // only the named tool may be called
    const auto it = std::find_if(definitions.begin(), definitions.end(), [&](const ToolDefinition& d) { return d.name == named; });
    if (it == definitions.end()) throw bad_field("tool_choice", "names function '" + named + "', which is not in \"tools\"");
    definitions = {*it};
  }
  r.tools = std::move(definitions);
}

std::string read_prompt(const json& body) {
  const json* prompt = field(body, "prompt");
  if (prompt == nullptr) throw bad_field("prompt", "is required");
  if (prompt->is_string()) return prompt->get<std::string>();
  if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) return (*prompt)[0].get<std::string>();
  throw bad_field("prompt", "must be a string (one prompt per request)");
}

std::vector<std::string> read_stop(const json& body) {
  const json* stop = field(body, "stop");
  if (stop == nullptr) return {};
  if (stop->is_string()) return stop->get<std::string>().empty() ? std::vector<std::string>{} : std::vector{stop->get<std::string>()};
  if (!stop->is_array() || stop->size() > kMaxStops) {
    throw bad_field("stop", "must be a string or an array of at most " + std::to_string(kMaxStops) + " strings");
  }
  std::vector<std::string> stops;
  for (const json& s : *stop) {
    if (!s.is_string()) throw bad_field("stop", "must hold only strings");
    if (!s.get<std::string>().empty()) stops.push_back(s.get<std::string>());
  }
  return stops;
}

// What ringlm does not do is refused, never ignored: a client that asked for functions would
// otherwise take plain text for an answer.
void refuse_unsupported(const json& body) {
  if (const json* functions = field(body, "functions"); functions != nullptr && !(functions->is_array() && functions->empty())) {
    throw ApiError(400, "'functions': function calling is not supported", "functions");
  }
  if (const json* suffix = field(body, "suffix"); suffix != nullptr && !(suffix->is_string() && suffix->get<std::string>().empty())) {
    throw ApiError(400, "'suffix': insertion is not supported", "suffix");
  }
  if (const std::optional<bool> echo = boolean(body, "echo"); echo.value_or(false)) {
    throw ApiError(400, "'echo': echoing the prompt is not supported", "echo");
  }
}

// A grammar compiled, its errors as a 400 naming the field that gave it.
std::shared_ptr<const Grammar> compile(const std::string& param, const std::function<std::string()>& gbnf) {
  try {
    return Grammar::parse(gbnf());
  } catch (const GrammarError& e) {
    throw ApiError(400, "'" + param + "': " + e.what(), param);
  }
}

std::shared_ptr<const Grammar> schema_grammar(const std::string& param, const json& schema) {
  return compile(param, [&] { return json_schema_to_gbnf(schema); });
}

// OpenAI's "response_format" ({"type": "text" | "json_object" | "json_schema"}), and
// llama-server's "grammar" (GBNF text) and "json_schema" (a schema): at most one of them.
std::shared_ptr<const Grammar> read_grammar(const json& body) {
  const json* format = field(body, "response_format");
  const json* gbnf = field(body, "grammar");
  const json* schema = field(body, "json_schema");
  const bool json_format = format != nullptr && format->is_object() && format->value("type", "") != "text";
  if (json_format + (gbnf != nullptr) + (schema != nullptr) > 1) {
    throw ApiError(400, "give at most one of 'response_format' (JSON), 'grammar' and 'json_schema'", "grammar");
  }
  if (gbnf != nullptr) {
    if (!gbnf->is_string()) throw bad_field("grammar", "must be a string (a GBNF grammar)");
    if (gbnf->get<std::string>().empty()) return nullptr;
    return compile("grammar", [&] { return gbnf->get<std::string>(); });
  }
  if (schema != nullptr) return schema_grammar("json_schema", *schema);
  if (format == nullptr) return nullptr;
  if (!format->is_object() || !format->contains("type") || !(*format)["type"].is_string()) {
    throw bad_field("response_format", "must be an object with a \"type\"");
  }
  const std::string type = (*format)["type"];
  if (type == "text") return nullptr;
  if (type == "json_object") {  // (llama-server also takes a "schema" here)
    if (const json* inner = field(*format, "schema")) return schema_grammar("response_format.schema", *inner);
    return compile("response_format", [] { return json_object_gbnf(); });
  }
  if (type != "json_schema") {
    throw bad_field("response_format.type", "must be \"text\", \"json_object\" or \"json_schema\", got \"" + type + "\"");
  }
  const json* spec = field(*format, "json_schema");
  if (spec == nullptr || !spec->is_object()) throw bad_field("response_format.json_schema", "must be an object with a \"schema\"");
  const json* inner = field(*spec, "schema");
  if (inner == nullptr) throw bad_field("response_format.json_schema.schema", "is required");
  return schema_grammar("response_format.json_schema.schema", *inner);
}

// vLLM's beam search fields: "use_beam_search": true, "best_of" beams (n when not given, at
// least n), "length_penalty". Without beam search, best_of can only be 1.
void read_beam_search(const json& body, CompletionRequest& r) {
  const bool beams = boolean(body, "use_beam_search").value_or(false);
  const std::optional<int64_t> best_of = integer(body, "best_of", 1, 128);
  if (!beams) {
    if (best_of.value_or(1) != 1) throw ApiError(400, "'best_of' other than 1 needs \"use_beam_search\": true", "best_of");
    if (field(body, "length_penalty") != nullptr) throw bad_field("length_penalty", "needs \"use_beam_search\": true");
    return;
  }
  r.beams = static_cast<int>(best_of.value_or(r.n));
  if (r.beams < r.n) throw bad_field("best_of", "must be at least n");
  if (auto v = number(body, "length_penalty", -10.0, 10.0)) r.length_penalty = static_cast<float>(*v);
  if (r.stream) throw bad_field("stream", "cannot be true with beam search: the text is known only at the end");
  if (r.logprobs) throw bad_field("logprobs", "beam search gives no per-token log-probabilities");
}

// "reasoning_effort" (OpenAI, vLLM) or "chat_template_kwargs": {"reasoning_effort"} (llama-server).
std::optional<std::string> read_reasoning_effort(const json& body) {
  const json* where = &body;
  std::string name = "reasoning_effort";
  if (const json* kwargs = field(body, "chat_template_kwargs"); kwargs != nullptr && field(body, "reasoning_effort") == nullptr) {
    if (!kwargs->is_object()) throw bad_field("chat_template_kwargs", "must be an object");
    where = kwargs;
    name = "chat_template_kwargs.reasoning_effort";
  }
  const json* effort = field(*where, "reasoning_effort");
  if (effort == nullptr) return std::nullopt;
  const std::string value = effort->is_string() ? effort->get<std::string>() : "";
  if (value != "low" && value != "medium" && value != "high") throw bad_field(name, "must be \"low\", \"medium\" or \"high\"");
  return value;
}

void read_sampling(const json& body, SamplingParams& s) {
  if (auto v = number(body, "temperature", 0.0, 100.0)) s.temperature = static_cast<float>(*v);
  if (auto v = number(body, "top_p", 0.0, 1.0)) s.top_p = static_cast<float>(*v);
  if (auto v = integer(body, "top_k", 0, 1 << 24)) s.top_k = static_cast<int>(*v);
  if (auto v = number(body, "min_p", 0.0, 1.0)) s.min_p = static_cast<float>(*v);
  if (auto v = number(body, "presence_penalty", -2.0, 2.0)) s.presence_penalty = static_cast<float>(*v);
  if (auto v = number(body, "frequency_penalty", -2.0, 2.0)) s.frequency_penalty = static_cast<float>(*v);
  if (auto v = number(body, "repeat_penalty", 0.0, 100.0)) s.repeat_penalty = static_cast<float>(*v);
  // A seed the client gives is its own; without one, every request draws a fresh one.
  if (auto v = integer(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max())) {
    s.seed = static_cast<uint64_t>(*v) & 0xFFFFFFFEull;  // never 0xFFFFFFFF: that means "random"
  }
}

}  // namespace

json error_body(const ApiError& e) {
  return {{"error", {{"message", e.what()}, {"type", e.type()}, {"param", e.param().empty() ? json() : json(e.param())}, {"code", nullptr}}}};
}

CompletionRequest parse_completion_request(const json& body, Endpoint endpoint, const SamplingParams& defaults,
                                           std::string_view raw_body) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  CompletionRequest r;
  r.endpoint = endpoint;
  if (const json* model = field(body, "model")) {
    if (!model->is_string()) throw bad_field("model", "must be a string");
    r.model = model->get<std::string>();
  }
  refuse_unsupported(body);
  if (endpoint == Endpoint::kChat) {
    r.messages = read_messages(body);
  } else {
    r.prompt = read_prompt(body);
  }
  r.sampling = defaults;
  read_sampling(body, r.sampling);
  // OpenAI renamed max_tokens to max_completion_tokens for chat; either is taken.
  const char* max_name = field(body, "max_completion_tokens") != nullptr ? "max_completion_tokens" : "max_tokens";
  if (auto v = integer(body, max_name, -1, 1 << 24)) {
    if (*v == 0) throw bad_field(max_name, "must be at least 1");
    if (*v > 0) r.max_tokens = static_cast<int>(*v);  // -1: no limit, as llama-server takes it
  }
  r.stop = read_stop(body);
  if (auto v = integer(body, "n", 1, 128)) r.n = static_cast<int>(*v);
  if (auto v = boolean(body, "stream")) r.stream = *v;
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw bad_field("stream_options", "must be an object");
    if (auto v = boolean(*options, "include_usage")) r.include_usage = *v;
  }
  if (endpoint == Endpoint::kChat) {
    if (auto v = boolean(body, "logprobs")) r.logprobs = *v;
    if (auto v = integer(body, "top_logprobs", 0, kMaxTopLogprobs)) {
      if (!r.logprobs) throw bad_field("top_logprobs", "needs \"logprobs\": true");
      r.top_logprobs = static_cast<int>(*v);
    }
  } else if (auto v = integer(body, "logprobs", 0, kMaxTopLogprobs)) {  // completions: how many top tokens
    r.logprobs = true;
    r.top_logprobs = static_cast<int>(*v);
  }
  if (auto v = integer(body, "speculative.n_max", 0, 64)) r.draft_max = static_cast<int>(*v);
  read_beam_search(body, r);
  r.grammar = read_grammar(body);
  if (r.grammar && r.beams > 0) throw bad_field("use_beam_search", "does not combine with a grammar or a JSON response format");
  if (endpoint == Endpoint::kChat) {
    r.reasoning_effort = read_reasoning_effort(body);
    read_tools(body, raw_body, r);
  } else if (field(body, "tools") != nullptr) {
    throw bad_field("tools", "is for /v1/chat/completions");
  }
  if (!r.tools.empty() && r.grammar) {
    throw ApiError(400, "give either tools or a grammar ('response_format', 'grammar', 'json_schema'), not both", "tools");
  }
  if (!r.tools.empty() && r.beams > 0) throw bad_field("use_beam_search", "does not combine with tools");
  return r;
}

namespace {

json chat_logprobs(const std::vector<TokenInfo>& tokens) {
  json content = json::array();
  for (const TokenInfo& t : tokens) {
    json top = json::array();
    for (const auto& [text, lp] : t.top) top.push_back({{"token", text}, {"logprob", lp}, {"bytes", json(std::vector<uint8_t>(text.begin(), text.end()))}});
    content.push_back({{"token", t.text},
                       {"logprob", t.logprob},
                       {"bytes", json(std::vector<uint8_t>(t.text.begin(), t.text.end()))},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json completion_logprobs(const std::vector<TokenInfo>& tokens, size_t text_offset) {
  json text = json::array(), logprobs = json::array(), top = json::array(), offsets = json::array();
  for (const TokenInfo& t : tokens) {
    text.push_back(t.text);
    logprobs.push_back(t.logprob);
    json alternatives = json::object();
    for (const auto& [piece, lp] : t.top) alternatives[piece] = lp;
    top.push_back(alternatives);
    offsets.push_back(text_offset);
    text_offset += t.text.size();
  }
  return {{"tokens", text}, {"token_logprobs", logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

// OpenAI's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}], with each
// call's "index" in a stream's delta.
json tool_calls_json(const std::vector<ToolCall>& calls, int first_index, bool indexed) {
  json list = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json call = {{"id", calls[i].id},
                 {"type", "function"},
                 {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (indexed) call["index"] = first_index + static_cast<int>(i);
    list.push_back(std::move(call));
  }
  return list;
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

json head_json(const CompletionRequest& request, const ResponseHead& head, bool chunk) {
  const bool chat = request.endpoint == Endpoint::kChat;
  return {{"id", head.id},
          {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", head.created},
          {"model", head.model}};
}

}  // namespace

json completion_response(const CompletionRequest& request, const ResponseHead& head, const std::vector<Choice>& choices,
                         const Usage& usage) {
  json out = head_json(request, head, false);
  json list = json::array();
  for (const Choice& c : choices) {
    json choice = {{"index", c.index}, {"finish_reason", c.finish_reason}};
    if (request.endpoint == Endpoint::kChat) {
      // OpenAI: the content is null when the reply is only tool calls.
      const bool only_calls = !c.tool_calls.empty() && c.text.empty();
      choice["message"] = {{"role", "assistant"}, {"content", only_calls ? json() : json(c.text)}};
      if (!c.tool_calls.empty()) choice["message"]["tool_calls"] = tool_calls_json(c.tool_calls, 0, false);
      // As llama-server: only when the format kept reasoning apart and the model wrote some.
      if (!c.reasoning.empty()) choice["message"]["reasoning_content"] = c.reasoning;
      choice["logprobs"] = request.logprobs ? chat_logprobs(c.tokens) : json();
    } else {
      choice["text"] = c.text;
      choice["logprobs"] = request.logprobs ? completion_logprobs(c.tokens, 0) : json();
    }
    list.push_back(choice);
  }
  out["choices"] = list;
  out["usage"] = usage_json(usage);
  return out;
}

json stream_chunk(const CompletionRequest& request, const ResponseHead& head, int index, const std::string& text,
                  const std::vector<TokenInfo>& tokens, const std::string& finish_reason, bool role,
                  const std::string& reasoning) {
  json out = head_json(request, head, true);
  json choice = {{"index", index}, {"finish_reason", finish_reason.empty() ? json() : json(finish_reason)}};
  if (request.endpoint == Endpoint::kChat) {
    json delta = json::object();
    if (role) delta["role"] = "assistant";
    if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
    if (!text.empty() || (!role && finish_reason.empty() && reasoning.empty())) delta["content"] = text;
    choice["delta"] = delta;
    choice["logprobs"] = request.logprobs && !tokens.empty() ? chat_logprobs(tokens) : json();
  } else {
    choice["text"] = text;
    choice["logprobs"] = request.logprobs && !tokens.empty() ? completion_logprobs(tokens, 0) : json();
  }
  out["choices"] = json::array({choice});
  if (request.include_usage) out["usage"] = nullptr;  // OpenAI: null on every chunk but the last
  return out;
}

json tool_calls_chunk(const CompletionRequest& request, const ResponseHead& head, int index,
                      const std::vector<ToolCall>& calls, int first_index) {
  json out = head_json(request, head, true);
  json choice = {{"index", index}, {"finish_reason", nullptr}, {"logprobs", nullptr}};
  choice["delta"] = {{"tool_calls", tool_calls_json(calls, first_index, true)}};
  out["choices"] = json::array({choice});
  if (request.include_usage) out["usage"] = nullptr;
  return out;
}

json usage_chunk(const CompletionRequest& request, const ResponseHead& head, const Usage& usage) {
  json out = head_json(request, head, true);
  out["choices"] = json::array();
  out["usage"] = usage_json(usage);
  return out;
}

std::string sse_event(const json& data) {
  // Invalid UTF-8 (a token cut inside a character never reaches here, but a model can emit
  // bytes that are not text) is replaced rather than failing the stream.
  return "data: " + data.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

}  // namespace ringlm::serve
