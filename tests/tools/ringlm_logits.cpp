// Test tool for the numpy-reference comparison: tokenizes a prompt with ringlm's tokenizer, runs
// the forward pass on the fp32 reference compute path, and prints {"prompt_tokens", "last_logits", "generated"} as JSON, where
// last_logits are the logits at the last prompt position and generated are N greedy tokens
// (end-of-generation tokens do not stop it).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/model/loader.h"
#include "core/sampling/sampler.h"

int main(int argc, char** argv) {
  std::string model_path, prompt;
  int n_generate = 32, n_threads = 2, n_ctx = 0;
  CLI::App app{"ringlm_logits: dump prompt logits and greedy tokens as JSON"};
  app.add_option("-m,--model", model_path)->required();
  app.add_option("-p,--prompt", prompt)->required();
  app.add_option("-n", n_generate)->check(CLI::Range(0, 4096));
  app.add_option("-t,--threads", n_threads)->check(CLI::Range(1, 256));
  app.add_option("-c,--ctx-size", n_ctx, "context size (0: prompt + generated tokens + 1)")->check(CLI::Range(0, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  try {
    omp_set_num_threads(n_threads);
    ringlm::LoadedModel m = ringlm::load_model(model_path, n_threads, ringlm::ComputeType::kFp32);
    const int n_vocab = m.model->hparams().n_vocab;
    const std::vector<int32_t> tokens = m.tokenizer->encode(prompt, m.tokenizer->add_bos_by_default(), true);
    if (n_ctx == 0) n_ctx = static_cast<int>(tokens.size()) + n_generate + 1;
    ringlm::KvCache cache = m.model->make_cache(n_ctx, {.type = ringlm::KvType::kF32});
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    m.model->forward(tokens, cache, logits.data());
    nlohmann::json out;
    out["prompt_tokens"] = tokens;
    out["last_logits"] = logits;
    std::vector<int32_t> generated;
    for (int i = 0; i < n_generate; ++i) {
      const int32_t next = ringlm::argmax(logits);
      generated.push_back(next);
      if (i + 1 < n_generate) m.model->forward(std::span<const int32_t>(&next, 1), cache, logits.data());
    }
    out["generated"] = generated;
    std::printf("%s\n", out.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringlm_logits: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
