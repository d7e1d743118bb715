// ringlm batch: a file of prompts through the model with continuous batching
// (core/scheduler), results as JSON lines written the moment each sequence finishes. Running
// again with the same output file skips what it already holds, so an interrupted run resumes.
#include "apps/batch_command.h"

#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>

#include "apps/common_options.h"
#include "apps/pipeline_process.h"
#include "apps/speculative_options.h"
#include "core/grammar/json_schema.h"
#include "core/model/loader.h"
#include "core/scheduler/batch_scheduler.h"
#include "core/session/chat_session.h"
#include "core/session/reply_parser.h"

namespace ringlm {

namespace {

using json = nlohmann::json;

struct BatchCommandOptions {
  ModelOptions model;
  SamplingParams sampling;
  std::string input, output;
  int n_parallel = 4;
  int max_tokens = 256;
  int prefill_chunk = 64;
  bool share_prompt = true;
  std::string chat_template;
  SpeculativeOptions speculative;
  KvTypes cache_type = KvType::kF16;
  int beams = 0;  // every line's beams unless it says (0: sampling)
  float length_penalty = 1.0f;
  GrammarOptions grammar;  // every line's grammar unless it gives "grammar" or "json_schema"
};

// One line of the input, ready to run (or the reason it cannot).
struct InputLine {
  int line = 0;            // 1-based
  json id;                 // the line's "id" (null when unreadable), or the line number for plain text
  std::string error;       // non-empty: an error record instead of a run
  GenerationRequest request;
  // A "messages" line whose format keeps the reasoning apart (harmony, think tags): its reply is
  // written as "text" (the answer) and "reasoning", as serve's content and reasoning_content.
  std::shared_ptr<const ChatTemplate> reply_format;
};

std::atomic<bool> g_stop{false};
void on_sigint(int) { g_stop.store(true); }

template <typename T>
T field_or(const json& j, const char* key, T fallback, const char* type_name) {
  if (!j.contains(key)) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    throw std::runtime_error(std::string("\"") + key + "\" must be " + type_name);
  }
}

std::vector<std::string> stop_strings(const json& j) {
  if (!j.contains("stop")) return {};
  const json& s = j["stop"];
  if (s.is_string()) return {s.get<std::string>()};
  if (s.is_array() && std::all_of(s.begin(), s.end(), [](const json& x) { return x.is_string(); })) {
    return s.get<std::vector<std::string>>();
  }
  throw std::runtime_error("\"stop\" must be a string or an array of strings");
}

class InputReader {
 public:
  InputReader(const BatchCommandOptions& o, const LoadedModel& m) : options_(o), model_(m), base_grammar_(grammar_of(o.grammar)) {}

  std::vector<InputLine> read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read input file '" + path + "'");
    std::vector<InputLine> lines;
    std::string text;
    int number = 0;
    std::optional<bool> json_lines;  // decided by the first non-empty line
    while (std::getline(in, text)) {
      ++number;
      if (!text.empty() && text.back() == '\r') text.pop_back();
      if (text.find_first_not_of(" \t") == std::string::npos) continue;
      if (!json_lines) json_lines = text[text.find_first_not_of(" \t")] == '{';
      lines.push_back(*json_lines ? parse_json_line(text, number) : plain_line(text, number));
    }
    return lines;
  }

 private:
  InputLine plain_line(const std::string& text, int number) {
    InputLine l;
    l.line = number;
    l.id = number;
    try {
      l.request = base_request();
      l.request.prompt = encode(text);
    } catch (const std::exception& e) {
      l.error = e.what();
    }
    return l;
  }

  InputLine parse_json_line(const std::string& text, int number) {
    InputLine l;
    l.line = number;
    try {
      const json j = json::parse(text);
      if (!j.is_object()) throw std::runtime_error("expected a JSON object");
      l.id = j.contains("id") ? j["id"] : json(number);  // no "id": the line number
      l.request = base_request();
      if (j.contains("prompt") == j.contains("messages")) throw std::runtime_error("needs exactly one of \"prompt\" and \"messages\"");
      l.request.prompt = j.contains("prompt") ? encode(field_or<std::string>(j, "prompt", "", "a string"))
                                              : encode_messages(j["messages"]);
      if (j.contains("messages") && (template_->has_channels() || template_->has_think_tags())) l.reply_format = template_;
      GenerationRequest& r = l.request;
      r.max_tokens = field_or<int>(j, "max_tokens", r.max_tokens, "an integer");
      r.sampling.temperature = field_or<float>(j, "temperature", r.sampling.temperature, "a number");
      r.sampling.top_p = field_or<float>(j, "top_p", r.sampling.top_p, "a number");
      r.sampling.seed = field_or<uint64_t>(j, "seed", r.sampling.seed, "a non-negative integer");
      r.n_samples = field_or<int>(j, "n", 1, "an integer");
      r.beams = field_or<int>(j, "beams", r.beams, "an integer");
      r.length_penalty = field_or<float>(j, "length_penalty", r.length_penalty, "a number");
      r.stop = stop_strings(j);
      if (j.contains("grammar") || j.contains("json_schema")) r.grammar = line_grammar(j);
      if (r.beams < 0) throw std::runtime_error("\"beams\" must not be negative");
      if (r.max_tokens < 0) throw std::runtime_error("\"max_tokens\" must not be negative");
      if (!(r.sampling.temperature >= 0)) throw std::runtime_error("\"temperature\" must not be negative");
      if (!(r.sampling.top_p >= 0 && r.sampling.top_p <= 1)) throw std::runtime_error("\"top_p\" must be in [0, 1]");
    } catch (const json::parse_error& e) {
      l.error = std::string("invalid JSON: ") + e.what();
    } catch (const std::exception& e) {
      l.error = e.what();
    }
    return l;
  }

  // A line's "grammar" (GBNF text) or "json_schema" (a schema object), compiled once per text.
  std::shared_ptr<const Grammar> line_grammar(const json& j) {
    if (j.contains("grammar") && j.contains("json_schema")) throw std::runtime_error("give \"grammar\" or \"json_schema\", not both");
    const bool gbnf = j.contains("grammar");
    const json& given = gbnf ? j["grammar"] : j["json_schema"];
    if (gbnf && !given.is_string()) throw std::runtime_error("\"grammar\" must be a string (GBNF)");
    const std::string key = (gbnf ? "g" : "s") + (gbnf ? given.get<std::string>() : given.dump());
    std::shared_ptr<const Grammar>& compiled = grammars_[key];
    if (!compiled) compiled = gbnf ? Grammar::parse(given.get<std::string>()) : Grammar::parse(json_schema_to_gbnf(given));
    return compiled;
  }

  GenerationRequest base_request() const {
    GenerationRequest r;
    r.grammar = base_grammar_;
    r.sampling = options_.sampling;
    r.max_tokens = options_.max_tokens;
    r.beams = options_.beams;
    r.length_penalty = options_.length_penalty;
    return r;
  }

  std::vector<int32_t> encode(const std::string& text) const {
    return model_.tokenizer->encode(text, model_.tokenizer->add_bos_by_default(), /*parse_special=*/true);
  }

  // The chat template applied to a conversation, the reply header last.
  std::vector<int32_t> encode_messages(const json& list) {
    if (!list.is_array()) throw std::runtime_error("\"messages\" must be an array");
    std::vector<ChatMessage> messages;
    for (const json& m : list) {
      if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
          !m["content"].is_string()) {
        throw std::runtime_error("each message must be {\"role\": \"...\", \"content\": \"...\"}");
      }
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    if (messages.empty() || messages.back().role != "user") throw std::runtime_error("\"messages\" must end with a user message");
    return conversation_prompt(chat_template(), *model_.tokenizer, std::move(messages));
  }

  const ChatTemplate& chat_template() {
    if (!template_) {
      std::string notice;
      template_ = std::make_shared<const ChatTemplate>(
          chat_template_for(*model_.gguf, *model_.tokenizer, options_.chat_template, notice));
      if (!notice.empty()) std::fprintf(stderr, "ringlm: %s\n", notice.c_str());
    }
    return *template_;
  }

  const BatchCommandOptions& options_;
  const LoadedModel& model_;
  std::shared_ptr<const Grammar> base_grammar_;  // --grammar and co: every line's unless it gives its own
  std::map<std::string, std::shared_ptr<const Grammar>> grammars_;  // the lines' own, compiled, by text
  std::shared_ptr<const ChatTemplate> template_;
};

// What an earlier run already wrote: result lines per id (by sample) and error lines.
struct Done {
  std::map<std::string, std::set<int>> samples;  // id (as JSON text) -> sample indexes written
  std::set<std::string> errors;                  // ids (as JSON text) with an error record
  std::set<int> error_lines;                     // lines whose error record has no id
};

// Reads the records of an earlier run and cuts a last line that a crash left unfinished.
Done read_done(const std::string& path) {
  Done done;
  if (!std::filesystem::exists(path)) return done;
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t complete = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
  if (complete < text.size()) std::filesystem::resize_file(path, complete);
  size_t begin = 0;
  while (begin < complete) {
    const size_t end = text.find('\n', begin);
    const json j = json::parse(text.begin() + static_cast<ptrdiff_t>(begin), text.begin() + static_cast<ptrdiff_t>(end),
                               nullptr, /*allow_exceptions=*/false);
    begin = end + 1;
    if (!j.is_object()) continue;
    if (j.contains("error")) {
      if (j.contains("id")) done.errors.insert(j["id"].dump());
      else if (j.contains("line") && j["line"].is_number_integer()) done.error_lines.insert(j["line"].get<int>());
    } else if (j.contains("id")) {
      const std::string id = j["id"].dump();
      done.samples[id].insert(j.value("sample", 0));
    }
  }
  return done;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

double mib(size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

class BatchRun {
 public:
  BatchRun(const BatchCommandOptions& o, LoadedModel& m, LoadedModel* draft) : options_(o), model_(m), draft_(draft) {}

  int run() {
    std::vector<InputLine> lines = InputReader(options_, model_).read(options_.input);
    const Done done = read_done(options_.output);
    out_ = std::fopen(options_.output.c_str(), "ab");
    if (out_ == nullptr) throw std::runtime_error("cannot write output file '" + options_.output + "'");

    BatchOptions bo;
    bo.n_parallel = options_.n_parallel;
    bo.cache_type = options_.cache_type;
    bo.n_ctx = options_.model.n_ctx > 0 ? options_.model.n_ctx : model_.model->hparams().n_ctx_train;
    bo.prefill_chunk = options_.prefill_chunk;
    bo.share_prompt = options_.share_prompt;
    bo.allow_beams = !model_.backend->offloads();
    if (options_.speculative.enabled()) {
      bo.make_drafter = [this, n_ctx = bo.n_ctx](const GenerationRequest& r) {
        return make_drafter(options_.speculative, draft_, n_ctx, KvCacheOptions{}, r.sampling);
      };
      bo.pass_cost = checking_pass_cost(model_, resolve_threads(options_.model.n_threads));
    }
    BatchScheduler scheduler(*model_.model, *model_.tokenizer, bo);

    for (size_t i = 0; i < lines.size(); ++i) {
      InputLine& l = lines[i];
      const std::string id = l.id.dump();
      if (done.errors.count(id) != 0 || (l.id.is_null() && done.error_lines.count(l.line) != 0) ||
          (done.samples.count(id) != 0 && static_cast<int>(done.samples.at(id).size()) >= l.request.n_samples)) {
        ++skipped_;
        continue;
      }
      if (l.error.empty()) {
        l.request.index = i;
        try {
          scheduler.submit(l.request);
          ++total_;
          if (done.samples.count(id) != 0) already_[i] = done.samples.at(id);
          continue;
        } catch (const std::invalid_argument& e) {
          l.error = e.what();
        }
      }
      write_error(l);
    }

    start_ = std::chrono::steady_clock::now();
    signal(SIGINT, on_sigint);
    signal(SIGTERM, on_sigint);
    const bool show_progress = isatty(STDERR_FILENO) != 0;
    while (!g_stop.load() && scheduler.step([&](GenerationResult r) { write_result(lines[r.index], r); })) {
      if (show_progress) progress(scheduler);
    }
    if (show_progress) std::fputc('\n', stderr);
    std::fclose(out_);
    summary(scheduler);
    if (g_stop.load()) {
      std::fprintf(stderr, "ringlm: interrupted; finished results are in %s, run the same command again to resume\n",
                   options_.output.c_str());
      return 130;
    }
    return 0;
  }

 private:
  void write_line(const nlohmann::ordered_json& j) {
    const std::string text = j.dump() + "\n";
    std::fwrite(text.data(), 1, text.size(), out_);
    std::fflush(out_);  // the record survives whatever happens to this process next
  }

  void write_error(const InputLine& l) {
    ++errors_;
    nlohmann::ordered_json j;
    if (!l.id.is_null()) j["id"] = l.id;
    j["line"] = l.line;
    j["error"] = l.error;
    write_line(j);
    std::fprintf(stderr, "ringlm: %s line %d: %s\n", options_.input.c_str(), l.line, l.error.c_str());
  }

  void write_result(const InputLine& l, const GenerationResult& r) {
    if (++samples_done_[r.index] == l.request.n_samples) ++finished_;  // samples finish in any order
    const auto already = already_.find(r.index);
    if (already != already_.end() && already->second.count(r.sample) != 0) return;  // written by an earlier run
    nlohmann::ordered_json j;
    j["id"] = l.id;
    if (l.reply_format) {
      const ReplyDelta parts = ReplyParser::parse(*l.reply_format, r.text);
      j["text"] = parts.content;
      if (!parts.reasoning.empty()) j["reasoning"] = parts.reasoning;
    } else {
      j["text"] = r.text;
    }
    j["tokens"] = r.n_tokens;
    j["finish_reason"] = r.finish_reason;
    j["prompt_tokens"] = r.prompt_tokens;
    j["timings"] = {{"queue_ms", r.queue_ms},
                    {"prefill_ms", r.prefill_ms},
                    {"decode_ms", r.decode_ms},
                    {"tokens_per_second", r.decode_ms > 0 ? 1000.0 * r.n_tokens / r.decode_ms : 0.0}};
    if (l.request.n_samples > 1) j["sample"] = r.sample;
    write_line(j);
    generated_ += r.n_tokens;
    latencies_ms_.push_back(r.queue_ms + r.prefill_ms + r.decode_ms);
    first_token_ms_.push_back(r.queue_ms + r.prefill_ms);
  }

  double elapsed_s() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  void progress(const BatchScheduler& s) const {
    const double t = elapsed_s();
    const double rate = t > 0 ? static_cast<double>(s.generated_tokens()) / t : 0;
    const double per_request = finished_ > 0 ? t / finished_ : 0;
    std::fprintf(stderr, "\r[%d/%d] %d running | %.1f tokens/s | ETA %.0f s   ", finished_, total_, s.n_running(), rate,
                 per_request * (total_ - finished_));
  }

  void summary(const BatchScheduler& s) const {
    const double t = elapsed_s();
    std::fprintf(stderr,
                 "ringlm batch: %d requests run, %d skipped (already in %s), %d errors | %lld tokens generated in %.2f s: "
                 "%.1f tokens/s (--parallel %d, %lld steps) | latency ms p50 %.0f p90 %.0f p99 %.0f | first token ms p50 "
                 "%.0f p90 %.0f | prompt prefill shared by samples: %lld tokens | KV cache peak %.1f MiB (%.1f MiB "
                 "without sharing prompts)\n",
                 finished_, skipped_, options_.output.c_str(), errors_, static_cast<long long>(generated_), t,
                 t > 0 ? static_cast<double>(generated_) / t : 0.0, options_.n_parallel,
                 static_cast<long long>(s.steps()), percentile(latencies_ms_, 50), percentile(latencies_ms_, 90),
                 percentile(latencies_ms_, 99), percentile(first_token_ms_, 50), percentile(first_token_ms_, 90),
                 static_cast<long long>(s.shared_prefill_tokens()), mib(s.peak_kv_bytes()),
                 mib(s.peak_kv_bytes_unshared()));
    if (options_.speculative.enabled()) {
      const SpeculationStats& sp = s.speculation();
      std::fprintf(stderr, "ringlm batch: speculative (%s): %lld tokens drafted, %lld accepted (%.0f%%), in %lld checking passes\n",
                   options_.speculative.lookup > 0 ? "lookup" : "draft model", static_cast<long long>(sp.drafted),
                   static_cast<long long>(sp.accepted), 100.0 * sp.acceptance(), static_cast<long long>(sp.passes));
    }
  }

  const BatchCommandOptions& options_;
  LoadedModel& model_;
  LoadedModel* draft_;  // -md's model, or null
  std::FILE* out_ = nullptr;
  std::map<size_t, std::set<int>> already_;  // request index -> samples written by an earlier run
  std::map<size_t, int> samples_done_;        // request index -> samples finished in this run
  std::chrono::steady_clock::time_point start_;
  int total_ = 0, finished_ = 0, skipped_ = 0, errors_ = 0;
  int64_t generated_ = 0;
  std::vector<double> latencies_ms_, first_token_ms_;
};

}  // namespace

void add_batch_command(CLI::App& app) {
  auto opts = std::make_shared<BatchCommandOptions>();
  CLI::App* cmd = app.add_subcommand("batch", "run a file of prompts with continuous batching, results as JSON lines");
  opts->model.n_ctx = 2048;  // per sequence, before add_model_options shows it as the default
  add_model_options(*cmd, opts->model);
  add_sampling_options(*cmd, opts->sampling);
  cmd->add_option("-i,--input", opts->input, "prompts: JSON lines {\"id\", \"prompt\" | \"messages\", ...} or plain text, one per line")
      ->required();
  cmd->add_option("-o,--output", opts->output, "results (JSON lines); an existing file is resumed")->required();
  add_cache_type_options(*cmd, opts->cache_type);
  cmd->add_option("--parallel", opts->n_parallel, "sequences decoded together")->check(CLI::Range(1, 256))->capture_default_str();
  cmd->add_option("-n,--max-tokens", opts->max_tokens, "most tokens per result (a line's \"max_tokens\" overrides)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", opts->prefill_chunk, "prompt tokens prefilled per step")
      ->check(CLI::Range(1, 448))
      ->capture_default_str();
  add_speculative_options(*cmd, opts->speculative, "each prompt and its text so far");
  add_beam_options(*cmd, opts->beams, opts->length_penalty, "every line (its \"beams\", \"length_penalty\" override)");
  add_grammar_options(*cmd, opts->grammar);
  cmd->add_flag("!--no-prompt-sharing", opts->share_prompt,
               "n > 1 samples each prefill and hold their own copy of the prompt (to measure what sharing saves)");
  std::vector<std::string> names;
  for (std::string_view n : ChatTemplate::names()) names.emplace_back(n);
  cmd->add_option("--chat-template", opts->chat_template, "chat format for \"messages\" lines, instead of the model's")
      ->check(CLI::IsMember(names));
  cmd->callback([opts] {
    const int n_threads = resolve_threads(opts->model.n_threads);
    omp_set_num_threads(n_threads);
    PipelineProcess& process = this_process();
    refuse_drafts_with_kivi(opts->speculative, opts->cache_type);
    LoadedModel m = load_model(opts->model, n_threads, stage_picker(process, opts->model.layer_split));
    // Under mpirun, rank 0 reads the requests and writes the results; the others run its passes.
    if (serve_as_later_rank(process, m)) return;
    std::optional<LoadedModel> draft = load_draft_model(opts->speculative, m, n_threads);
    const int status = BatchRun(*opts, m, draft ? &*draft : nullptr).run();
    m.model->close_pipeline();
    if (status != 0) throw CLI::RuntimeError(status);  // main() exits with it, destructors run
  });
}

}  // namespace ringlm
