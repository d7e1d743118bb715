// `ringlm serve`: the OpenAI API over HTTP, every client's requests fed into one
// continuous-batching scheduler (core/scheduler/serving_engine.h).
//
// HTTP is cpp-httplib (Debian's libcpp-httplib-dev, the library llama-server uses): a blocking
// server with a pool of threads, one per connection being served. That suits this load: a
// streaming client holds its thread while its tokens come (the engine's one step per token for
// everyone is the bottleneck, not the threads), the pool is sized for several times --parallel
// clients, and each thread blocks on its request's stream, never on the model. An event-loop
// library (libmicrohttpd, Boost.Beast) would serve tens of thousands of idle connections with
// fewer threads, which a model that runs 16 sequences at a time never has.
#include "apps/serve_command.h"

#include <httplib.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "apps/common_options.h"
#include "apps/pipeline_process.h"
#include "apps/speculative_options.h"
#include "apps/serve_api.h"
#include "apps/serve_embeddings.h"
#include "core/scheduler/serving_engine.h"
#include "core/session/chat_session.h"
#include "core/session/reply_parser.h"

namespace ringlm {

namespace {

using serve::ApiError;
using serve::CompletionRequest;
using serve::Endpoint;
using serve::json;
using Clock = std::chrono::steady_clock;

struct ServeOptions {
  ModelOptions model;
  SamplingParams sampling;
  std::string host = "127.0.0.1";
  int port = 8080;
  int n_parallel = 4;
  int prefill_chunk = 64;
  int max_queue = 64;
  size_t max_body_bytes = 8 << 20;
  size_t prompt_cache_mib = 256;
  int shutdown_grace_s = 10;
  int http_threads = 0;  // 0: 4 x --parallel + 16
  std::string api_key;
  std::string alias;  // the model's name in the API; default: the file name
  std::string chat_template;
  KvTypes cache_type = KvType::kF16;
  SpeculativeOptions speculative;
};

// --- Small pieces ------------------------------------------------------------------------------

// Every byte of both keys is read whatever they hold, so the time taken tells nothing about how
// much of a guess was right (only, at most, the lengths).
bool same_secret(const std::string& given, const std::string& expected) {
  const size_t n = std::max(given.size(), expected.size());
  volatile unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char a = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    const unsigned char b = i < expected.size() ? static_cast<unsigned char>(expected[i]) : 0;
    diff = static_cast<unsigned char>(diff | (a ^ b));
  }
  return diff == 0;
}

std::string random_id(const char* prefix) {
  static std::mutex mutex;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lock(mutex);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return std::string(prefix) + buf;
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  if (e.status() == 503) res.set_header("Retry-After", "1");
  send_json(res, e.status(), serve::error_body(e));
}

// What the log line of the request being served on this thread reports besides the response.
struct RequestLog {
  Clock::time_point start;
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
thread_local RequestLog current_log;

// Held (shared) by a completion request until its answer is written: a shutdown waits for none.
class InFlight {
 public:
  explicit InFlight(std::atomic<int>& count) : count_(count) { ++count_; }
  ~InFlight() { --count_; }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  std::atomic<int>& count_;
};

// Requests by endpoint and status, for /metrics.
class RequestCounter {
 public:
  void count(const std::string& path, int status) {
    std::lock_guard lock(mutex_);
    ++counts_[{path, status}];
  }
  std::map<std::pair<std::string, int>, int64_t> snapshot() const {
    std::lock_guard lock(mutex_);
    return counts_;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> counts_;
};

// --- The server --------------------------------------------------------------------------------

struct WholeAnswer;

class Server {
 public:
  explicit Server(const ServeOptions& o) : o_(o) {}

  void run();

 private:
  void load();
  void route();
  // Fills `request`'s prompt tokens and the generation request for the scheduler.
  GenerationRequest generation_request(const CompletionRequest& request) const;
  std::vector<int32_t> chat_prompt(const CompletionRequest& request) const;
  void tool_call_grammar(const CompletionRequest& request, GenerationRequest& g) const;
  void completions(const httplib::Request& req, httplib::Response& res, Endpoint endpoint);
  void embeddings(const httplib::Request& req, httplib::Response& res);
  void answer_whole(std::shared_ptr<RequestStream> stream, const CompletionRequest& request, int prompt_tokens,
                    std::shared_ptr<InFlight> in_flight, httplib::Response& res);
  void gather(std::vector<StreamEvent> events, const CompletionRequest& request, WholeAnswer& answer) const;
  std::string whole_body(const CompletionRequest& request, const WholeAnswer& answer) const;
  void answer_streaming(std::shared_ptr<RequestStream> stream, const CompletionRequest& request, int prompt_tokens,
                        std::shared_ptr<InFlight> in_flight, httplib::Response& res);
  serve::TokenInfo token_info(const StreamEvent& e) const;
  std::string metrics() const;
  void shut_down_on_signal();
  void stop_http();

  const ServeOptions& o_;
  httplib::Server http_;
  std::atomic<bool> ready_{false}, stopping_{false}, signal_received_{false};
  std::string load_error_;
  std::optional<LoadedModel> model_;
  std::optional<LoadedModel> draft_model_;  // -md's, when speculative decoding has one
  std::optional<ChatTemplate> template_;
  std::vector<int32_t> end_of_turn_;
  std::unique_ptr<ServingEngine> engine_;
  std::string model_name_;
  int64_t created_ = 0;
  RequestCounter counter_;
  std::atomic<int> in_flight_{0};  // completion requests whose answer is not fully written
};

void Server::load() {
  try {
    const int n_threads = resolve_threads(o_.model.n_threads);
    omp_set_num_threads(n_threads);
    PipelineProcess& process = this_process();
    model_.emplace(load_model(o_.model, n_threads, stage_picker(process, o_.model.layer_split)));
    if (!process.alone()) model_->model->connect_pipeline(process.link());
    std::string notice;
    template_ = chat_template_for(*model_->gguf, *model_->tokenizer, o_.chat_template, notice);
    if (!notice.empty()) std::fprintf(stderr, "ringlm: %s\n", notice.c_str());
    for (const std::string& text : template_->end_markers()) {
      if (auto marker = model_->tokenizer->find_token(text)) end_of_turn_.push_back(*marker);
    }
    BatchOptions batch;
    batch.n_parallel = o_.n_parallel;
    batch.n_ctx = o_.model.n_ctx > 0 ? o_.model.n_ctx : model_->model->hparams().n_ctx_train;
    batch.prefill_chunk = o_.prefill_chunk;
    batch.cache_type = o_.cache_type;
    batch.prompt_cache_bytes = o_.prompt_cache_mib << 20;
    batch.allow_beams = !model_->backend->offloads();
    draft_model_ = load_draft_model(o_.speculative, *model_, n_threads);
    if (o_.speculative.enabled()) {
      batch.make_drafter = [this, n_ctx = batch.n_ctx](const GenerationRequest& r) {
        return make_drafter(o_.speculative, draft_model_ ? &*draft_model_ : nullptr, n_ctx, KvCacheOptions{}, r.sampling);
      };
      batch.pass_cost = checking_pass_cost(*model_, n_threads);
    }
    engine_ = std::make_unique<ServingEngine>(*model_->model, *model_->tokenizer, batch, o_.max_queue);
    ready_ = true;
    std::fprintf(stderr, "ringlm: model loaded (%s, %.0f ms); ready\n", model_name_.c_str(), model_->load_ms);
  } catch (const std::exception& e) {
    load_error_ = e.what();
    stopping_ = true;
    stop_http();
  }
}

std::vector<int32_t> Server::chat_prompt(const CompletionRequest& request) const {
  ChatTemplate chat_template = *template_;
  if (request.reasoning_effort) chat_template.set_reasoning_effort(*request.reasoning_effort);
  const std::string_view reply_start = request.tool_required ? forced_call_prefix(chat_template.tool_syntax()) : "";
  try {
    return conversation_prompt(chat_template, *model_->tokenizer, request.messages, request.tools, reply_start);
  } catch (const std::invalid_argument& e) {  // a conversation the template cannot write
    throw ApiError(400, e.what(), "messages");
  }
}

// A reply that must call a tool is held to the calls' grammar: the template's syntax, each
// call's arguments valid under its tool's parameters. One that may call is held to it from the
// call's marker on, where the syntax has one (a lazy grammar).
void Server::tool_call_grammar(const CompletionRequest& request, GenerationRequest& g) const {
  const ToolSyntax syntax = template_->tool_syntax();
  const ToolCallTrigger trigger = tool_call_trigger(syntax);
  if (!request.tool_required && trigger.text.empty()) return;
  try {
    g.grammar = Grammar::parse(
        tool_call_gbnf(syntax, request.tools, request.parallel_tool_calls, /*with_marker=*/!request.tool_required));
  } catch (const GrammarError& e) {
    throw ApiError(400, std::string("'tools': ") + e.what(), "tools");
  }
  if (!request.tool_required) g.grammar_trigger = trigger.text, g.grammar_trigger_at_start = trigger.at_start;
}

GenerationRequest Server::generation_request(const CompletionRequest& request) const {
  GenerationRequest g;
  const Tokenizer& tokenizer = *model_->tokenizer;
  if (request.endpoint == Endpoint::kChat) {
    g.prompt = chat_prompt(request);
    g.end_tokens = end_of_turn_;
  } else {
    g.prompt = tokenizer.encode(request.prompt, tokenizer.add_bos_by_default(), /*parse_special=*/true);
  }
  const char* prompt_field = request.endpoint == Endpoint::kChat ? "messages" : "prompt";
  if (g.prompt.empty()) throw ApiError(400, "the prompt is empty", prompt_field);
  g.sampling = request.sampling;
  g.max_tokens = request.max_tokens.value_or(-1);
  g.stop = request.stop;
  g.n_samples = request.n;
  g.beams = request.beams;
  g.grammar = request.grammar;
  if (!request.tools.empty()) tool_call_grammar(request, g);
  g.length_penalty = request.length_penalty;
  g.top_logprobs = request.logprobs ? request.top_logprobs : -1;
  g.draft_max = request.draft_max.value_or(-1);
  return g;
}

void Server::completions(const httplib::Request& req, httplib::Response& res, Endpoint endpoint) {
  auto in_flight = std::make_shared<InFlight>(in_flight_);
  if (stopping_) throw ApiError(503, "the server is shutting down");
  if (!ready_) throw ApiError(503, "the model is loading");
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::parse_error& e) {
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
  }
  const CompletionRequest request = serve::parse_completion_request(body, endpoint, o_.sampling, req.body);
  GenerationRequest g = generation_request(request);
  const auto prompt_tokens = static_cast<int>(g.prompt.size());
  current_log.prompt_tokens = prompt_tokens;
  std::shared_ptr<RequestStream> stream;
  try {
    stream = engine_->submit(std::move(g));
  } catch (const EngineBusy& e) {
    throw ApiError(503, e.what());
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    const std::string param = what.rfind("n = ", 0) == 0       ? "n"
                              : what.rfind("beam", 0) == 0 ? "best_of"
                              : endpoint == Endpoint::kChat ? "messages"
                                                            : "prompt";
    throw ApiError(400, what, param);
  } catch (const std::logic_error& e) {
    throw ApiError(503, e.what());
  }
  if (request.stream) {
    answer_streaming(std::move(stream), request, prompt_tokens, std::move(in_flight), res);
  } else {
    answer_whole(std::move(stream), request, prompt_tokens, std::move(in_flight), res);
  }
}

serve::TokenInfo Server::token_info(const StreamEvent& e) const {
  serve::TokenInfo t;
  const Tokenizer& tokenizer = *model_->tokenizer;
  t.text = tokenizer.token_to_piece(e.token);
  if (e.logprobs) {
    t.logprob = e.logprobs->chosen.logprob;
    for (const TokenLogprob& alt : e.logprobs->top) t.top.emplace_back(tokenizer.token_to_piece(alt.id), alt.logprob);
  }
  return t;
}

// The choices of a request answered whole, gathered from its stream's events.
struct WholeAnswer {
  WholeAnswer(int n, int prompt_tokens) : choices(static_cast<size_t>(n)), usage{prompt_tokens, 0} {}
  std::vector<serve::Choice> choices;
  serve::Usage usage;
  bool cancelled = false;
};

void Server::gather(std::vector<StreamEvent> events, const CompletionRequest& request, WholeAnswer& answer) const {
  for (StreamEvent& e : events) {
    serve::Choice& c = answer.choices[static_cast<size_t>(e.sample)];
    c.index = e.sample;
    if (e.kind == StreamEvent::Kind::kCancelled) answer.cancelled = true;
    if (e.kind == StreamEvent::Kind::kPiece && e.token >= 0 && request.logprobs) c.tokens.push_back(token_info(e));
    if (e.kind == StreamEvent::Kind::kDone) {
      c.text = e.result.text;
      c.finish_reason = e.result.finish_reason;
      if (request.endpoint == Endpoint::kChat) {  // the answer, the reasoning apart, the tool calls
        ChatReplyDelta parts = ChatReplyReader::read(*template_, !request.tools.empty(), request.tool_required, c.text);
        c.text = std::move(parts.content);
        c.reasoning = std::move(parts.reasoning);
        c.tool_calls = std::move(parts.calls);
        if (!c.tool_calls.empty() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
      }
      answer.usage.completion_tokens += e.result.n_tokens;
    }
  }
}

std::string Server::whole_body(const CompletionRequest& request, const WholeAnswer& answer) const {
  if (answer.cancelled) return serve::error_body(ApiError(503, "the server is shutting down")).dump();
  current_log.completion_tokens = answer.usage.completion_tokens;
  const serve::ResponseHead head{random_id(request.endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-"),
                                 static_cast<int64_t>(std::time(nullptr)), model_name_};
  return serve::completion_response(request, head, answer.choices, answer.usage)
      .dump(-1, ' ', false, json::error_handler_t::replace);
}

void Server::answer_whole(std::shared_ptr<RequestStream> stream, const CompletionRequest& request, int prompt_tokens,
                          std::shared_ptr<InFlight> in_flight, httplib::Response& res) {
  auto answer = std::make_shared<WholeAnswer>(request.n, prompt_tokens);
  // Most answers come within a second: a plain response, its status decided by its outcome.
  const Clock::time_point until = Clock::now() + std::chrono::seconds(1);
  while (!stream->finished() && Clock::now() < until) gather(stream->wait(std::chrono::milliseconds(100)), request, *answer);
  if (stream->finished()) {
    if (answer->cancelled) throw ApiError(503, "the server is shutting down");
    res.status = 200;
    res.set_content(whole_body(request, *answer), "application/json");
    return;
  }
  // A longer one is sent chunked, a space every half second until the JSON (which may begin with
  // whitespace): cpp-httplib tells a handler nothing of a connection the client closed, but a
  // write to it fails, and that cancels the request, so a client that gave up frees its slot.
  res.set_chunked_content_provider(
      "application/json",
      [this, stream, request, answer](size_t, httplib::DataSink& sink) {
        gather(stream->wait(std::chrono::milliseconds(500)), request, *answer);
        if (!stream->finished()) {
          if (sink.write(" ", 1)) return true;
          stream->cancel();
          return false;
        }
        const std::string body = whole_body(request, *answer);
        sink.write(body.data(), body.size());
        sink.done();
        return true;
      },
      [stream, in_flight](bool success) {
        if (!success) stream->cancel();
      });
}

void Server::answer_streaming(std::shared_ptr<RequestStream> stream, const CompletionRequest& request, int prompt_tokens,
                              std::shared_ptr<InFlight> in_flight, httplib::Response& res) {
  struct State {
    serve::ResponseHead head;
    serve::Usage usage;
    bool started = false;
    // Chat: each choice's answer, reasoning and tool calls as its text streams (harmony's
    // channels, Qwen3's <think>, the calls), and how many calls it sent; the completions endpoint
    // sends the text as generated.
    std::vector<ChatReplyReader> parts;
    std::vector<int> calls_sent;
  };
  auto state = std::make_shared<State>();
  if (request.endpoint == Endpoint::kChat) {
    // (One reader made for each choice: a copy would repeat the first one's call ids.)
    for (int i = 0; i < request.n; ++i) state->parts.emplace_back(*template_, !request.tools.empty(), request.tool_required);
    state->calls_sent.assign(static_cast<size_t>(request.n), 0);
  }
  state->head = {random_id(request.endpoint == Endpoint::kChat ? "chatcmpl-" : "cmpl-"),
                 static_cast<int64_t>(std::time(nullptr)), model_name_};
  state->usage.prompt_tokens = prompt_tokens;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");  // proxies must pass each event at once
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, stream, request, state](size_t, httplib::DataSink& sink) {
        const auto send = [&](const json& chunk) {
          const std::string event = serve::sse_event(chunk);
          return sink.write(event.data(), event.size());
        };
        // A piece of one choice's reply: its text (and reasoning) in one chunk, its calls in another.
        const auto send_piece = [&](const ChatReplyDelta& piece, const std::vector<serve::TokenInfo>& tokens, int sample) {
          bool sent = true;
          if (!piece.content.empty() || !piece.reasoning.empty() || !tokens.empty()) {
            sent = send(serve::stream_chunk(request, state->head, sample, piece.content, tokens, "", false, piece.reasoning));
          }
          if (sent && !piece.calls.empty()) {
            int& calls_sent = state->calls_sent[static_cast<size_t>(sample)];
            sent = send(serve::tool_calls_chunk(request, state->head, sample, piece.calls, calls_sent));
            calls_sent += static_cast<int>(piece.calls.size());
          }
          return sent;
        };
        if (!state->started) {  // every choice opens with its role (chat)
          state->started = true;
          if (request.endpoint == Endpoint::kChat) {
            for (int i = 0; i < request.n; ++i) {
              if (!send(serve::stream_chunk(request, state->head, i, "", {}, "", /*role=*/true))) return false;
            }
          }
        }
        for (StreamEvent& e : stream->wait(std::chrono::milliseconds(200))) {
          bool ok = true;
          if (e.kind == StreamEvent::Kind::kPiece) {
            std::vector<serve::TokenInfo> tokens;
            if (e.token >= 0 && request.logprobs) tokens.push_back(token_info(e));
            ChatReplyDelta piece{e.text, "", {}};
            if (!state->parts.empty()) piece = state->parts[static_cast<size_t>(e.sample)].push(e.text);
            ok = send_piece(piece, tokens, e.sample);
          } else if (e.kind == StreamEvent::Kind::kDone) {
            state->usage.completion_tokens += e.result.n_tokens;
            if (!state->parts.empty()) {  // the text held back as a possible marker, and calls read at the end
              ok = send_piece(state->parts[static_cast<size_t>(e.sample)].finish(), {}, e.sample);
            }
            const bool called = !state->calls_sent.empty() && state->calls_sent[static_cast<size_t>(e.sample)] > 0;
            const std::string finish = called && e.result.finish_reason == "stop" ? "tool_calls" : e.result.finish_reason;
            ok = ok && send(serve::stream_chunk(request, state->head, e.sample, "", {}, finish));
          } else {  // cancelled by a shutdown past its grace period
            ok = send(serve::error_body(ApiError(503, "the server is shutting down")));
          }
          if (!ok) {  // the client went away: its slots are free at the next step
            stream->cancel();
            return false;
          }
        }
        if (!sink.is_writable()) {
          stream->cancel();
          return false;
        }
        if (!stream->finished()) return true;
        if (request.include_usage && !send(serve::usage_chunk(request, state->head, state->usage))) return false;
        sink.write(serve::kSseDone, sizeof(serve::kSseDone) - 1);
        current_log.completion_tokens = state->usage.completion_tokens;
        sink.done();
        return true;
      },
      [stream, in_flight](bool success) {
        if (!success) stream->cancel();
      });
}

// Every input in one request to the engine, so that those that fit share its passes.
void Server::embeddings(const httplib::Request& req, httplib::Response& res) {
  const auto in_flight = std::make_shared<InFlight>(in_flight_);
  if (stopping_) throw ApiError(503, "the server is shutting down");
  if (!ready_) throw ApiError(503, "the model is loading");
  const json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw ApiError(400, "the body is not valid JSON");
  const LlamaHparams& hp = model_->model->hparams();
  const serve::EmbeddingRequest request = serve::parse_embedding_request(body, hp.n_embd, hp.n_vocab);
  serve::check_embedding_pooling(hp.pooling);
  std::vector<std::vector<int32_t>> inputs =
      serve::embedding_inputs(request, *model_->tokenizer, o_.model.n_ctx > 0 ? o_.model.n_ctx : hp.n_ctx_train);
  int prompt_tokens = 0;
  for (const auto& tokens : inputs) prompt_tokens += static_cast<int>(tokens.size());
  current_log.prompt_tokens = prompt_tokens;
  std::shared_ptr<RequestStream> stream;
  try {
    stream = engine_->submit_embeddings(std::move(inputs), hp.pooling);
  } catch (const EngineBusy& e) {
    throw ApiError(503, e.what());
  } catch (const std::invalid_argument& e) {
    throw ApiError(400, e.what(), "input");
  } catch (const std::logic_error& e) {
    throw ApiError(503, e.what());
  }
  const std::vector<std::vector<float>> vectors = serve::gather_embeddings(*stream, request.inputs.size());
  send_json(res, 200, serve::embeddings_response(vectors, request.base64, model_name_, prompt_tokens));
}

std::string Server::metrics() const {
  std::ostringstream m;
  const auto metric = [&](const char* name, const char* type, const char* help, double value) {
    m << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << value << '\n';
  };
  metric("ringlm_ready", "gauge", "1 once the model is loaded and requests are taken", ready_ && !stopping_ ? 1 : 0);
  m << "# HELP ringlm_http_requests_total HTTP requests answered, by path and status.\n"
       "# TYPE ringlm_http_requests_total counter\n";
  for (const auto& [key, count] : counter_.snapshot()) {
    m << "ringlm_http_requests_total{path=\"" << key.first << "\",status=\"" << key.second << "\"} " << count << '\n';
  }
  if (engine_ == nullptr) return m.str();
  const EngineStats s = engine_->stats();
  metric("ringlm_requests_finished_total", "counter", "Generation requests finished (cancelled ones not counted).",
         static_cast<double>(s.requests));
  metric("ringlm_prompt_tokens_total", "counter", "Prompt tokens of the requests taken.", static_cast<double>(s.prompt_tokens));
  metric("ringlm_prompt_tokens_reused_total", "counter", "Prompt tokens read from kept prompts instead of prefilled.",
         static_cast<double>(s.reused_prompt_tokens));
  metric("ringlm_generated_tokens_total", "counter", "Tokens generated.", static_cast<double>(s.generated_tokens));
  metric("ringlm_generated_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.", s.tokens_per_second);
  metric("ringlm_sequences_running", "gauge", "Sequences being generated (a request with n samples runs n).", s.running);
  metric("ringlm_requests_queued", "gauge", "Requests waiting for a slot: the queue depth.", s.queued);
  metric("ringlm_parallel_slots", "gauge", "Sequences that run together (--parallel).", s.n_parallel);
  metric("ringlm_kv_cache_bytes", "gauge", "KV cache memory the running sequences hold.", static_cast<double>(s.kv_bytes));
  metric("ringlm_prompt_cache_bytes", "gauge", "KV cache memory of the prompts kept for reuse.",
         static_cast<double>(s.prompt_cache_bytes));
  metric("ringlm_draft_tokens_total", "counter", "Speculative decoding: tokens drafted (--lookup, -md).",
         static_cast<double>(s.speculation.drafted));
  metric("ringlm_draft_tokens_accepted_total", "counter", "Speculative decoding: drafted tokens accepted.",
         static_cast<double>(s.speculation.accepted));
  metric("ringlm_draft_acceptance_ratio", "gauge", "Speculative decoding: drafted tokens accepted, over those drafted.",
         s.speculation.acceptance());
  return m.str();
}

void Server::route() {
  http_.new_task_queue = [this] {
    return new httplib::ThreadPool(static_cast<size_t>(o_.http_threads > 0 ? o_.http_threads : 4 * o_.n_parallel + 16));
  };
  http_.set_payload_max_length(o_.max_body_bytes);
  http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    current_log = RequestLog{Clock::now(), 0, 0};
    // A load balancer's health check carries no key.
    if (o_.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    const std::string prefix = "Bearer ";
    const bool ok = auth.rfind(prefix, 0) == 0 && same_secret(auth.substr(prefix.size()), o_.api_key);
    if (ok) return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError(401, auth.empty() ? "no API key: send the header 'Authorization: Bearer <key>'"
                                               : "the API key is wrong"));
    return httplib::Server::HandlerResponse::Handled;
  });
  // Errors the library answers itself (413, 404, ...) get OpenAI's error object too.
  http_.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string what = res.status == 413   ? "the request body is larger than the server takes (--max-body)"
                             : res.status == 404 ? "no such endpoint: " + req.method + " " + req.path
                             : res.status == 405 ? "method not allowed: " + req.method + " " + req.path
                                                 : "HTTP error " + std::to_string(res.status);
    send_json(res, res.status, serve::error_body(ApiError(res.status, what)));
  });
  http_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, e.what()));
    }
  });
  http_.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    // Paths the server does not serve are counted together: a scan must not grow the table.
    const bool known = (req.path.rfind("/v1/", 0) == 0 || req.path == "/health" || req.path == "/metrics" ||
                        req.path == "/tokenize" || req.path == "/detokenize" || req.path == "/completions" ||
                        req.path == "/chat/completions" || req.path == "/models" || req.path == "/embeddings");
    counter_.count(known && res.status != 404 ? req.path : "other", res.status);
    const bool timed = current_log.start != Clock::time_point{};
    const double ms = timed ? std::chrono::duration<double, std::milli>(Clock::now() - current_log.start).count() : 0.0;
    std::fprintf(stderr, "ringlm: %s %s %d prompt=%d completion=%d %.1f ms\n", req.method.c_str(), req.path.c_str(),
                 res.status, current_log.prompt_tokens, current_log.completion_tokens, ms);
    current_log = RequestLog{};
  });

  const auto chat = [this](const httplib::Request& req, httplib::Response& res) { completions(req, res, Endpoint::kChat); };
  const auto complete = [this](const httplib::Request& req, httplib::Response& res) {
    completions(req, res, Endpoint::kCompletion);
  };
  http_.Post("/v1/chat/completions", chat);
  http_.Post("/chat/completions", chat);
  http_.Post("/v1/completions", complete);
  http_.Post("/completions", complete);
  const auto embed = [this](const httplib::Request& req, httplib::Response& res) { embeddings(req, res); };
  http_.Post("/v1/embeddings", embed);
  http_.Post("/embeddings", embed);
  const auto models = [this](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "ringlm"}};
    if (ready_) model.update(serve::pooling_fields(model_->model->hparams().pooling, model_->model->hparams().pooling_from_file));
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  };
  http_.Get("/v1/models", models);
  http_.Get("/models", models);
  http_.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping_) return send_json(res, 503, {{"status", "shutting down"}});
    if (!ready_) return send_json(res, 503, {{"status", "loading"}});
    send_json(res, 200, {{"status", "ok"}});
  });
  http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4");
  });
  http_.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!ready_) throw ApiError(503, "the model is loading");
    const json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (!body.is_object() || !body.contains("content") || !body["content"].is_string()) {
      throw ApiError(400, "'content': a string is required", "content");
    }
    const bool add_special = body.value("add_special", false);
    const bool parse_special = body.value("parse_special", true);
    const std::vector<int32_t> ids =
        model_->tokenizer->encode(body["content"].get<std::string>(), add_special && model_->tokenizer->add_bos_by_default(),
                                  parse_special);
    send_json(res, 200, {{"tokens", ids}});
  });
  http_.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!ready_) throw ApiError(503, "the model is loading");
    const json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
      throw ApiError(400, "'tokens': an array of token ids is required", "tokens");
    }
    std::vector<int32_t> ids;
    for (const json& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= model_->tokenizer->n_vocab()) {
        throw ApiError(400, "'tokens': " + t.dump() + " is not a token id of this model", "tokens");
      }
      ids.push_back(t.get<int32_t>());
    }
    send_json(res, 200, {{"content", model_->tokenizer->decode(ids)}});
  });
}

// The signal handler's only work: one byte into a pipe, which the shutdown thread reads. A handler
// (not a blocked mask and sigwait) so that the signal is caught whichever thread the kernel picks,
// including threads the libraries started before serve did.
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int signal) {
  const char byte = static_cast<char>(signal);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
}

void Server::shut_down_on_signal() {
  char signal = 0;
  while (::read(g_signal_pipe[0], &signal, 1) < 0 && errno == EINTR) {
  }
  if (signal == 0) return;  // the server stopped by itself (the model did not load)
  signal_received_ = true;
  stopping_ = true;  // new requests get 503, /health says so to the load balancer
  std::fprintf(stderr, "ringlm: %s: taking no new requests; finishing the running ones (at most %d s)\n",
               signal == SIGINT ? "SIGINT" : "SIGTERM", o_.shutdown_grace_s);
  const auto deadline = Clock::now() + std::chrono::seconds(o_.shutdown_grace_s);
  if (engine_) engine_->stop(deadline);
  // The streams' last events are written by the HTTP threads: wait for them (bounded), then close.
  while (in_flight_ > 0 && Clock::now() < deadline + std::chrono::seconds(2)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  stop_http();
}

void Server::stop_http() {
  // listen_after_bind() may not have started yet (a stop() before it would be lost); it may also
  // have ended already: wait for it a bounded time.
  for (int i = 0; i < 1000 && !http_.is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  http_.stop();
}

void Server::run() {
  model_name_ = !o_.alias.empty() ? o_.alias : std::filesystem::path(resolve_model_path(o_.model.model_path)).filename().string();
  created_ = static_cast<int64_t>(std::time(nullptr));
  if (::pipe(g_signal_pipe) != 0) throw std::runtime_error("cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a client that went away is a failed write, not the end of the server
  route();
  const int port = o_.port == 0 ? http_.bind_to_any_port(o_.host) : (http_.bind_to_port(o_.host, o_.port) ? o_.port : -1);
  if (port < 0) throw std::runtime_error("cannot listen on " + o_.host + ":" + std::to_string(o_.port) + " (in use, or not an address here)");
  std::fprintf(stderr, "ringlm: listening on http://%s:%d (loading the model)\n", o_.host.c_str(), port);
  std::thread signal_thread([this] { shut_down_on_signal(); });
  std::thread loader([this] { load(); });
  http_.listen_after_bind();
  loader.join();
  stopping_ = true;
  if (!signal_received_) {  // end the shutdown thread, which waits for a signal that never came
    const char none = 0;
    [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &none, 1);
  }
  signal_thread.join();
  if (engine_) engine_->stop(Clock::now());
  if (!load_error_.empty()) throw std::runtime_error(load_error_);
  if (model_) model_->model->close_pipeline();  // the other ranks end with the server
  std::fprintf(stderr, "ringlm: stopped\n");
}

}  // namespace

namespace {
// A later rank of `mpirun ... ringlm serve`: its layers, and the passes rank 0's server runs.
void serve_later_rank(const ServeOptions& o) {
  const int n_threads = resolve_threads(o.model.n_threads);
  omp_set_num_threads(n_threads);
  PipelineProcess& process = this_process();
  refuse_drafts_with_kivi(o.speculative, o.cache_type);
  LoadedModel m = load_model(o.model, n_threads, stage_picker(process, o.model.layer_split));
  serve_as_later_rank(process, m);
}
}  // namespace

void add_serve_command(CLI::App& app) {
  auto opts = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "an OpenAI-compatible HTTP server (chat and text completions, streaming; tool calls; embeddings)");
  add_model_options(*cmd, opts->model);
  add_sampling_options(*cmd, opts->sampling);
  cmd->add_option("--host", opts->host, "address to listen on (127.0.0.1: this machine only)")->capture_default_str();
  cmd->add_option("--port", opts->port, "port to listen on (0: any free one)")->check(CLI::Range(0, 65535))->capture_default_str();
  cmd->add_option("--parallel", opts->n_parallel, "sequences generated together")->check(CLI::Range(1, 256))->capture_default_str();
  cmd->add_option("--prefill-chunk", opts->prefill_chunk, "prompt tokens per step")->check(CLI::Range(1, 4096))->capture_default_str();
  cmd->add_option("--max-queue", opts->max_queue, "requests waiting for a slot before 503")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  cmd->add_option("--max-body", opts->max_body_bytes, "largest request body in bytes (413 beyond)")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--prompt-cache", opts->prompt_cache_mib, "MiB of KV cache kept for prompts later requests begin with (0: none)")
      ->capture_default_str();
  cmd->add_option("--shutdown-grace", opts->shutdown_grace_s, "seconds the running requests get to finish on SIGINT/SIGTERM")
      ->check(CLI::Range(0, 3600))
      ->capture_default_str();
  cmd->add_option("--http-threads", opts->http_threads, "connections served at once (0: 4 x --parallel + 16)")
      ->check(CLI::Range(0, 4096));
  auto* key = cmd->add_option("--api-key", opts->api_key, "require 'Authorization: Bearer KEY' (default: $RINGLM_API_KEY)");
  add_speculative_options(*cmd, opts->speculative, "each prompt and its text so far");
  cmd->add_option("--alias", opts->alias, "the model's name in the API (default: the file name)");
  cmd->add_option("--chat-template", opts->chat_template, "chat format, instead of the model's");
  add_cache_type_options(*cmd, opts->cache_type);
  opts->model.n_ctx = 4096;
  cmd->callback([opts, key] {
    if (key->count() == 0) {
      if (const char* env = std::getenv("RINGLM_API_KEY"); env != nullptr) opts->api_key = env;
    }
    // Under mpirun, rank 0 serves HTTP; the other ranks load their layers and run its passes.
    if (this_process().rank() != 0) return serve_later_rank(*opts);
    Server server(*opts);
    server.run();
  });
}

}  // namespace ringlm
