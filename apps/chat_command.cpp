// ringlm chat: a conversation with the model in the terminal, or driven line by line through a
// pipe. The conversation lives in the KV cache (core/session); this file is the user interface:
// reading messages, the slash commands, streaming replies, Ctrl-C.
#include "apps/chat_command.h"

#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "apps/chat_input.h"
#include "apps/common_options.h"
#include "apps/speculative_options.h"
#include "core/model/loader.h"
#include "core/session/chat_session.h"

namespace ringlm {

namespace {

struct ChatOptions {
  ModelOptions model;
  KvCacheOptions cache;
  SamplingParams sampling;
  std::string system;
  bool system_given = false;
  std::string chat_template;  // "" : from the model
  std::string reasoning_effort = "medium";  // harmony's (gpt-oss)
  int n_predict = -1;
  SpeculativeOptions speculative;
};

constexpr const char* kHelp =
    "Commands:\n"
    "  /help             this list\n"
    "  /reset            forget the conversation (the system prompt stays)\n"
    "  /system [TEXT]    show, or replace, the system prompt (the conversation is prefilled again under it)\n"
    "  /stats [json]     tokens in the context, context shifts, speed of the last reply, memory\n"
    "  /save FILE        write the conversation to FILE as JSON\n"
    "  /load FILE        read a conversation saved by /save and prefill it into the context\n"
    "  /exit             quit (also Ctrl-D, or Ctrl-C twice at an empty prompt)\n"
    "End a line with \\ to continue the message on the next line; a pasted block is one message.\n"
    "Ctrl-C stops the reply being written.\n";

// "/name argument text" -> {"/name", "argument text"} (the argument trimmed).
std::pair<std::string, std::string> split_command(const std::string& line) {
  const size_t name_end = std::min(line.find_first_of(" \t\n"), line.size());
  const size_t arg_begin = std::min(line.find_first_not_of(" \t\n", name_end), line.size());
  const size_t arg_end = line.find_last_not_of(" \t\n");
  const std::string arg = arg_begin < line.size() ? line.substr(arg_begin, arg_end + 1 - arg_begin) : "";
  return {line.substr(0, name_end), arg};
}

double per_second(int n, double ms) { return ms > 0 ? 1000.0 * n / ms : 0.0; }
double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// Resident memory of this process (VmRSS), in bytes; 0 where /proc is unavailable.
size_t resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      size_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

// The chat template: --chat-template, else recognised from the model's own, else ChatML.
ChatTemplate choose_template(const ChatOptions& o, const LoadedModel& m) {
  std::string notice;
  ChatTemplate t = chat_template_for(*m.gguf, *m.tokenizer, o.chat_template, notice);
  if (!notice.empty()) std::fprintf(stderr, "ringlm: %s\n", notice.c_str());
  t.set_reasoning_effort(o.reasoning_effort);
  return t;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A role/content object; std::runtime_error naming `where` otherwise.
ChatMessage parse_message(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("role") || !j.contains("content") || !j["role"].is_string() ||
      !j["content"].is_string()) {
    throw std::runtime_error(where + ": expected an object {\"role\": \"...\", \"content\": \"...\"} with string values");
  }
  return {j["role"].get<std::string>(), j["content"].get<std::string>()};
}

// A conversation file: what /save writes ({"messages": [...]}), or a bare array of messages.
std::vector<ChatMessage> parse_conversation(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error("'" + path + "' is not valid JSON: " + e.what());
  }
  const nlohmann::json& list = j.is_object() && j.contains("messages") ? j["messages"] : j;
  if (!list.is_array()) throw std::runtime_error("'" + path + "': expected {\"messages\": [...]} or an array of messages");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list.size(); ++i) {
    messages.push_back(parse_message(list[i], "'" + path + "' message " + std::to_string(i)));
  }
  return messages;
}

// Written next to the target and renamed over it: an interrupted save leaves the old file whole.
void save_conversation(const ChatSession& session, const std::string& path) {
  nlohmann::json messages = nlohmann::json::array();
  for (const ChatMessage& m : session.messages()) messages.push_back({{"role", m.role}, {"content", m.content}});
  const nlohmann::json doc = {{"ringlm_chat", 1},
                              {"template", std::string(session.chat_template().name())},
                              {"messages", messages}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error("cannot write '" + tmp + "'");
    out << doc.dump(2) << '\n';
    if (!out.flush()) throw std::runtime_error("cannot write '" + tmp + "'");
  }
  std::filesystem::rename(tmp, path);
}

class ChatApp {
 public:
  ChatApp(const ChatOptions& o, LoadedModel& m, Drafter* drafter, ChatInput& input)
      : options_(o),
        model_(m),
        input_(input),
        session_(*m.model, *m.tokenizer, choose_template(o, m), session_options(o, m, drafter)) {
    const std::string system = o.system_given ? o.system : session_.chat_template().default_system_prompt();
    if (!system.empty()) session_.set_system(system);
  }

  void run() {
    if (input_.is_terminal()) print_banner();
    bool last_was_interrupt = false;  // Ctrl-C twice in a row at an empty prompt quits
    while (true) {
      const InputEvent event = input_.read();
      if (event.kind == InputEvent::Kind::kEnd) return;
      if (event.kind == InputEvent::Kind::kInterrupt) {
        if (event.text.empty() && last_was_interrupt) return;
        if (event.text.empty()) std::fprintf(stderr, "(Ctrl-C again, Ctrl-D or /exit to quit)\n");
        last_was_interrupt = event.text.empty();
        continue;
      }
      last_was_interrupt = false;
      const std::string& text = event.text;
      if (text.empty()) continue;
      try {
        if (text[0] == '/') {
          if (!run_command(text)) return;
        } else if (text[0] == '{' && !input_.is_terminal()) {
          if (!take_json_line(text)) return;
        } else {
          last_was_interrupt = send(text);
        }
      } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "ringlm: %s\n", e.what());
      }
    }
  }

 private:
  static ChatSessionOptions session_options(const ChatOptions& o, const LoadedModel& m, Drafter* drafter) {
    ChatSessionOptions s;
    s.n_ctx = o.model.n_ctx > 0 ? o.model.n_ctx : m.model->hparams().n_ctx_train;
    s.cache = o.cache;
    s.sampling = o.sampling;
    s.n_predict = o.n_predict;
    s.drafter = drafter;
    if (drafter != nullptr) s.pass_cost = checking_pass_cost(m, resolve_threads(o.model.n_threads));
    return s;
  }

  void print_banner() const {
    std::fprintf(stderr,
                 "ringlm chat: %s | template %.*s | context %d tokens, %d kept for the system prompt\n"
                 "/help lists the commands; Ctrl-C stops a reply; Ctrl-D or /exit quits.\n",
                 std::filesystem::path(resolve_model_path(options_.model.model_path)).filename().c_str(),
                 static_cast<int>(session_.chat_template().name().size()), session_.chat_template().name().data(),
                 session_.cache().capacity(), session_.cache().n_keep());
  }

  // One user turn: stream the reply. Returns whether Ctrl-C stopped it.
  //
  // The reasoning of a format with channels (harmony) is shown dimmed before the answer when
  // stdout is a terminal, and not at all otherwise: piped, stdout carries the answers only.
  bool send(const std::string& message) {
    interrupt_requested().store(false);
    const auto write = [](std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
    bool in_reasoning = false;
    const auto show_reasoning = [&](std::string_view piece) {
      if (!in_reasoning) std::fputs("\033[2m", stdout);  // dim
      in_reasoning = true;
      write(piece);
    };
    const auto end_reasoning = [&](const char* after) {
      if (in_reasoning) std::fprintf(stdout, "\033[0m%s", after);
      in_reasoning = false;
    };
    last_ = session_.reply(
        message,
        [&](std::string_view piece) {
          end_reasoning("\n");
          write(piece);
        },
        &interrupt_requested(), show_reasoning_ ? std::function<void(std::string_view)>(show_reasoning) : nullptr);
    end_reasoning("");
    std::fputc('\n', stdout);
    std::fflush(stdout);
    has_last_ = true;
    const bool interrupted = last_.stop_reason == "interrupted";
    interrupt_requested().store(false);
    return interrupted;
  }

  // A line of JSON in pipe mode: {"role": "user" | "system", "content": "..."}.
  bool take_json_line(const std::string& line) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw std::runtime_error(std::string("invalid JSON line: ") + e.what());
    }
    const ChatMessage m = parse_message(j, "JSON line");
    if (m.role == "user") {
      send(m.content);
    } else if (m.role == "system") {
      session_.set_system(m.content);
    } else {
      throw std::runtime_error("JSON line: role \"" + m.role +
                               "\" cannot be sent (use \"user\" or \"system\"; /load restores a whole conversation)");
    }
    return true;
  }

  // Returns false to quit.
  bool run_command(const std::string& line) {
    const auto [name, arg] = split_command(line);
    if (name == "/exit" || name == "/quit") return false;
    if (name == "/help") {
      say("%s", kHelp);
    } else if (name == "/reset") {
      session_.reset();
      has_last_ = false;
      say("%s", "(conversation forgotten)\n");
    } else if (name == "/system") {
      if (arg.empty()) {
        say("%s\n", session_.system().empty() ? "(no system prompt)" : session_.system().c_str());
      } else {
        session_.set_system(arg);
        say("(system prompt set: %d tokens kept as sinks; %zu tokens in the context)\n", session_.cache().n_keep(),
            session_.context().size());
      }
    } else if (name == "/stats") {
      print_stats(arg == "json");
    } else if (name == "/save") {
      if (arg.empty()) throw std::runtime_error("/save needs a file name");
      save_conversation(session_, arg);
      say("(saved %zu messages to %s)\n", session_.messages().size(), arg.c_str());
    } else if (name == "/load") {
      if (arg.empty()) throw std::runtime_error("/load needs a file name");
      int tokens = 0;
      try {
        tokens = session_.load(parse_conversation(read_file(arg), arg));
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error("'" + arg + "': " + e.what());
      }
      has_last_ = false;
      say("(loaded %zu messages from %s: %d tokens prefilled)\n", session_.messages().size(), arg.c_str(), tokens);
    } else {
      throw std::runtime_error("unknown command " + name + " (/help lists them)");
    }
    return true;
  }

  // Command output: stdout on a terminal; stderr in pipe mode, where stdout carries only replies.
  template <typename... Args>
  void say(const char* format, Args... args) const {
    std::FILE* out = input_.is_terminal() ? stdout : stderr;
    std::fprintf(out, format, args...);
    std::fflush(out);
  }

  void print_stats(bool as_json) const {
    const KvCache& cache = session_.cache();
    const size_t rss = resident_bytes();
    if (as_json) {
      nlohmann::json j = {{"context_tokens", cache.size()},
                          {"context_size", cache.capacity()},
                          {"kept_tokens", cache.n_keep()},
                          {"system_tokens", session_.system_tokens()},
                          {"shifts", cache.shifts()},
                          {"discarded_tokens", cache.discarded()},
                          {"evaluated_tokens", session_.evaluated_total()},
                          {"messages", session_.messages().size()},
                          {"kv_cache_bytes", cache.bytes()},
                          {"weight_bytes", model_.model->weight_bytes()},
                          {"rss_bytes", rss}};
      if (has_last_) {
        j["last_turn"] = {{"prefill_tokens", last_.prefill_tokens}, {"prefill_ms", last_.prefill_ms},
                          {"reply_tokens", last_.reply_tokens},     {"reply_ms", last_.reply_ms},
                          {"reply_tps", per_second(last_.reply_tokens, last_.reply_ms)},
                          {"rewritten_tokens", last_.rewritten_tokens}, {"rewrite_ms", last_.rewrite_ms},
                          {"stop", last_.stop_reason}};
      }
      say("%s\n", j.dump().c_str());
      return;
    }
    say("context   %d of %d tokens; %d kept as sinks (system prompt: %d); %lld shifts dropped %lld tokens\n",
        cache.size(), cache.capacity(), cache.n_keep(), session_.system_tokens(), static_cast<long long>(cache.shifts()),
        static_cast<long long>(cache.discarded()));
    if (has_last_) {
      say("last turn %d new tokens prefilled in %.0f ms (%.1f t/s); reply %d tokens in %.0f ms (%.1f t/s), stop: %s\n",
          last_.prefill_tokens, last_.prefill_ms, per_second(last_.prefill_tokens, last_.prefill_ms), last_.reply_tokens,
          last_.reply_ms, per_second(last_.reply_tokens, last_.reply_ms), last_.stop_reason.c_str());
      if (last_.rewritten_tokens > 0) {
        say("          the reply as the template writes it (the answer alone) evaluated in its place: %d tokens in %.0f ms\n",
            last_.rewritten_tokens, last_.rewrite_ms);
      }
    }
    say("memory    KV cache %.1f MiB (%s), weights %.1f MiB, resident %.1f MiB\n", mib(static_cast<double>(cache.bytes())),
        kv_types_name(cache.type()).c_str(), mib(static_cast<double>(model_.model->weight_bytes())),
        mib(static_cast<double>(rss)));
  }

  const ChatOptions& options_;
  LoadedModel& model_;
  ChatInput& input_;
  ChatSession session_;
  ChatTurnStats last_;
  bool has_last_ = false;
  const bool show_reasoning_ = isatty(STDOUT_FILENO) != 0;
};

std::string history_file() {
  if (const char* env = std::getenv("RINGLM_CHAT_HISTORY"); env != nullptr) return env;  // "" turns it off
  return (ringlm_cache_dir() / "chat_history").string();
}

void chat(const ChatOptions& o) {
  const int n_threads = resolve_threads(o.model.n_threads);
  omp_set_num_threads(n_threads);
  refuse_drafts_with_kivi(o.speculative, o.cache.type);
  LoadedModel m = load_model(o.model, n_threads);
  std::optional<LoadedModel> draft_model = load_draft_model(o.speculative, m, n_threads);
  const int n_ctx = o.model.n_ctx > 0 ? o.model.n_ctx : m.model->hparams().n_ctx_train;
  const std::unique_ptr<Drafter> drafter =
      make_drafter(o.speculative, draft_model ? &*draft_model : nullptr, n_ctx, o.cache, o.sampling);
  std::unique_ptr<ChatInput> input = isatty(STDIN_FILENO) ? make_terminal_input(history_file()) : make_pipe_input();
  ChatApp app(o, m, drafter.get(), *input);
  install_interrupt_handler();
  app.run();
}

}  // namespace

void add_chat_command(CLI::App& app) {
  auto opts = std::make_shared<ChatOptions>();
  CLI::App* cmd = app.add_subcommand("chat", "chat with the model (a terminal, or one message per line of stdin)");
  add_model_options(*cmd, opts->model);
  add_sampling_options(*cmd, opts->sampling);
  add_kv_cache_options(*cmd, opts->cache);
  auto* system = cmd->add_option("--system", opts->system,
                                 "system prompt (default: the one the chat template writes when there is none, if any)");
  std::vector<std::string> names;
  for (std::string_view n : ChatTemplate::names()) names.emplace_back(n);
  cmd->add_option("--chat-template", opts->chat_template, "chat format, instead of the one recognised from the model")
      ->check(CLI::IsMember(names));
  cmd->add_option("--reasoning-effort", opts->reasoning_effort,
                  "how long gpt-oss thinks before it answers (its harmony system message's 'Reasoning:')")
      ->check(CLI::IsMember({"low", "medium", "high"}))
      ->capture_default_str();
  cmd->add_option("-n,--n-predict", opts->n_predict, "most tokens per reply (-1: until the end of the turn)")
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
  add_speculative_options(*cmd, opts->speculative, "the conversation");
  cmd->callback([opts, system] {
    opts->system_given = system->count() > 0;
    chat(*opts);
  });
}

}  // namespace ringlm
