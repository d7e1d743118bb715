// Everything needed to run one GGUF model: the mapped file, its tokenizer, the backend and the
// decoder, loaded and cross-checked together.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "backends/backend.h"
#include "core/gguf/gguf.h"
#include "core/model/llama.h"
#include "core/tokenizer/tokenizer.h"

namespace ringlm {

struct LoadedModel {
  std::unique_ptr<GgufFile> gguf;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<LlamaModel> model;
  double load_ms = 0;
};

// Loads `path` onto the CPU backend with `n_threads` threads and the given compute type (int8:
// activations quantized on the fly, the fast path; fp32: the reference path). Throws GgufError /
// std::runtime_error with a message that names the file and what is wrong.
LoadedModel load_model(const std::string& path, int n_threads, ComputeType compute = ComputeType::kInt8);
// The same on a backend made by the caller (a plugin's device: backends/plugin_backend.h). With
// `stage_of`, only the pipeline stage it picks for the opened file is loaded (pipeline.h).
LoadedModel load_model(const std::string& path, std::unique_ptr<Backend> backend,
                       const std::function<PipelineStage(const GgufFile&)>& stage_of = {});

}  // namespace ringlm
