// Flags shared by several subcommands, named as llama.cpp names them.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "backends/cpu/cpu_backend.h"
#include "backends/plugin_backend.h"
#include "core/grammar/grammar.h"
#include "core/kv/kv_cache.h"
#include "core/model/loader.h"
#include "core/sampling/sampler.h"

namespace ringlm {

struct ModelOptions {
  std::string model_path;  // empty: the default model
  int n_threads = 0;       // 0: all cores
  int n_ctx = 4096;        // 0: the model's training context
  ComputeType compute = ComputeType::kInt8;
  std::string device = "cpu";  // --device: cpu | auto | opencl[:N] (a plugin's name)
  std::string plugin_dir;      // --plugin-dir: searched for plugins before $RINGLM_PLUGIN_PATH
  DevicePlacement placement;   // --gpu-layers, --cpu-moe, --n-cpu-moe
  std::string layer_split;     // --layer-split: layers per rank under mpirun ("" : balanced by bytes)
};

void add_model_options(CLI::App& cmd, ModelOptions& opts);
// --device, --plugin-dir, --gpu-layers, --cpu-moe and --n-cpu-moe (part of add_model_options;
// alone for commands with their own -m).
void add_device_options(CLI::App& cmd, std::string& device, std::string& plugin_dir, DevicePlacement& placement);

// Loads the model -m names (resolve_model_path) onto the backend --device names, with
// `n_threads` CPU threads; prints --device auto's fallback notice on stderr.
// With `stage_of`, only the pipeline stage it picks is loaded (apps/pipeline_process.h).
LoadedModel load_model(const std::string& model_flag, int n_threads, ComputeType compute, const std::string& device,
                       const std::string& plugin_dir, const DevicePlacement& placement = {},
                       const std::function<PipelineStage(const GgufFile&)>& stage_of = {});
inline LoadedModel load_model(const ModelOptions& opts, int n_threads,
                              const std::function<PipelineStage(const GgufFile&)>& stage_of = {}) {
  return load_model(opts.model_path, n_threads, opts.compute, opts.device, opts.plugin_dir, opts.placement, stage_of);
}
void add_sampling_options(CLI::App& cmd, SamplingParams& params);
// --compute int8|fp32: how quantized weights are multiplied (int8: activations quantized per
// block on the fly, the fast default; fp32: weights dequantized, the reference path).
void add_compute_option(CLI::App& cmd, ComputeType& compute);

// --cache-type f16|f32|q8_0|q4_0 (keys and values), and llama.cpp's -ctk/--cache-type-k and
// -ctv/--cache-type-v (one side each, over --cache-type).
void add_cache_type_options(CLI::App& cmd, KvTypes& types);

// --grammar GBNF, --grammar-file FILE and --json-schema JSON (llama.cpp's flags): the text a
// sequence generates is held to the grammar (core/grammar/). At most one of them.
struct GrammarOptions {
  std::string grammar;
  std::string grammar_file;
  std::string json_schema;
  bool given() const { return !grammar.empty() || !grammar_file.empty() || !json_schema.empty(); }
};
void add_grammar_options(CLI::App& cmd, GrammarOptions& opts);
// The grammar the options give, compiled (null: none). Throws GrammarError naming what is wrong
// with it, std::runtime_error for a file that cannot be read.
std::shared_ptr<const Grammar> grammar_of(const GrammarOptions& opts);
// The grammar of the JSON documents valid under a JSON Schema (text); GrammarError naming what
// is wrong with it or what it uses that is not supported.
std::shared_ptr<const Grammar> grammar_of_json_schema(std::string_view schema_text);

// --beams N (beam search instead of sampling; 0: off) and --length-penalty A, with the help text
// naming what they apply to (`scope`: "the text", "every line").
void add_beam_options(CLI::App& cmd, int& beams, float& length_penalty, const std::string& scope);

// The KV cache and StreamingLLM: the cache type options, --keep N (attention sinks, default 4),
// --discard N (tokens a context shift drops, default half of those after the sinks),
// --no-context-shift (stop at a full context instead). Sets context_shift = true unless told not to.
void add_kv_cache_options(CLI::App& cmd, KvCacheOptions& opts);

// $RINGLM_CACHE_DIR, else $XDG_CACHE_HOME/ringlm, else ~/.cache/ringlm: models, chat history.
std::filesystem::path ringlm_cache_dir();
// -m if given, else $RINGLM_MODEL, else the model that setup installs into the cache directory.
std::string resolve_model_path(const std::string& flag_value);
// Threads to use for a -t value of 0 (auto).
int resolve_threads(int flag_value);

}  // namespace ringlm
