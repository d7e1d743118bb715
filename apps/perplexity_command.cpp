// `ringlm perplexity`: llama-perplexity's method, so the two tools' figures can be compared as they
// are.
//
// The whole text is tokenized once (with BOS when the model adds BOS) and cut into
// non-overlapping chunks of c tokens; a chunk's first token is replaced by BOS when the model
// adds BOS. Each chunk runs in a fresh context. Only the second half is scored: the logits at
// positions c/2 .. c-2 predict tokens c/2+1 .. c-1, so every scored token sees at least c/2
// tokens of context. PPL = exp(mean NLL); its error is PPL times the standard error of the NLL
// mean (first-order propagation through exp), as llama.cpp reports it.
#include "apps/perplexity_command.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "apps/pipeline_process.h"
#include "core/model/loader.h"

namespace ringlm {

namespace {

struct PerplexityOptions {
  std::string model_path;
  std::string text_file;
  int n_ctx = 512;
  int n_batch = 2048;
  int n_threads = 0;
  int n_chunks = -1;  // -1: all
  ComputeType compute = ComputeType::kInt8;
  std::string device = "cpu";
  std::string plugin_dir;
  DevicePlacement placement;  // --gpu-layers, --cpu-moe, --n-cpu-moe
  std::string layer_split;  // --layer-split under mpirun ("": balanced by bytes)
  KvCacheOptions cache;
  int stream_tokens = 0;        // > 0: stream this many tokens through one ring of -c slots
  bool sliding_window = false;  // with stream_tokens: recompute the last -c tokens for every token instead
};

// Running sums of the negative log-likelihood and its square over every scored token.
struct NllStats {
  double sum = 0;
  double sum_sq = 0;
  int64_t count = 0;

  double ppl() const { return std::exp(sum / static_cast<double>(count)); }
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read text file '" + path + "'");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// -log softmax(logits)[target], with the sum of exponentials in double so that a 100k-entry
// vocabulary does not lose the small terms.
double token_nll(const float* logits, int n_vocab, int32_t target) {
  const float max = *std::max_element(logits, logits + n_vocab);
  double sum = 0;
  for (int i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - max));
  return std::log(sum) - static_cast<double>(logits[target] - max);
}

// Runs one chunk from an empty cache, -b tokens per forward call, keeping every position's logits.
void eval_chunk(LoadedModel& m, std::vector<int32_t> chunk, int n_batch, KvCache& cache, std::vector<float>& logits) {
  if (m.tokenizer->add_bos_by_default() && m.tokenizer->bos_id() >= 0) chunk[0] = m.tokenizer->bos_id();
  const size_t n_vocab = static_cast<size_t>(m.model->hparams().n_vocab);
  cache.clear();
  for (size_t done = 0; done < chunk.size();) {
    const size_t n = std::min(chunk.size() - done, static_cast<size_t>(n_batch));
    m.model->forward(std::span<const int32_t>(chunk.data() + done, n), cache, logits.data() + done * n_vocab,
                     /*all_logits=*/true);
    done += n;
  }
}

void score_second_half(const std::vector<float>& logits, const int32_t* chunk, int n_ctx, int n_vocab, NllStats& s) {
  for (int pos = n_ctx / 2; pos < n_ctx - 1; ++pos) {
    const double nll = token_nll(logits.data() + static_cast<size_t>(pos) * static_cast<size_t>(n_vocab), n_vocab,
                                 chunk[pos + 1]);
    s.sum += nll;
    s.sum_sq += nll * nll;
    ++s.count;
  }
}

void print_final(const NllStats& s) {
  const double mean = s.sum / static_cast<double>(s.count);
  const double var = s.sum_sq / static_cast<double>(s.count) - mean * mean;
  if (var <= 0 || s.count < 2) {
    std::printf("Final estimate: PPL = %.4f (no error estimate: variance of log-probabilities is not positive)\n", s.ppl());
    return;
  }
  const double stderr_mean = std::sqrt(var / static_cast<double>(s.count - 1));
  std::printf("Final estimate: PPL = %.4f +/- %.5f\n", s.ppl(), stderr_mean * s.ppl());
}

void add_nll(const float* logits, int n_vocab, int32_t target, NllStats& s) {
  const double nll = token_nll(logits, n_vocab, target);
  s.sum += nll;
  s.sum_sq += nll * nll;
  ++s.count;
}

// StreamingLLM's evaluation: the first n tokens go through one cache of -c slots in order, -b at
// a time, shifting the context whenever it fills (--keep sinks, --discard dropped); every token
// after the first is scored by the logits before it.
NllStats stream_perplexity(LoadedModel& m, const PerplexityOptions& o, std::vector<int32_t> tokens) {
  const int n_vocab = m.model->hparams().n_vocab;
  const size_t n_batch = static_cast<size_t>(std::min(o.n_batch, o.n_ctx));
  if (!o.cache.context_shift && tokens.size() > static_cast<size_t>(o.n_ctx)) {
    throw std::runtime_error("--stream " + std::to_string(tokens.size()) + " tokens do not fit a context of " +
                             std::to_string(o.n_ctx) + " with --no-context-shift (raise -c)");
  }
  KvCache cache = m.model->make_cache(o.n_ctx, o.cache);
  std::vector<float> logits(n_batch * static_cast<size_t>(n_vocab));
  NllStats stats;
  for (size_t done = 0; done + 1 < tokens.size();) {
    const size_t n = std::min(n_batch, tokens.size() - 1 - done);
    m.model->forward(std::span<const int32_t>(tokens.data() + done, n), cache, logits.data(), /*all_logits=*/true);
    for (size_t i = 0; i < n; ++i) add_nll(logits.data() + i * static_cast<size_t>(n_vocab), n_vocab, tokens[done + i + 1], stats);
    done += n;
    std::fprintf(stderr, "\r[%zu/%zu] PPL %.4f, %lld shifts", done, tokens.size() - 1, stats.ppl(),
                 static_cast<long long>(cache.shifts()));
    std::fflush(stderr);
  }
  std::fprintf(stderr, "\n");
  return stats;
}

// The baseline StreamingLLM compares with: for every token, a fresh cache computes the (at most
// -c - 1) tokens before it from scratch. Quadratic: keep --stream small.
NllStats sliding_window_perplexity(LoadedModel& m, const PerplexityOptions& o, const std::vector<int32_t>& tokens) {
  const int n_vocab = m.model->hparams().n_vocab;
  KvCache cache = m.model->make_cache(o.n_ctx, {o.cache.type, 0, 0, false, o.cache.kivi_residual});
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  NllStats stats;
  for (size_t j = 1; j < tokens.size(); ++j) {
    const size_t first = j >= static_cast<size_t>(o.n_ctx) ? j - static_cast<size_t>(o.n_ctx - 1) : 0;
    cache.clear();
    m.model->forward(std::span<const int32_t>(tokens.data() + first, j - first), cache, logits.data());
    add_nll(logits.data(), n_vocab, tokens[j], stats);
    if (j % 16 == 0) {
      std::fprintf(stderr, "\r[%zu/%zu] PPL %.4f", j, tokens.size() - 1, stats.ppl());
      std::fflush(stderr);
    }
  }
  std::fprintf(stderr, "\n");
  return stats;
}

void perplexity_of(LoadedModel& m, const PerplexityOptions& o, const std::string& text);

void perplexity(const PerplexityOptions& o) {
  // Before the model load: fail fast. (Under mpirun only rank 0 reads it: the others run passes.)
  PipelineProcess& process = this_process();
  const std::string text = process.rank() == 0 ? read_text(o.text_file) : std::string();
  const int n_threads = resolve_threads(o.n_threads);
  omp_set_num_threads(n_threads);
  LoadedModel m = load_model(o.model_path, n_threads, o.compute, o.device, o.plugin_dir, o.placement,
                             stage_picker(process, o.layer_split));
  if (serve_as_later_rank(process, m)) return;
  perplexity_of(m, o, text);
  m.model->close_pipeline();
}

void perplexity_of(LoadedModel& m, const PerplexityOptions& o, const std::string& text) {
  const int n_vocab = m.model->hparams().n_vocab;

  std::fprintf(stderr, "perplexity: tokenizing the input ..\n");
  const std::vector<int32_t> tokens = m.tokenizer->encode(text, m.tokenizer->add_bos_by_default(), /*parse_special=*/false);
  if (o.stream_tokens > 0) {
    if (tokens.size() < 2) throw std::runtime_error("the text has fewer than 2 tokens");
    std::vector<int32_t> head(tokens.begin(), tokens.begin() + std::min(tokens.size(), static_cast<size_t>(o.stream_tokens)));
    std::fprintf(stderr, "perplexity: streaming %zu tokens through %d slots (%s)\n", head.size(), o.n_ctx,
                 o.sliding_window ? "sliding window, recomputed for every token"
                                  : ("keep " + std::to_string(o.cache.n_keep) + ", discard " +
                                     (o.cache.n_discard > 0 ? std::to_string(o.cache.n_discard) : std::string("half")))
                                        .c_str());
    print_final(o.sliding_window ? sliding_window_perplexity(m, o, head) : stream_perplexity(m, o, head));
    return;
  }
  const size_t needed = 2 * static_cast<size_t>(o.n_ctx);
  if (tokens.size() < needed) {
    throw std::runtime_error("perplexity with a context of " + std::to_string(o.n_ctx) + " needs at least " +
                             std::to_string(needed) + " tokens, has " + std::to_string(tokens.size()) +
                             " (use a longer text or a smaller -c)");
  }
  const int max_chunks = static_cast<int>(tokens.size() / static_cast<size_t>(o.n_ctx));
  const int n_chunks = o.n_chunks < 0 ? max_chunks : std::min(o.n_chunks, max_chunks);
  const int n_batch = std::min(o.n_batch, o.n_ctx);
  std::fprintf(stderr, "perplexity: %zu tokens; calculating perplexity over %d chunks, n_ctx=%d, batch_size=%d\n",
               tokens.size(), n_chunks, o.n_ctx, n_batch);

  KvCache cache = m.model->make_cache(o.n_ctx, {o.cache.type, 0, 0, false, o.cache.kivi_residual});
  std::vector<float> logits(static_cast<size_t>(o.n_ctx) * static_cast<size_t>(n_vocab));
  NllStats stats;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n_chunks; ++i) {
    const auto first = tokens.begin() + static_cast<ptrdiff_t>(i) * o.n_ctx;
    const std::vector<int32_t> chunk(first, first + o.n_ctx);
    eval_chunk(m, chunk, n_batch, cache, logits);
    score_second_half(logits, chunk.data(), o.n_ctx, n_vocab, stats);
    if (i == 0) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "perplexity: %.2f seconds per pass - ETA %.1f minutes\n", s, s * n_chunks / 60.0);
    }
    std::fprintf(stderr, "[%d]%.4f,", i + 1, stats.ppl());
    std::fflush(stderr);
  }
  std::fprintf(stderr, "\n");
  print_final(stats);
}

}  // namespace

void add_perplexity_command(CLI::App& app) {
  auto o = std::make_shared<PerplexityOptions>();
  CLI::App* cmd = app.add_subcommand("perplexity", "perplexity of a text file, as llama-perplexity computes it");
  cmd->add_option("-m,--model", o->model_path, "GGUF model file (default: $RINGLM_MODEL, else the model setup installed)");
  cmd->add_option("-f,--file", o->text_file, "text file to score")->required();
  cmd->add_option("-c,--ctx-size", o->n_ctx, "chunk length in tokens")->check(CLI::Range(4, 1 << 20))->capture_default_str();
  cmd->add_option("-b,--batch-size", o->n_batch, "tokens per forward call (at most -c)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("-t,--threads", o->n_threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  add_compute_option(*cmd, o->compute);
  add_device_options(*cmd, o->device, o->plugin_dir, o->placement);
  cmd->add_option("--layer-split", o->layer_split,
                  "under mpirun -np N: layers per rank, e.g. 10,12 (default: balanced by the bytes of their weights)");
  cmd->add_option("--chunks", o->n_chunks, "score at most this many chunks (-1: all)")
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
  add_kv_cache_options(*cmd, o->cache);
  cmd->add_option("--stream", o->stream_tokens,
                  "instead of chunks: stream the first N tokens through one context of -c slots, shifting it "
                  "(--keep, --discard) when full, and score every token")
      ->check(CLI::Range(0, 1 << 30));
  auto* window = cmd->add_flag("--sliding-window", o->sliding_window,
                               "with --stream: recompute the last -c tokens from scratch for every token (the baseline)");
  cmd->callback([o, window] {
    if (window->count() > 0 && o->stream_tokens == 0) throw CLI::ValidationError("--sliding-window", "needs --stream N");
    perplexity(*o);
  });
}

}  // namespace ringlm
