// The OpenAI API as `ringlm serve` speaks it: request bodies read and checked field by field
// (an error names the field, as OpenAI's error objects do), and the JSON of responses, stream
// chunks and errors. No HTTP and no model here: serve_command.cpp joins this to the server and
// the scheduler.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/grammar/grammar.h"
#include "core/sampling/sampler.h"
#include "core/session/chat_template.h"
#include "core/session/tool_calls.h"

namespace ringlm::serve {

using json = nlohmann::json;

// A request the client got wrong (or one the server cannot take now), as OpenAI reports it:
// the HTTP status, the error type and the field at fault ("" when none is).
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = "", std::string type = "")
      : std::runtime_error(std::move(message)), status_(status), param_(std::move(param)), type_(std::move(type)) {
    if (type_.empty()) type_ = status == 401 ? "authentication_error" : status >= 500 ? "server_error" : "invalid_request_error";
  }
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& type() const { return type_; }

 private:
  int status_;
  std::string param_, type_;
};

// {"error": {"message", "type", "param", "code"}}.
json error_body(const ApiError& e);

enum class Endpoint { kChat, kCompletion };

// One POST /v1/chat/completions or /v1/completions, checked.
struct CompletionRequest {
  Endpoint endpoint = Endpoint::kChat;
  std::string model;                  // echoed back; ringlm serves the one model it loaded
  std::vector<ChatMessage> messages;  // chat: the conversation, ending with a user message
  std::string prompt;                 // completion: the text to continue
  std::optional<int> max_tokens;      // none: until the end of generation or of the context
  SamplingParams sampling;
  std::vector<std::string> stop;
  int n = 1;
  // vLLM's "use_beam_search": beam search of "best_of" beams (n when not given), the n best
  // returned; "length_penalty" as Hugging Face's. 0: sampling.
  int beams = 0;
  float length_penalty = 1.0f;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  bool logprobs = false;
  int top_logprobs = 0;
  // llama-server's "speculative.n_max": drafts of at most this many tokens for this request
  // (0: none), when the server decodes speculatively.
  std::optional<int> draft_max;
  // chat: how long a harmony model (gpt-oss) thinks, "low", "medium" or "high": OpenAI's and
  // vLLM's "reasoning_effort", or llama-server's "chat_template_kwargs": {"reasoning_effort"}.
  std::optional<std::string> reasoning_effort;
  // The text is held to this grammar (null: none): "response_format" {"type": "json_object"} or
  // {"type": "json_schema", "json_schema": {"schema": ...}}, or llama-server's "grammar" (GBNF)
  // and "json_schema".
  std::shared_ptr<const Grammar> grammar;
  // chat: the tools the model may call ("tools"; empty with none, or with "tool_choice": "none",
  // which leaves them out of the prompt as llama-server does), whether it must call one
  // ("required", or the one named: "tool_choice": {"type": "function", "function": {"name"}}),
  // and whether a reply may hold several calls ("parallel_tool_calls"; false unless asked for, as
  // llama-server: a small model that may write several calls often writes the same one again).
  std::vector<ToolDefinition> tools;
  bool tool_required = false;
  bool parallel_tool_calls = false;
};

// Reads a request body. `defaults` are the server's sampling settings, which the request's
// fields override. Throws ApiError (400) naming the first field that is missing, of the wrong
// type or out of range. `raw_body`, the body's text, gives the tools' members in the client's
// order (the templates write them so; `body` keeps its members sorted).
CompletionRequest parse_completion_request(const json& body, Endpoint endpoint, const SamplingParams& defaults,
                                           std::string_view raw_body = {});

// One generated token as a response shows it, with its log-probabilities when asked for.
struct TokenInfo {
  std::string text;  // the token's bytes as text (may be part of a UTF-8 character)
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;  // the most likely tokens and theirs
};

// What a finished choice holds.
struct Choice {
  int index = 0;
  std::string text;                 // chat: the answer (content)
  std::string reasoning;            // chat: the reasoning a format keeps apart (reasoning_content)
  std::vector<ToolCall> tool_calls;  // chat: the calls the reply made (tool_calls)
  std::string finish_reason;        // "stop", "length" or "tool_calls"
  std::vector<TokenInfo> tokens;    // with logprobs only
};

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};

// The response identity every chunk of one request repeats.
struct ResponseHead {
  std::string id;  // chatcmpl-... / cmpl-...
  int64_t created = 0;
  std::string model;
};

// The whole response of a request that did not stream.
json completion_response(const CompletionRequest& request, const ResponseHead& head, const std::vector<Choice>& choices,
                         const Usage& usage);
// A stream chunk of one choice: its first (the role, chat only), a piece of text (chat: of the
// answer, and of the reasoning as reasoning_content) with its tokens' log-probabilities, or its
// last (finish_reason set, no text).
json stream_chunk(const CompletionRequest& request, const ResponseHead& head, int index, const std::string& text,
                  const std::vector<TokenInfo>& tokens, const std::string& finish_reason, bool role = false,
                  const std::string& reasoning = "");
// A stream chunk of one choice's tool calls, each whole (its id, name and all its arguments), as
// delta.tool_calls[i] with index first_index + i: its place among the choice's calls.
json tool_calls_chunk(const CompletionRequest& request, const ResponseHead& head, int index,
                      const std::vector<ToolCall>& calls, int first_index);
// The last chunk of a stream that asked for the usage (stream_options.include_usage).
json usage_chunk(const CompletionRequest& request, const ResponseHead& head, const Usage& usage);
// A server-sent event carrying `data`: "data: <json>\n\n".
std::string sse_event(const json& data);
inline constexpr char kSseDone[] = "data: [DONE]\n\n";

}  // namespace ringlm::serve
