#include "apps/run_command.h"

#include <omp.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "apps/common_options.h"
#include "apps/pipeline_process.h"
#include "apps/speculative_options.h"
#include "core/model/loader.h"
#include "core/session/beam_search.h"
#include "core/session/generation.h"
#include "core/session/sequence_model.h"
#include "core/session/timing.h"

namespace ringlm {

namespace {

struct RunOptions {
  ModelOptions model;
  KvCacheOptions cache;
  SamplingParams sampling;
  std::string prompt;
  std::string prompt_file;
  int n_predict = -1;  // -1: until end of generation or a full context
  bool ignore_eos = false;
  std::string stats_format;  // "" (one human line) or "json"
  SpeculativeOptions speculative;
  int beams = 0;  // --beams N: beam search of N beams instead of sampling (0: off)
  float length_penalty = 1.0f;
  GrammarOptions grammar;
};

struct RunStats {
  size_t prompt_tokens = 0;
  double prompt_ms = 0;
  size_t gen_tokens = 0;
  size_t decode_evals = 0;  // generated tokens evaluated (one a pass, or a pass's accepted draft too)
  bool speculative = false;
  std::string guesser;  // "lookup" or "draft model"
  bool pass_cost_measured = false;  // the draft lengths from ringlm tune's passes, not the estimate
  SpeculationStats speculation;
  std::vector<double> token_ms;  // the time of each of them (constant-speed checks)
  double decode_ms = 0;
  double load_ms = 0;
  int n_threads = 0;
  int64_t n_shifts = 0;        // context shifts done
  int64_t n_discarded = 0;     // tokens they dropped
  std::string stop_reason;
  size_t kv_bytes = 0;         // the KV cache's keys and values at the context size (KvCache::bytes)
  std::string kv_type;         // their element types (--cache-type; "k/v" when -ctk and -ctv differ)
  int beams = 0;               // --beams: the beams searched, the best one's score, the rows forks copied
  double beam_score = 0;
  int64_t beam_copied_rows = 0;
  bool grammar = false;  // --grammar and co: what checking and masking tokens cost
  Generation::GrammarCost grammar_cost;
  // On a device backend, what each of those passes did there: kernels launched, bytes up and
  // down, host waits (Backend::counters()).
  bool device = false;
  std::vector<DeviceCounters> token_device;
  // Where each layer ran (Backend::layer_device), then the output's.
  std::vector<std::string> layer_device;
  std::string output_device;
};

// run's words for why generation stopped (--stats).
const char* stop_reason(FinishReason finish) {
  switch (finish) {
    case FinishReason::kEndToken: return "eos";
    case FinishReason::kContextFull: return "context";
    default: return "limit";  // the only other ways run stops: -n, or -n 0
  }
}

double per_second(size_t n, double ms) { return ms > 0 ? 1000.0 * static_cast<double>(n) / ms : 0.0; }

std::string read_prompt(const RunOptions& o) {
  if (o.prompt_file.empty()) return o.prompt;
  std::ifstream in(o.prompt_file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read prompt file '" + o.prompt_file + "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void print_stats(const RunStats& s, const std::string& format) {
  if (format == "json") {
    nlohmann::json j = {
        {"prompt_tokens", s.prompt_tokens}, {"prompt_ms", s.prompt_ms}, {"prompt_tps", per_second(s.prompt_tokens, s.prompt_ms)},
        {"gen_tokens", s.gen_tokens},       {"gen_ms", s.decode_ms},    {"gen_tps", per_second(s.decode_evals, s.decode_ms)},
        {"n_shifts", s.n_shifts},           {"n_discarded", s.n_discarded},     {"token_ms", s.token_ms},
        {"load_ms", s.load_ms},             {"n_threads", s.n_threads}, {"stop_reason", s.stop_reason},
        {"kv_bytes", s.kv_bytes},           {"kv_type", s.kv_type},
    };
    if (s.device) {
      nlohmann::json launches = nlohmann::json::array(), up = nlohmann::json::array(), down = nlohmann::json::array(),
                     waits = nlohmann::json::array();
      for (const DeviceCounters& c : s.token_device) {
        launches.push_back(c.launches);
        up.push_back(c.upload_bytes);
        down.push_back(c.download_bytes);
        waits.push_back(c.waits);
      }
      j["token_device"] = {{"launches", launches}, {"upload_bytes", up}, {"download_bytes", down}, {"waits", waits}};
      j["layer_device"] = s.layer_device;
      j["output_device"] = s.output_device;
    }
    if (s.grammar) {
      j["grammar"] = {{"ms", 1000.0 * s.grammar_cost.seconds},
                      {"ms_per_token", s.gen_tokens > 0 ? 1000.0 * s.grammar_cost.seconds / static_cast<double>(s.gen_tokens) : 0.0},
                      {"masked_draws", s.grammar_cost.masked_draws}};
    }
    if (s.beams > 0) {
      j["beams"] = {{"n", s.beams}, {"score", s.beam_score}, {"copied_rows", s.beam_copied_rows}};
    }
    if (s.speculative) {
      j["speculative"] = {{"guesser", s.guesser},
                          {"drafted", s.speculation.drafted},
                          {"accepted", s.speculation.accepted},
                          {"passes", s.speculation.passes},
                          {"acceptance", s.speculation.acceptance()},
                          {"pass_cost", s.pass_cost_measured ? "tuned" : "estimated"}};
    }
    std::fprintf(stderr, "%s\n", j.dump().c_str());
    return;
  }
  std::fprintf(stderr, "\nringlm: prompt %zu tokens, %.1f t/s | generated %zu tokens, %.1f t/s | load %.0f ms | stop: %s\n",
               s.prompt_tokens, per_second(s.prompt_tokens, s.prompt_ms), s.gen_tokens,
               per_second(s.decode_evals, s.decode_ms), s.load_ms, s.stop_reason.c_str());
}

// The prompt's tokens; refuses an empty prompt and one that leaves no room in the context.
std::vector<int32_t> prompt_tokens(const RunOptions& o, const Tokenizer& tokenizer, int n_ctx) {
  std::vector<int32_t> prompt = tokenizer.encode(read_prompt(o), tokenizer.add_bos_by_default(), /*parse_special=*/true);
  if (prompt.empty()) throw std::runtime_error("the prompt is empty");
  if (prompt.size() >= static_cast<size_t>(n_ctx)) {
    throw std::runtime_error("the prompt is " + std::to_string(prompt.size()) + " tokens, which does not fit the context of " +
                             std::to_string(n_ctx) + " tokens (raise -c)");
  }
  return prompt;
}

// What the stats say of the model before it runs: its load and where its layers are.
RunStats start_stats(const LoadedModel& m, int n_threads) {
  RunStats stats;
  stats.load_ms = m.load_ms;
  stats.n_threads = n_threads;
  stats.device = m.backend->offloads();
  const int n_layer = m.model->hparams().n_layer;
  for (int layer = 0; layer < n_layer; ++layer) stats.layer_device.push_back(m.backend->layer_device(layer));
  stats.output_device = m.backend->layer_device(n_layer);
  return stats;
}

// generate()'s options for run: stream to stdout; with a guesser, its costs and counts.
GenerateOptions generate_options(const RunOptions& o, const LoadedModel& m, int n_threads, bool speculative, RunStats& stats) {
  GenerateOptions options;
  if (speculative) {
    options.pass_cost = checking_pass_cost(m, n_threads);
    stats.pass_cost_measured = options.pass_cost.is_measured();
    stats.guesser = o.speculative.lookup > 0 ? "lookup" : "draft model";
    options.speculation = &stats.speculation;
    stats.speculative = true;
  }
  options.on_text = [](std::string_view piece) {
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  };
  return options;
}

// The decode passes' times (and, on a device, a single token's step's counters) into the stats.
void add_decode_passes(RunStats& stats, const SequenceModel& sequence) {
  for (const DecodePass& pass : sequence.passes()) {
    stats.token_ms.push_back(pass.ms);
    if (pass.tokens > 1) continue;  // a checking pass: counted below
    ++stats.decode_evals;
    if (stats.device) stats.token_device.push_back(pass.device);
  }
  // A checking pass evaluated its first token and the draft tokens it accepted.
  stats.decode_evals += static_cast<size_t>(stats.speculation.passes + stats.speculation.accepted);
}

// The vocabulary's end-of-generation tokens: what ends a beam (none with --ignore-eos).
std::vector<int32_t> end_tokens(const Tokenizer& tokenizer, int n_vocab, bool ignore_eos) {
  std::vector<int32_t> ends;
  for (int32_t id = 0; id < n_vocab && !ignore_eos; ++id) {
    if (tokenizer.is_end_of_generation(id)) ends.push_back(id);
  }
  return ends;
}

// --beams N: the prompt prefilled once into a segment every beam reads, then one batched pass of
// every live beam per step; the best hypothesis is printed when the search ends.
void run_beams(const RunOptions& o, LoadedModel& m, std::span<const int32_t> prompt, int n_ctx, RunStats& stats) {
  if (o.speculative.enabled()) throw std::runtime_error("--beams does not combine with speculative decoding (--lookup, -md)");
  if (stats.device) throw std::runtime_error("--beams runs on the CPU only: drop --device / --gpu-layers");
  if (m.model->pipeline_depth() > 1) throw std::runtime_error("--beams does not run on a pipeline of MPI ranks yet");
  if (o.beams > m.model->max_batch()) {
    throw std::runtime_error("--beams " + std::to_string(o.beams) + " exceeds the batch of " +
                             std::to_string(m.model->max_batch()) + " rows");
  }
  const LlamaHparams& hp = m.model->hparams();
  KvCache prompt_cache = m.model->make_cache(n_ctx, o.cache);
  std::vector<float> logits(static_cast<size_t>(hp.n_vocab));
  auto t0 = std::chrono::steady_clock::now();
  m.model->forward(prompt, prompt_cache, logits.data());
  stats.prompt_ms = ms_since(t0);

  BeamOptions options;
  options.n_beams = o.beams;
  options.length_penalty = o.length_penalty;
  options.max_tokens = o.n_predict;
  options.end_tokens = end_tokens(*m.tokenizer, hp.n_vocab, o.ignore_eos);
  t0 = std::chrono::steady_clock::now();
  auto prompt_segment = std::make_shared<const KvCache>(std::move(prompt_cache));
  BeamSequences beams(*m.model, prompt_segment, logits, n_ctx, o.cache, options);
  while (!beams.done()) {
    const auto step_start = std::chrono::steady_clock::now();
    m.model->forward_batch(beams.plan());
    beams.passed();
    stats.token_ms.push_back(ms_since(step_start));
  }
  stats.decode_ms = ms_since(t0);
  stats.decode_evals = stats.token_ms.size();
  stats.beams = o.beams;
  stats.beam_copied_rows = beams.copied_rows();
  stats.kv_bytes = prompt_segment->bytes();
  stats.kv_type = kv_types_name(prompt_segment->type());
  if (beams.hypotheses().empty()) {  // -n 0
    stats.stop_reason = "limit";
    return;
  }
  const BeamHypothesis& best = beams.hypotheses().front();
  std::span<const int32_t> text = best.tokens;
  if (best.ended) text = text.first(text.size() - 1);
  const std::string out = m.tokenizer->decode(text);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
  stats.gen_tokens = text.size();
  stats.beam_score = best.score;
  const bool limit = o.n_predict >= 0 && static_cast<int>(best.tokens.size()) >= o.n_predict;
  stats.stop_reason = best.ended ? "eos" : limit ? "limit" : "context";
}

void run(const RunOptions& o) {
  const int n_threads = resolve_threads(o.model.n_threads);
  omp_set_num_threads(n_threads);
  PipelineProcess& process = this_process();
  refuse_drafts_with_kivi(o.speculative, o.cache.type);
  const std::shared_ptr<const Grammar> grammar = grammar_of(o.grammar);
  if (grammar && o.beams > 0) throw std::runtime_error("--beams does not combine with a grammar (--grammar, --json-schema)");
  if (grammar && o.speculative.enabled()) {
    throw std::runtime_error("speculative decoding (--lookup, -md) does not combine with a grammar (--grammar, --json-schema)");
  }
  LoadedModel m = load_model(o.model, n_threads, stage_picker(process, o.model.layer_split));
  if (serve_as_later_rank(process, m)) return;
  const LlamaHparams& hp = m.model->hparams();
  const int n_ctx = o.model.n_ctx > 0 ? o.model.n_ctx : hp.n_ctx_train;
  const std::vector<int32_t> prompt = prompt_tokens(o, *m.tokenizer, n_ctx);

  RunStats stats = start_stats(m, n_threads);
  stats.prompt_tokens = prompt.size();
  if (o.beams > 0) {
    run_beams(o, m, prompt, n_ctx, stats);
    m.model->close_pipeline();
    print_stats(stats, o.stats_format);
    return;
  }
  KvCache cache = m.model->make_cache(n_ctx, o.cache);
  Sampler sampler(o.sampling, hp.n_vocab);
  std::optional<LoadedModel> draft_model = load_draft_model(o.speculative, m, n_threads);
  const std::unique_ptr<Drafter> drafter =
      make_drafter(o.speculative, draft_model ? &*draft_model : nullptr, n_ctx, o.cache, o.sampling);
  // The most likely tokens only, when they are all the sampler needs (greedy, or top-k without
  // penalties): a device then sends back those instead of the vocabulary.
  // (A grammar masks the whole vocabulary.)
  SequenceModel sequence(*m.model, std::move(cache), grammar ? 0 : sampler.candidates_needed(), drafter.get());

  auto t0 = std::chrono::steady_clock::now();
  sequence.prefill(prompt);
  if (drafter) drafter->start(prompt);
  stats.prompt_ms = ms_since(t0);

  t0 = std::chrono::steady_clock::now();
  StopConditions stop;
  stop.max_tokens = o.n_predict;
  stop.ignore_eos = o.ignore_eos;
  Generation generation(*m.tokenizer, sampler, std::move(stop), prompt);
  if (grammar) generation.constrain(grammar, std::make_shared<const GrammarVocabulary>(*m.tokenizer));
  sequence.record_passes(stats.device ? m.backend.get() : nullptr);
  const GenerateOptions options = generate_options(o, m, n_threads, drafter != nullptr, stats);
  const FinishReason finish = generate(generation, sequence, options);
  stats.decode_ms = ms_since(t0);
  add_decode_passes(stats, sequence);
  stats.gen_tokens = static_cast<size_t>(generation.n_tokens());
  stats.stop_reason = stop_reason(finish);
  stats.grammar = grammar != nullptr;
  stats.grammar_cost = generation.grammar_cost();
  if (finish == FinishReason::kContextFull) {
    std::fprintf(stderr, "\nringlm: context of %d tokens is full; stopping (raise -c, or drop --no-context-shift)\n", n_ctx);
  }
  stats.kv_bytes = sequence.cache().bytes();
  stats.kv_type = kv_types_name(sequence.cache().type());
  stats.n_shifts = sequence.cache().shifts();
  stats.n_discarded = sequence.cache().discarded();
  m.model->close_pipeline();
  print_stats(stats, o.stats_format);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto opts = std::make_shared<RunOptions>();
  CLI::App* cmd = app.add_subcommand("run", "generate text from one prompt");
  add_model_options(*cmd, opts->model);
  add_sampling_options(*cmd, opts->sampling);
  add_kv_cache_options(*cmd, opts->cache);
  auto* p = cmd->add_option("-p,--prompt", opts->prompt, "prompt text");
  auto* f = cmd->add_option("-f,--file", opts->prompt_file, "read the prompt from a file");
  p->excludes(f);
  cmd->add_option("-n,--n-predict", opts->n_predict, "tokens to generate (-1: until end of generation)")
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", opts->ignore_eos, "keep generating past end-of-generation tokens");
  add_speculative_options(*cmd, opts->speculative, "earlier text");
  add_beam_options(*cmd, opts->beams, opts->length_penalty, "the prompt");
  add_grammar_options(*cmd, opts->grammar);
  cmd->add_option("--stats", opts->stats_format, "print the final speed summary as: json")->check(CLI::IsMember({"json"}));
  cmd->callback([opts, p, f] {
    if (p->count() == 0 && f->count() == 0) throw CLI::RequiredError("-p,--prompt or -f,--file");
    run(*opts);
  });
}

}  // namespace ringlm
