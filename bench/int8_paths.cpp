// How far each int8 path's logits lie from the fp32 path's, position by position, on every SIMD
// target this machine runs (bench/README.md, "int8 paths against fp32"). For the first N tokens
// of a text:
//   fp32     the reference compute (ComputeType::kFp32), the whole text in one pass;
//   prefill  int8 compute, the whole text in one pass (M = N rows per product);
//   decode   int8 compute, one token at a time (M = 1: what generation runs).
// Per target and path it prints the KL divergence of the next-token distribution from fp32's
// (mean, median, 99th percentile and largest over the positions), the largest |logit difference|
// as a fraction of the position's logit range (median and largest), how often the argmax agrees,
// and the perplexity of the text's own next tokens; then the same for decode against prefill.
#include <hwy/targets.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "core/model/loader.h"
#include "tests/logit_distance.h"  // log_softmax, as the tests compare paths

namespace {

using Logits = std::vector<float>;  // [position][vocab], row after row

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// `got` against `ref` position by position; prints one line.
void compare(const char* label, const Logits& ref, const Logits& got, int vocab, const std::vector<int32_t>& tokens) {
  const size_t n = tokens.size(), v = static_cast<size_t>(vocab);
  std::vector<double> kls, rel;
  double nll = 0;
  int same = 0;
  for (size_t p = 0; p < n; ++p) {
    const std::span<const float> r(ref.data() + p * v, v), g(got.data() + p * v, v);
    const std::vector<double> lr = ringlm::test::log_softmax(r), lg = ringlm::test::log_softmax(g);
    double kl = 0, worst = 0;
    for (size_t i = 0; i < v; ++i) {
      kl += std::exp(lr[i]) * (lr[i] - lg[i]);
      worst = std::max(worst, static_cast<double>(std::fabs(r[i] - g[i])));
    }
    const auto [lo, hi] = std::minmax_element(r.begin(), r.end());
    kls.push_back(kl);
    rel.push_back(worst / (*hi - *lo));
    same += std::max_element(r.begin(), r.end()) - r.begin() == std::max_element(g.begin(), g.end()) - g.begin();
    if (p + 1 < n) nll -= lg[static_cast<size_t>(tokens[p + 1])] / static_cast<double>(n - 1);
  }
  double mean = 0;
  for (const double k : kls) mean += k / static_cast<double>(n);
  std::printf("%-26s KL mean %.2e median %.2e p99 %.2e max %.2e | max|dlogit|/range median %.4f max %.4f | "
              "argmax %zu/%zu | ppl %.4f\n",
              label, mean, quantile(kls, 0.5), quantile(kls, 0.99), quantile(kls, 1.0), quantile(rel, 0.5),
              quantile(rel, 1.0), static_cast<size_t>(same), n, std::exp(nll));
  std::fflush(stdout);
}

Logits run(ringlm::LoadedModel& m, const std::vector<int32_t>& tokens, bool one_at_a_time) {
  const size_t v = static_cast<size_t>(m.model->hparams().n_vocab), n = tokens.size();
  ringlm::KvCache cache = m.model->make_cache(static_cast<int>(n) + 1);
  Logits out(n * v);
  if (!one_at_a_time) {
    m.model->forward(tokens, cache, out.data(), /*all_logits=*/true);
    return out;
  }
  for (size_t p = 0; p < n; ++p) m.model->forward(std::span(tokens).subspan(p, 1), cache, out.data() + p * v);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path, text_path;
  int n_tokens = 256, n_threads = 2;
  CLI::App app{"bench_int8_paths: each int8 path's logits against the fp32 path's, per SIMD target"};
  app.add_option("-m,--model", model_path)->required();
  app.add_option("-f,--file", text_path, "the text whose first N tokens are evaluated")->required()->check(CLI::ExistingFile);
  app.add_option("-n", n_tokens, "tokens (default 256)")->check(CLI::Range(2, 1 << 16));
  app.add_option("-t,--threads", n_threads)->check(CLI::Range(1, 256));
  CLI11_PARSE(app, argc, argv);
  try {
    omp_set_num_threads(n_threads);
    std::ifstream in(text_path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ringlm::LoadedModel ref = ringlm::load_model(model_path, n_threads, ringlm::ComputeType::kFp32);
    std::vector<int32_t> tokens = ref.tokenizer->encode(text, ref.tokenizer->add_bos_by_default(), true);
    tokens.resize(std::min(tokens.size(), static_cast<size_t>(n_tokens)));
    const int vocab = ref.model->hparams().n_vocab;
    std::printf("%s, %zu tokens of %s, %d threads\n", model_path.c_str(), tokens.size(), text_path.c_str(), n_threads);
    const Logits fp32 = run(ref, tokens, false);
    compare("fp32 decode vs fp32", fp32, run(ref, tokens, true), vocab, tokens);
    for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      ringlm::LoadedModel m = ringlm::load_model(model_path, n_threads, ringlm::ComputeType::kInt8);
      const Logits prefill = run(m, tokens, false), decode = run(m, tokens, true);
      const std::string name = hwy::TargetName(target);
      compare((name + " prefill vs fp32").c_str(), fp32, prefill, vocab, tokens);
      compare((name + " decode vs fp32").c_str(), fp32, decode, vocab, tokens);
      compare((name + " decode vs prefill").c_str(), prefill, decode, vocab, tokens);
    }
    hwy::SetSupportedTargetsForTest(0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_int8_paths: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
