// `ringlm bench`: throughput measured the way llama-bench measures it, so that a row of ringlm's
// table and a row of llama-bench's table mean the same thing.
//
// Method (as in llama.cpp's tools/llama-bench): every test gets an untimed warm-up (the whole
// prompt for a pp test, one token for a tg test), then R timed repetitions, each starting from an
// empty KV cache. A pp test feeds one prompt of p random tokens in batches of -b; a tg test feeds
// n single tokens one after another (the first is BOS when the model adds BOS, the rest random),
// with nothing before them. t/s is (p + n) / time per repetition; the table shows mean ± sample
// standard deviation of those R rates.
#include "apps/bench_command.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "apps/pipeline_process.h"
#include "backends/cpu/tuning.h"
#include "core/model/loader.h"

namespace ringlm {

namespace {

struct BenchOptions {
  std::string model_path;
  std::string n_prompt = "512";  // comma lists, as llama-bench takes them
  std::string n_gen = "128";
  std::string n_threads = "0";
  std::string n_depth = "0";  // tokens already in the context when a test starts (llama-bench -d)
  int n_batch = 2048;
  int reps = 5;
  std::string output = "md";
  bool no_warmup = false;
  ComputeType compute = ComputeType::kInt8;
  std::string device = "cpu";
  std::string plugin_dir;
  DevicePlacement placement;  // --gpu-layers, --cpu-moe, --n-cpu-moe
  std::string softmax = "async";  // decode attention: async (FlashDecoding++) or online
  std::string layer_split;         // --layer-split under mpirun ("": balanced by bytes)
  KvTypes cache_type = KvType::kF16;  // --cache-type, -ctk/-ctv
};

// One row of the result: a (p, n, threads) combination and its timed samples.
struct BenchTest {
  int n_prompt = 0;
  int n_gen = 0;
  int n_threads = 0;
  int n_depth = 0;
  std::string test_time;
  std::vector<uint64_t> samples_ns;
};

// What the table says about the model, read once per load.
struct ModelInfo {
  std::string filename;
  std::string type;  // "llama 135M Q4_1"
  uint64_t size = 0;
  uint64_t n_params = 0;
  int n_ubatch = 0;
  std::string backend;  // "CPU", or the plugin's name ("opencl")
  std::string device;   // the plugin device's description; empty on the CPU
  int n_gpu_layers = 0;  // layers on the plugin's device (--gpu-layers)
};

std::vector<int> parse_int_list(const std::string& text, const char* flag, int min_value) {
  std::vector<int> values;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < min_value) {
      throw std::runtime_error(std::string(flag) + ": '" + text + "' is not a comma-separated list of integers >= " +
                               std::to_string(min_value));
    }
    values.push_back(v);
  }
  if (values.empty()) throw std::runtime_error(std::string(flag) + ": empty list");
  return values;
}

// llama.cpp's names of general.file_type, so "model" reads the same in both tables.
std::string file_type_name(const GgufFile& gguf) {
  const auto ft = gguf.get_uint("general.file_type");
  if (!ft) return "?";
  switch (*ft) {
    case 0: return "all F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 7: return "Q8_0";
    case 8: return "Q5_0";
    case 9: return "Q5_1";
    case 10: return "Q2_K - Medium";
    case 11: return "Q3_K - Small";
    case 12: return "Q3_K - Medium";
    case 13: return "Q3_K - Large";
    case 14: return "Q4_K - Small";
    case 15: return "Q4_K - Medium";
    case 16: return "Q5_K - Small";
    case 17: return "Q5_K - Medium";
    case 18: return "Q6_K";
    case 25: return "IQ4_NL - 4.5 bpw";
    case 30: return "IQ4_XS - 4.25 bpw";
    case 32: return "BF16";
    case 38: return "MXFP4 MoE";
    default: return "type " + std::to_string(*ft);
  }
}

// "135M", "1.2B": a size label from the parameter count (llama.cpp uses a table keyed by layer
// count; the count itself is the one thing every model has).
std::string size_label(uint64_t n_params) {
  char buf[32];
  if (n_params < 1000ull * 1000 * 1000) {
    std::snprintf(buf, sizeof(buf), "%.0fM", static_cast<double>(n_params) / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.1fB", static_cast<double>(n_params) / 1e9);
  }
  return buf;
}

ModelInfo describe(const LoadedModel& m, const std::string& path) {
  ModelInfo info;
  info.filename = path;
  info.size = m.model->weight_bytes();
  info.n_params = static_cast<uint64_t>(m.model->n_params());
  info.type = m.model->hparams().arch + " " + size_label(info.n_params) + " " + file_type_name(*m.gguf);
  info.n_ubatch = m.model->max_batch();
  info.backend = std::string(m.backend->name());
  if (m.backend->offloads()) info.device = m.backend->device_description();
  for (int layer = 0; layer < m.model->hparams().n_layer; ++layer) {
    if (m.backend->offloads() && m.backend->layer_device(layer) != "cpu") ++info.n_gpu_layers;
  }
  return info;
}

// Timed work. Random ids stand in for text: speed does not depend on which tokens they are.
class Runner {
 public:
  Runner(LoadedModel& m, int n_batch) : m_(m), n_batch_(n_batch), rng_(1234) {
    logits_.resize(static_cast<size_t>(m.model->hparams().n_vocab));
  }

  void prompt(KvCache& cache, int n_prompt) {
    std::vector<int32_t> tokens;
    for (int done = 0; done < n_prompt;) {
      const int n = std::min(n_prompt - done, n_batch_);
      tokens.resize(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = random_token();
      if (done == 0 && bos() >= 0) tokens[0] = bos();
      m_.model->forward(tokens, cache, logits_.data());
      done += n;
    }
  }

  void generate(KvCache& cache, int n_gen) {
    int32_t token = bos() >= 0 ? bos() : random_token();
    for (int i = 0; i < n_gen; ++i) {
      m_.model->forward(std::span<const int32_t>(&token, 1), cache, logits_.data());
      token = random_token();
    }
  }

 private:
  int32_t bos() const { return m_.tokenizer->add_bos_by_default() ? m_.tokenizer->bos_id() : -1; }
  int32_t random_token() {
    return std::uniform_int_distribution<int32_t>(0, m_.model->hparams().n_vocab - 1)(rng_);
  }

  LoadedModel& m_;
  int n_batch_;
  std::mt19937 rng_;
  std::vector<float> logits_;
};

void run_test(LoadedModel& m, const BenchOptions& o, BenchTest& t) {
  Runner runner(m, o.n_batch);
  // The warm-up of a combined test runs its prompt and then one token without a clear between.
  KvCache cache = m.model->make_cache(t.n_depth + t.n_prompt + std::max(t.n_gen, 1), KvCacheOptions{o.cache_type});
  if (!o.no_warmup) {
    if (t.n_prompt > 0) runner.prompt(cache, t.n_prompt);
    if (t.n_gen > 0) runner.generate(cache, 1);
  }
  for (int r = 0; r < o.reps; ++r) {
    cache.clear();
    if (t.n_depth > 0) runner.prompt(cache, t.n_depth);  // the context the test runs at, untimed
    const auto t0 = std::chrono::steady_clock::now();
    if (t.n_prompt > 0) runner.prompt(cache, t.n_prompt);
    if (t.n_gen > 0) runner.generate(cache, t.n_gen);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    t.samples_ns.push_back(static_cast<uint64_t>(std::max<int64_t>(ns, 1)));
  }
}

template <typename T>
double mean(const std::vector<T>& v) {
  if (v.empty()) return 0;
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// Sample standard deviation (Bessel's correction), 0 for fewer than two samples, as llama-bench.
template <typename T>
double stdev(const std::vector<T>& v) {
  if (v.size() < 2) return 0;
  const double m = mean(v);
  double sq = 0;
  for (const T x : v) sq += (static_cast<double>(x) - m) * (static_cast<double>(x) - m);
  return std::sqrt(sq / static_cast<double>(v.size() - 1));
}

std::vector<double> rates(const BenchTest& t) {
  std::vector<double> ts;
  for (const uint64_t ns : t.samples_ns) ts.push_back(1e9 * (t.n_prompt + t.n_gen) / static_cast<double>(ns));
  return ts;
}

std::string test_name(const BenchTest& t) {
  const std::string depth = t.n_depth > 0 ? " @ d" + std::to_string(t.n_depth) : "";
  if (t.n_gen == 0) return "pp" + std::to_string(t.n_prompt) + depth;
  if (t.n_prompt == 0) return "tg" + std::to_string(t.n_gen) + depth;
  return "pp" + std::to_string(t.n_prompt) + "+tg" + std::to_string(t.n_gen) + depth;
}

std::string format(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

std::string size_text(uint64_t bytes) {
  const double mib = static_cast<double>(bytes) / 1024.0 / 1024.0;
  return mib < 1024.0 ? format("%.2f MiB", mib) : format("%.2f GiB", mib / 1024.0);
}

std::string params_text(uint64_t n) {
  const double d = static_cast<double>(n);
  return n < 1000ull * 1000 * 1000 ? format("%.2f M", d / 1e6) : format("%.2f B", d / 1e9);
}

// The KV cache's type columns, as llama-bench shows them: only for a type other than f16.
bool shows_cache_type(KvTypes types) { return types != KvTypes(KvType::kF16); }

void print_markdown_header(KvTypes cache_type) {
  const bool types = shows_cache_type(cache_type);
  std::printf("| %-30s | %10s | %10s | %-10s | %7s |%s %15s | %20s |\n", "model", "size", "params", "backend", "threads",
              types ? " type_k | type_v |" : "", "test", "t/s");
  std::printf("| %s | %s: | %s: | %s | %s: |%s %s: | %s: |\n", std::string(30, '-').c_str(), std::string(9, '-').c_str(),
              std::string(9, '-').c_str(), std::string(10, '-').c_str(), std::string(6, '-').c_str(),
              types ? " -----: | -----: |" : "", std::string(14, '-').c_str(), std::string(19, '-').c_str());
}

void print_markdown_row(const ModelInfo& info, const BenchTest& t, KvTypes cache_type) {
  const std::vector<double> ts = rates(t);
  const std::string tps = format("%.2f", mean(ts)) + " ± " + format("%.2f", stdev(ts));
  char types[32] = "";
  if (shows_cache_type(cache_type)) {
    std::snprintf(types, sizeof(types), " %6s | %6s |", kv_type_name(cache_type.keys), kv_type_name(cache_type.values));
  }
  // "±" is two bytes but one column: pad by one more so the columns still line up.
  std::printf("| %-30s | %10s | %10s | %-10s | %7d |%s %15s | %21s |\n", info.type.c_str(), size_text(info.size).c_str(),
              params_text(info.n_params).c_str(), info.backend.c_str(), t.n_threads, types, test_name(t).c_str(),
              tps.c_str());
  std::fflush(stdout);
}

// llama-bench's field names; values it has and ringlm does not (split mode) are given as
// llama-bench would report them for a CPU-only run.
nlohmann::ordered_json to_json(const ModelInfo& info, const BenchTest& t, int n_batch, KvTypes cache_type) {
  const std::vector<double> ts = rates(t);
  nlohmann::ordered_json j;
  j["build_commit"] = "ringlm";
  j["build_number"] = 0;
  j["cpu_info"] = cpu_model_name();
  j["gpu_info"] = info.device;
  j["backends"] = info.backend;
  j["model_filename"] = info.filename;
  j["model_type"] = info.type;
  j["model_size"] = info.size;
  j["model_n_params"] = info.n_params;
  j["n_batch"] = n_batch;
  j["n_ubatch"] = info.n_ubatch;
  j["n_threads"] = t.n_threads;
  j["type_k"] = kv_type_name(cache_type.keys);
  j["type_v"] = kv_type_name(cache_type.values);
  j["n_gpu_layers"] = info.n_gpu_layers;
  j["n_prompt"] = t.n_prompt;
  j["n_gen"] = t.n_gen;
  j["n_depth"] = t.n_depth;
  j["test_time"] = t.test_time;
  j["avg_ns"] = static_cast<uint64_t>(mean(t.samples_ns));
  j["stddev_ns"] = static_cast<uint64_t>(stdev(t.samples_ns));
  j["avg_ts"] = mean(ts);
  j["stddev_ts"] = stdev(ts);
  j["samples_ns"] = t.samples_ns;
  j["samples_ts"] = ts;
  return j;
}

// The tests in llama-bench's order: every pp value, then every tg value, for each thread count.
std::vector<BenchTest> plan(const BenchOptions& o, int threads) {
  std::vector<BenchTest> tests;
  for (const int d : parse_int_list(o.n_depth, "-d", 0)) {
    for (const int p : parse_int_list(o.n_prompt, "-p", 0)) {
      if (p > 0) tests.push_back({p, 0, threads, d, {}, {}});
    }
    for (const int n : parse_int_list(o.n_gen, "-n", 0)) {
      if (n > 0) tests.push_back({0, n, threads, d, {}, {}});
    }
  }
  return tests;
}

void bench(const BenchOptions& o) {
  const std::string path = resolve_model_path(o.model_path);
  if (!std::filesystem::exists(path)) throw std::runtime_error("model file '" + path + "' does not exist");
  const std::vector<int> thread_counts = parse_int_list(o.n_threads, "-t", 0);
  if (plan(o, 1).empty()) throw std::runtime_error("nothing to run: every -p and -n value is 0");

  // Under mpirun, rank 0 times and prints; the other ranks run the passes it announces.
  PipelineProcess& process = this_process();
  const bool prints = process.rank() == 0;
  const bool md = o.output == "md";
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  if (md && prints) print_markdown_header(o.cache_type);
  for (const int t_flag : thread_counts) {
    const int threads = resolve_threads(t_flag);
    omp_set_num_threads(threads);
    // The backend's thread count is fixed at load.
    LoadedModel m = load_model(path, threads, o.compute, o.device, o.plugin_dir, o.placement,
                               stage_picker(process, o.layer_split));
    m.model->set_async_softmax(o.softmax == "async");
    if (serve_as_later_rank(process, m)) continue;
    const ModelInfo info = describe(m, path);
    for (BenchTest& t : plan(o, threads)) {
      t.test_time = utc_now();
      run_test(m, o, t);
      if (md) print_markdown_row(info, t, o.cache_type);
      else all.push_back(to_json(info, t, o.n_batch, o.cache_type));
    }
    m.model->close_pipeline();
  }
  if (!prints) return;
  if (md) std::printf("\nbuild: ringlm 0.1.0\n");
  else std::printf("%s\n", all.dump(2).c_str());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand("bench", "measure prompt and generation speed as llama-bench does");
  cmd->add_option("-m,--model", o->model_path, "GGUF model file (default: $RINGLM_MODEL, else the model setup installed)");
  cmd->add_option("-p,--n-prompt", o->n_prompt, "prompt lengths, comma-separated (0: no pp test)")->capture_default_str();
  cmd->add_option("-n,--n-gen", o->n_gen, "generated lengths, comma-separated (0: no tg test)")->capture_default_str();
  add_cache_type_options(*cmd, o->cache_type);
  cmd->add_option("-t,--threads", o->n_threads, "thread counts, comma-separated (0: all cores)")->capture_default_str();
  cmd->add_option("--softmax", o->softmax, "decode attention softmax: async (FlashDecoding++'s unified max) or online")
      ->check(CLI::IsMember({"async", "online"}))
      ->capture_default_str();
  cmd->add_option("-d,--n-depth", o->n_depth, "context depths, comma-separated: tokens prefilled (untimed) before each test")
      ->capture_default_str();
  cmd->add_option("-b,--batch-size", o->n_batch, "tokens per forward call in a pp test")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--layer-split", o->layer_split,
                  "under mpirun -np N: layers per rank, e.g. 10,12 (default: balanced by the bytes of their weights)");
  cmd->add_option("-r,--repetitions", o->reps, "timed repetitions of each test")->check(CLI::Range(1, 1000))->capture_default_str();
  add_compute_option(*cmd, o->compute);
  add_device_options(*cmd, o->device, o->plugin_dir, o->placement);
  cmd->add_option("-o,--output", o->output, "output format: md or json")->check(CLI::IsMember({"md", "json"}))->capture_default_str();
  cmd->add_flag("--no-warmup", o->no_warmup, "skip the untimed warm-up run");
  cmd->callback([o] { bench(*o); });
}

}  // namespace ringlm
