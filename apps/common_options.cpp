#include "apps/common_options.h"

#include <iterator>
#include <fstream>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <array>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "apps/pipeline_process.h"
#include "core/grammar/json_schema.h"
#include "backends/plugin_backend.h"

namespace ringlm {

namespace {
constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";
}  // namespace

std::filesystem::path ringlm_cache_dir() {
  if (const char* dir = std::getenv("RINGLM_CACHE_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return std::filesystem::path(xdg) / "ringlm";
  }
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : ".") / ".cache" / "ringlm";
}

void add_model_options(CLI::App& cmd, ModelOptions& opts) {
  cmd.add_option("-m,--model", opts.model_path, "GGUF model file (default: $RINGLM_MODEL, else the model setup installed)");
  cmd.add_option("-t,--threads", opts.n_threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  cmd.add_option("-c,--ctx-size", opts.n_ctx, "context size in tokens (0: the model's training context)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  add_compute_option(cmd, opts.compute);
  add_device_options(cmd, opts.device, opts.plugin_dir, opts.placement);
  cmd.add_option("--layer-split", opts.layer_split,
                 "under mpirun -np N: layers per rank, e.g. 10,12 (default: balanced by the bytes of their weights)");
  cmd.add_option_function<std::string>(
         "--split", [](const std::string&) {}, "under mpirun -np N: how the model is split over the ranks (layer)")
      ->check(CLI::IsMember({"layer"}));
}

void add_device_options(CLI::App& cmd, std::string& device, std::string& plugin_dir, DevicePlacement& placement) {
  cmd.add_option("--device", device,
                 "where to run: cpu, auto (a plugin's GPU if there is one, else the CPU) or a plugin device "
                 "such as opencl or opencl:1 (see 'ringlm devices')")
      ->capture_default_str();
  cmd.add_option("--plugin-dir", plugin_dir, "directory searched for backend plugins first (then $RINGLM_PLUGIN_PATH, then next to ringlm)");
  cmd.add_option("--gpu-layers,--n-gpu-layers", placement.gpu_layers,
                 "with a plugin device: the last N layers (and the output) on the device, the others on the CPU "
                 "(default: all; 0: none)")
      ->check(CLI::Range(0, 1 << 16));
  CLI::Option* all_experts = cmd.add_flag_callback(
      "--cpu-moe", [&placement] { placement.cpu_moe_layers = -1; },
      "with a plugin device: a mixture of experts' expert products on the CPU, the rest of each layer on the device");
  cmd.add_option("--n-cpu-moe", placement.cpu_moe_layers,
                 "with a plugin device: the experts of the first N layers on the CPU")
      ->check(CLI::Range(0, 1 << 16))
      ->excludes(all_experts);
}

LoadedModel load_model(const std::string& model_flag, int n_threads, ComputeType compute, const std::string& device,
                       const std::string& plugin_dir, const DevicePlacement& placement,
                       const std::function<PipelineStage(const GgufFile&)>& stage_of) {
  if (!stage_of && !this_process().alone()) {
    throw std::runtime_error("this command does not run across pipeline ranks (under mpirun: run, perplexity, bench, batch and serve)");
  }
  const std::string path = resolve_model_path(model_flag);
  BackendChoice choice;
  choice.device = device;
  choice.plugin_dir = plugin_dir;
  choice.cache_dir = ringlm_cache_dir() / "kernels";
  choice.n_threads = n_threads;
  choice.compute = compute;
  choice.placement = placement;
  std::string notice;
  std::unique_ptr<Backend> backend = make_backend(choice, notice);
  if (!notice.empty()) std::fprintf(stderr, "ringlm: %s\n", notice.c_str());
  LoadedModel model = load_model(path, std::move(backend), stage_of);
  if (const std::string report = model.backend->cpu_fallback_report(); !report.empty()) {
    std::fprintf(stderr, "ringlm: %s\n", report.c_str());
  }
  return model;
}

void add_compute_option(CLI::App& cmd, ComputeType& compute) {
  const std::map<std::string, ComputeType> names{{"int8", ComputeType::kInt8}, {"fp32", ComputeType::kFp32}};
  cmd.add_option("--compute", compute, "compute type for quantized weights: int8 (fast) or fp32 (reference)")
      ->transform(CLI::CheckedTransformer(names, CLI::ignore_case))
      ->default_str("int8");
}

void add_cache_type_options(CLI::App& cmd, KvTypes& types) {
  const std::map<std::string, KvType> names{
      {"f16", KvType::kF16}, {"f32", KvType::kF32}, {"q8_0", KvType::kQ8_0}, {"q4_0", KvType::kQ4_0}, {"kivi2", KvType::kKivi2}};
  // The three flags are held until parsing ends: a side's own flag wins over --cache-type.
  auto given = std::make_shared<std::array<std::optional<KvType>, 3>>();  // both, keys, values
  cmd.add_option("--cache-type", (*given)[0], "KV cache element type, keys and values: f16, f32, q8_0, q4_0 or kivi2 (KIVI's 2 bits, both sides)")
      ->transform(CLI::CheckedTransformer(names, CLI::ignore_case))
      ->default_str("f16");
  cmd.add_option("--cache-type-k", (*given)[1], "the keys' type (-ctk, as llama.cpp; overrides --cache-type)")
      ->transform(CLI::CheckedTransformer(names, CLI::ignore_case));
  cmd.add_option("--cache-type-v", (*given)[2], "the values' type (-ctv, as llama.cpp; overrides --cache-type)")
      ->transform(CLI::CheckedTransformer(names, CLI::ignore_case));
  cmd.parse_complete_callback([given, &types] {
    const auto& [both, keys, values] = *given;
    if (both) types = *both;
    if (keys) types.keys = *keys;
    if (values) types.values = *values;
  });
}

std::shared_ptr<const Grammar> grammar_of_json_schema(std::string_view schema_text) {
  const nlohmann::json schema = nlohmann::json::parse(schema_text, nullptr, false);
  if (schema.is_discarded()) throw GrammarError("json_schema: not valid JSON");
  return Grammar::parse(json_schema_to_gbnf(schema));
}

void add_grammar_options(CLI::App& cmd, GrammarOptions& opts) {
  auto* text = cmd.add_option("--grammar", opts.grammar, "hold the generated text to this GBNF grammar (llama.cpp's format)");
  auto* file = cmd.add_option("--grammar-file", opts.grammar_file, "... to the GBNF grammar in this file");
  auto* schema = cmd.add_option("--json-schema", opts.json_schema, "... to JSON valid under this JSON Schema");
  text->excludes(file, schema);
  file->excludes(schema);
}

std::shared_ptr<const Grammar> grammar_of(const GrammarOptions& opts) {
  if (!opts.grammar.empty()) return Grammar::parse(opts.grammar);
  if (!opts.json_schema.empty()) return grammar_of_json_schema(opts.json_schema);
  if (!opts.grammar_file.empty()) {
    std::ifstream in(opts.grammar_file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read grammar file '" + opts.grammar_file + "'");
    return Grammar::parse(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  }
  return nullptr;
}

void add_beam_options(CLI::App& cmd, int& beams, float& length_penalty, const std::string& scope) {
  cmd.add_option("--beams", beams, "beam search of N beams for " + scope + " instead of sampling (1: greedy; 0: off)")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  cmd.add_option("--length-penalty", length_penalty,
                 "with beams, a text scores log-probability / length^this (above 1 favours long texts)")
      ->check(CLI::Range(-10.0f, 10.0f))
      ->capture_default_str();
}

void add_kv_cache_options(CLI::App& cmd, KvCacheOptions& opts) {
  opts.n_keep = 4;
  opts.context_shift = true;
  add_cache_type_options(cmd, opts.type);
  cmd.add_option("--keep", opts.n_keep, "tokens at the start kept when the context shifts (attention sinks)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd.add_option("--kivi-residual", opts.kivi_residual,
                 "with --cache-type kivi2, the newest tokens kept in fp16 before their group of 32 is quantized")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd.add_option("--discard", opts.n_discard, "tokens a context shift drops after the kept ones (0: half of them)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  cmd.add_flag_callback("--no-context-shift", [&opts] { opts.context_shift = false; },
                        "stop at a full context instead of shifting it (StreamingLLM)");
}

void add_sampling_options(CLI::App& cmd, SamplingParams& p) {
  cmd.add_option("--temp", p.temperature, "temperature (0: greedy)")->check(CLI::Range(0.0f, 100.0f))->capture_default_str();
  cmd.add_option("--top-k", p.top_k, "keep the k most likely tokens (0: off)")->check(CLI::Range(0, 1 << 24))->capture_default_str();
  cmd.add_option("--top-p", p.top_p, "nucleus sampling mass (1: off)")->check(CLI::Range(0.0f, 1.0f))->capture_default_str();
  cmd.add_option("--min-p", p.min_p, "drop tokens below this fraction of the best (0: off)")
      ->check(CLI::Range(0.0f, 1.0f))
      ->capture_default_str();
  cmd.add_option("--repeat-penalty", p.repeat_penalty, "penalty for recent tokens (1: off)")
      ->check(CLI::Range(0.0f, 100.0f))
      ->capture_default_str();
  cmd.add_option("--frequency-penalty", p.frequency_penalty, "subtracted from a recent token's logit per occurrence (0: off)")
      ->check(CLI::Range(-2.0f, 2.0f))
      ->capture_default_str();
  cmd.add_option("--presence-penalty", p.presence_penalty, "subtracted once from a recent token's logit (0: off)")
      ->check(CLI::Range(-2.0f, 2.0f))
      ->capture_default_str();
  cmd.add_option("--repeat-last-n", p.repeat_last_n, "how many recent tokens the penalties see (0: none, -1: all)")
      ->check(CLI::Range(-1, 1 << 24))
      ->capture_default_str();
  cmd.add_option("-s,--seed", p.seed, "random seed (default: random)");
}

std::string resolve_model_path(const std::string& flag_value) {
  if (!flag_value.empty()) return flag_value;
  if (const char* env = std::getenv("RINGLM_MODEL"); env != nullptr && *env != '\0') return env;
  const std::filesystem::path p = ringlm_cache_dir() / "models" / kDefaultModelFile;
  if (!std::filesystem::exists(p)) {
    throw std::runtime_error("no model given (-m) and the default model is not installed at " + p.string() +
                             "; run scripts/setup.sh first");
  }
  return p.string();
}

int resolve_threads(int flag_value) {
  if (flag_value > 0) return flag_value;
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace ringlm
