#include "core/model/loader.h"

#include <chrono>
#include <utility>

#include "backends/cpu/cpu_backend.h"

namespace ringlm {

LoadedModel load_model(const std::string& path, int n_threads, ComputeType compute) {
  return load_model(path, make_cpu_backend(n_threads, compute));
}

LoadedModel load_model(const std::string& path, std::unique_ptr<Backend> backend,
                       const std::function<PipelineStage(const GgufFile&)>& stage_of) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedModel m;
  m.gguf = GgufFile::open(path);
  m.backend = std::move(backend);
  m.model = std::make_unique<LlamaModel>(*m.gguf, *m.backend, stage_of ? stage_of(*m.gguf) : PipelineStage{});
  m.tokenizer = Tokenizer::from_gguf(*m.gguf);
  // Some models pad the embedding past the vocabulary; fewer embedding rows than tokens is an error.
  if (m.tokenizer->n_vocab() > m.model->hparams().n_vocab) {
    m.gguf->fail("the tokenizer has " + std::to_string(m.tokenizer->n_vocab()) + " tokens but token_embd.weight only " +
                 std::to_string(m.model->hparams().n_vocab) + " rows");
  }
  m.load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

}  // namespace ringlm
