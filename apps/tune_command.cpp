// `ringlm tune`: finds, on this machine, the number of tokens from which dequantize + sgemm beats
// the int8 kernels, and on a CPU with AMX the number from which the int8 products on the tiles
// beat the AVX-512 kernels, for each weight shape of a model, and writes them as the CPU
// backend's tuning table (backends/cpu/tuning.h), which `run`, `bench` and `perplexity` then
// read at load.
//
// Method: every distinct (type, N, K) among the model's weights that the int8 kernels run is
// prepared on two backends, one forced to the int8 kernels (a crossover no call reaches, no
// tiles) and one forced to the fp32 path (crossover 1), and, where amx_state() is on (or
// emulated), on a third that takes the tiles from one token on; all multiply the same random
// activations at M = 8, 16, ... up to --max-m. Each time is the median of several calls after
// an untimed warm-up; the paths' calls alternate, so that load from other processes slows them alike.
// A busy machine still defeats this (with several threads, one preempted thread holds the others
// at every barrier): the run warns when it got much less CPU time than its threads asked for.
// The crossover is the smallest M from which sgemm wins at every larger M as well. (Below 16
// tokens the fp32 path multiplies row by row instead of through sgemm: what such a low
// crossover would run, so that is what is timed.)
//
// Then, with the kernels it chose, the model's speculative checking passes: a pass of the
// evaluated token and k = 1..8 drafted ones against a decode step, with kPassContext tokens in
// the cache, the passes of every length in turn, round after round, each rolled back. The
// medians' ratios are the passes' costs in decode steps, from which run, chat, batch and serve
// choose their drafts' lengths (core/speculative/draft_length.h).
#include "apps/tune_command.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "backends/cpu/amx.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/tuning.h"
#include "core/gguf/gguf.h"
#include "core/model/loader.h"
#include "core/session/timing.h"

namespace ringlm {

namespace {

struct TuneOptions {
  std::string model_path;
  int n_threads = 0;
  std::string output;  // empty: $RINGLM_TUNING, else the default path
  int max_m = 512;
};

// Decode batches to long prompt chunks; denser where crossovers fall on today's machines.
constexpr int64_t kTokenCounts[] = {8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512};
// Timed calls per path and M: at least kMinReps and kMinMs in all, at most kMaxReps.
constexpr size_t kMinReps = 5;
constexpr size_t kMaxReps = 200;
constexpr double kMinMs = 100;
// Checking passes: up to kMaxDraft drafted tokens, kPassContext tokens already in the cache (a
// short chat's), at least kMinRounds rounds and kMinPassMs of passes in all, at most kMaxRounds.
constexpr int kMaxDraft = 8;
constexpr int kPassContext = 256;
constexpr int kMinRounds = 7, kMaxRounds = 60;
constexpr double kMinPassMs = 2000;
// Below this share of CPU time per thread the timings measure the other processes.
constexpr double kMinCpuShare = 0.6;

// One weight of a distinct shape, multiplied in place from the mapped file.
struct Shape {
  WeightView weight;
  std::string label;  // "Q4_1 576x1536" (N x K)
};

std::string type_name(TensorType type) {
  const auto traits = type_traits(static_cast<uint32_t>(type));
  return traits ? std::string(traits->name) : "type " + std::to_string(static_cast<uint32_t>(type));
}

// The weights the model multiplies with the int8 kernels, one per (type, N, K). A tied model uses
// token_embd as its output projection; beside an output.weight it is only read row by row.
std::vector<Shape> tunable_shapes(const GgufFile& gguf) {
  const bool embd_multiplied = gguf.find_tensor("output.weight") == nullptr;
  std::vector<Shape> shapes;
  for (const GgufTensorInfo& t : gguf.tensors()) {
    if (t.shape.size() != 2 || !cpu::packed_supported(t.type, t.cols())) continue;
    if (t.name == "token_embd.weight" && !embd_multiplied) continue;
    const WeightView w{t.name, t.type, t.rows(), t.cols(), t.data};
    const bool seen = std::any_of(shapes.begin(), shapes.end(), [&](const Shape& s) {
      return s.weight.type == w.type && s.weight.rows == w.rows && s.weight.cols == w.cols;
    });
    if (!seen) shapes.push_back({w, type_name(w.type) + " " + std::to_string(w.rows) + "x" + std::to_string(w.cols)});
  }
  return shapes;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// CPU seconds this process has run (all threads).
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return seconds(u.ru_utime) + seconds(u.ru_stime);
}

// The paths on one weight: each backend holds its own prepared copy. No tiles: a null backend.
struct Contenders {
  Backend& int8;
  Backend& sgemm;
  Backend* tiles;
  const PreparedWeight& int8_w;
  const PreparedWeight& sgemm_w;
  const PreparedWeight* tiles_w;
};

double time_call(Backend& b, const PreparedWeight& w, const float* x, int64_t m, float* y) {
  const auto t0 = std::chrono::steady_clock::now();
  b.matmul(w, x, m, y);
  return ms_since(t0);
}

TuningPoint measure(const Contenders& c, const float* x, int64_t m, float* y) {
  // Warm-up: buffers grow to this M, the weight comes into cache, the threads wake.
  time_call(c.int8, c.int8_w, x, m, y);
  time_call(c.sgemm, c.sgemm_w, x, m, y);
  if (c.tiles != nullptr) time_call(*c.tiles, *c.tiles_w, x, m, y);
  std::vector<double> int8_ms, sgemm_ms, tiles_ms;
  double total = 0;
  while (int8_ms.size() < kMaxReps && (int8_ms.size() < kMinReps || total < 2 * kMinMs)) {
    int8_ms.push_back(time_call(c.int8, c.int8_w, x, m, y));
    sgemm_ms.push_back(time_call(c.sgemm, c.sgemm_w, x, m, y));
    total += int8_ms.back() + sgemm_ms.back();
    if (c.tiles != nullptr) {
      tiles_ms.push_back(time_call(*c.tiles, *c.tiles_w, x, m, y));
      total += tiles_ms.back();
    }
  }
  return {m, median(int8_ms), median(sgemm_ms), tiles_ms.empty() ? -1.0 : median(tiles_ms)};
}

std::string crossover_text(int64_t crossover) {
  return crossover >= KernelTable::kNever ? "never (int8 wins)" : "M >= " + std::to_string(crossover);
}

std::string tiles_text(int64_t from) {
  if (from == KernelEntry::kTilesNotMeasured) return "-";
  return from >= KernelTable::kNever ? "never (AVX-512 wins)" : "M >= " + std::to_string(from);
}

// The fastest path of a point, for the printed table.
const char* fastest(const TuningPoint& p) {
  if (p.tiles_ms >= 0 && p.tiles_ms < p.int8_ms && p.tiles_ms < p.sgemm_ms) return "tiles";
  return p.sgemm_ms < p.int8_ms ? "sgemm" : "int8";
}

KernelEntry tune_shape(const Shape& s, Backend& int8, Backend& sgemm, Backend* tiles, const std::vector<int64_t>& ms,
                       const std::vector<float>& x, std::vector<float>& y) {
  const auto int8_w = int8.prepare(s.weight);
  const auto sgemm_w = sgemm.prepare(s.weight);
  const auto tiles_w = tiles != nullptr ? tiles->prepare(s.weight) : nullptr;
  const Contenders c{int8, sgemm, tiles, *int8_w, *sgemm_w, tiles_w.get()};
  KernelEntry e;
  e.type = s.weight.type;
  e.n = s.weight.rows;
  e.k = s.weight.cols;
  std::vector<TuningPoint> points;
  for (const int64_t m : ms) {
    const TuningPoint p = measure(c, x.data(), m, y.data());
    char tiles_ms[16] = "-";
    if (p.tiles_ms >= 0) std::snprintf(tiles_ms, sizeof tiles_ms, "%.3f", p.tiles_ms);
    std::printf("| %-16s | %4lld | %10.3f | %10.3f | %10s | %-6s |\n", s.label.c_str(), static_cast<long long>(m), p.int8_ms,
                p.sgemm_ms, tiles_ms, fastest(p));
    std::fflush(stdout);
    points.push_back(p);
    e.m.push_back(m);
    e.int8_ms.push_back(p.int8_ms);
    e.sgemm_ms.push_back(p.sgemm_ms);
    if (p.tiles_ms >= 0) e.tiles_ms.push_back(p.tiles_ms);
  }
  e.crossover = crossover_from_timings(points);
  if (tiles != nullptr) e.tiles_from = tiles_from_timings(points);
  return e;
}

// Where the tiles are measured: on this CPU's tiles, or on their emulation (RINGLM_AMX=emulate,
// which tests the measuring anywhere; it never wins).
bool tiles_measured() {
  const cpu::AmxState state = cpu::amx_state();
  return state == cpu::AmxState::kOn || state == cpu::AmxState::kEmulated;
}

// What a checking pass of 1 + k rows takes against a decode step, k = 1..kMaxDraft, for the model
// at `path` on a backend with `table`'s kernel choice.
PassCostEntry tune_passes(const std::string& path, int threads, const KernelTable& table) {
  LoadedModel m = load_model(path, make_cpu_backend(threads, ComputeType::kInt8, table));
  LlamaModel& model = *m.model;
  const int32_t n_vocab = model.hparams().n_vocab;
  KvCache cache = model.make_cache(kPassContext + kMaxDraft + 1);
  // Token ids spread over the vocabulary: the costs do not depend on which tokens they are.
  std::vector<int32_t> context(kPassContext);
  for (int i = 0; i < kPassContext; ++i) context[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919L + 13) % n_vocab);
  std::vector<float> logits(static_cast<size_t>(kMaxDraft + 1) * static_cast<size_t>(n_vocab));
  model.forward(context, cache, logits.data());
  const auto pass = [&](int k, int round) {
    std::vector<int32_t> tokens(static_cast<size_t>(k + 1));
    for (int i = 0; i <= k; ++i) tokens[static_cast<size_t>(i)] = static_cast<int32_t>((round * 31L + i * 101L) % n_vocab);
    const auto t0 = std::chrono::steady_clock::now();
    if (k == 0) {
      model.forward(tokens, cache, logits.data());
    } else {
      model.forward_steps(tokens, cache, logits.data());
    }
    const double ms = ms_since(t0);
    cache.rollback(k + 1);
    return ms;
  };
  for (int k = 0; k <= kMaxDraft; ++k) pass(k, 0);  // warm-up: buffers at their size, weights in cache
  std::vector<std::vector<double>> ms(kMaxDraft + 1);
  double total = 0;
  for (int round = 1; round <= kMaxRounds && (round <= kMinRounds || total < kMinPassMs); ++round) {
    for (int k = 0; k <= kMaxDraft; ++k) {
      ms[static_cast<size_t>(k)].push_back(pass(k, round));
      total += ms[static_cast<size_t>(k)].back();
    }
  }
  PassCostEntry entry;
  entry.model = std::filesystem::path(path).filename().string();
  entry.bytes = static_cast<int64_t>(std::filesystem::file_size(path));
  entry.threads = threads;
  const double step_ms = median(ms[0]);
  std::printf("\nchecking passes of speculative decoding, %d tokens in the cache (%zu rounds):\n\n", kPassContext, ms[0].size());
  std::printf("| drafted tokens | ms | decode steps |\n| ---: | ---: | ---: |\n| 0 | %.3f | 1.000 |\n", step_ms);
  for (int k = 1; k <= kMaxDraft; ++k) {
    const double k_ms = median(ms[static_cast<size_t>(k)]);
    entry.cost.push_back(k_ms / step_ms);
    std::printf("| %d | %.3f | %.3f |\n", k, k_ms, k_ms / step_ms);
  }
  return entry;
}

// What an earlier tune on this machine (the same CPU, SIMD target and thread count) left in the
// table and this run did not measure: other weight shapes' crossovers and other model files'
// checking passes stay, so that tuning a second model does not forget the first. A table from
// another machine is replaced whole. Returns how many were kept.
size_t keep_earlier_measurements(KernelTable& table, const std::string& path) {
  const KernelTable earlier = load_kernel_table(path, /*missing_ok=*/true);
  const TuningMachine& m = earlier.machine;
  if (m.cpu != table.machine.cpu || m.target != table.machine.target || m.threads != table.machine.threads) return 0;
  size_t kept = 0;
  for (const KernelEntry& e : earlier.entries()) {
    const bool measured = std::any_of(table.entries().begin(), table.entries().end(), [&](const KernelEntry& t) {
      return t.type == e.type && t.n == e.n && t.k == e.k;
    });
    if (!measured) table.set(e), ++kept;
  }
  for (const PassCostEntry& p : earlier.passes) {
    const bool measured = std::any_of(table.passes.begin(), table.passes.end(), [&](const PassCostEntry& t) {
      return t.model == p.model && t.bytes == p.bytes && t.threads == p.threads;
    });
    if (!measured) table.passes.push_back(p), ++kept;
  }
  return kept;
}

std::string output_path(const TuneOptions& o) {
  if (!o.output.empty()) return o.output;
  // Where the backend will look: $RINGLM_TUNING when it names a file.
  if (const char* env = std::getenv("RINGLM_TUNING"); env != nullptr && *env != '\0' && std::string(env) != "off") {
    return env;
  }
  return default_kernel_table_path();
}

void tune(const TuneOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::unique_ptr<GgufFile> gguf = GgufFile::open(resolve_model_path(o.model_path));
  const std::vector<Shape> shapes = tunable_shapes(*gguf);
  if (shapes.empty()) {
    throw std::runtime_error(gguf->path() + ": no weight matrices the packed kernels run: nothing to tune");
  }
  std::vector<int64_t> ms;
  for (const int64_t m : kTokenCounts) {
    if (m <= o.max_m) ms.push_back(m);
  }
  const int threads = resolve_threads(o.n_threads);
  KernelTable avx512_only, tiles_always;  // int8 for every M; on the tiles from M = 1 or never
  avx512_only.default_tiles_from = KernelTable::kNever;
  tiles_always.default_tiles_from = 1;
  auto int8 = make_cpu_backend(threads, ComputeType::kInt8, avx512_only);
  auto sgemm = make_cpu_backend(threads, ComputeType::kInt8, 1);
  auto tiles = tiles_measured() ? make_cpu_backend(threads, ComputeType::kInt8, tiles_always) : nullptr;

  int64_t max_n = 0, max_k = 0;
  for (const Shape& s : shapes) {
    max_n = std::max(max_n, s.weight.rows);
    max_k = std::max(max_k, s.weight.cols);
  }
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(ms.back() * max_k));
  for (float& v : x) v = normal(rng);
  std::vector<float> y(static_cast<size_t>(ms.back() * max_n));

  KernelTable table;
  table.machine = this_machine(threads);
  std::printf("ringlm tune: %zu shapes, %d threads, %s, target %s, amx %s\n\n", shapes.size(), threads,
              table.machine.cpu.c_str(), table.machine.target.c_str(), cpu::amx_state_words(cpu::amx_state()).c_str());
  std::printf("| %-16s | %4s | %10s | %10s | %10s | %-6s |\n", "shape (N x K)", "M", "int8 ms", "sgemm ms", "tiles ms",
              "faster");
  std::printf("| %s | ---: | ---------: | ---------: | ---------: | ------ |\n", std::string(16, '-').c_str());
  const double cpu0 = cpu_seconds();
  const auto timed0 = std::chrono::steady_clock::now();
  for (const Shape& s : shapes) table.set(tune_shape(s, *int8, *sgemm, tiles.get(), ms, x, y));
  int8.reset();
  sgemm.reset();
  tiles.reset();
  table.passes.push_back(tune_passes(gguf->path(), threads, table));
  const double timed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed0).count();
  // The threads spin between calls, so an idle machine gives them all their wall time.
  const double cpu_share = (cpu_seconds() - cpu0) / (timed_s * threads);

  std::printf("\n| %-16s | %-17s | %-20s |\n| %s | %s | %s |\n", "shape (N x K)", "sgemm from", "AMX tiles from",
              std::string(16, '-').c_str(), std::string(17, '-').c_str(), std::string(20, '-').c_str());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const KernelEntry& e = table.entries()[i];
    std::printf("| %-16s | %-17s | %-20s |\n", shapes[i].label.c_str(), crossover_text(e.crossover).c_str(),
                tiles_text(e.tiles_from).c_str());
  }
  const std::string path = output_path(o);
  const size_t kept = keep_earlier_measurements(table, path);
  save_kernel_table(table, path);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fflush(stdout);
  if (cpu_share < kMinCpuShare) {
    std::fprintf(stderr, "ringlm tune: warning: got %.0f%% of the CPU time of %d threads (a busy machine?): the "
                 "crossovers may be off; run again when it is idle\n", 100 * cpu_share, threads);
  }
  std::fprintf(stderr, "ringlm tune: wrote %s (%zu entries, checking passes of %zu models; %zu kept from earlier runs) in %.1f s\n",
               path.c_str(), table.entries().size(), table.passes.size(), kept, s);
}

}  // namespace

void add_tune_command(CLI::App& app) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* cmd = app.add_subcommand("tune", "measure where sgemm, and the AMX tiles, overtake the int8 kernels on this machine");
  cmd->add_option("-m,--model", o->model_path, "GGUF model file (default: $RINGLM_MODEL, else the model setup installed)");
  cmd->add_option("-t,--threads", o->n_threads, "CPU threads (0: all cores)")->check(CLI::Range(0, 1024));
  cmd->add_option("-o,--output", o->output, "tuning table to write (default: $RINGLM_TUNING, else the cache directory)");
  cmd->add_option("--max-m", o->max_m, "largest token count measured")->check(CLI::Range(8, 1 << 16))->capture_default_str();
  cmd->callback([o] { tune(*o); });
}

}  // namespace ringlm
