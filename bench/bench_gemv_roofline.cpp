// Decode's weight products against the memory-bandwidth roofline.
//
//   bench_gemv_roofline [--layers 4] [--threads 1,2] [--tokens 1,2,4,8,16] [--runs 7]
//                       [--formats q4_0,q4_k,q6_k,...] [--hot | --l2] [--shape qwen3-30b-a3b]
//
// One "step" is what a decode step asks of the packed kernels on Llama-2-7B: per layer the q/k/v
// projections (3 x 4096x4096, one parallel region as matmul_many runs them), o (4096x4096),
// gate/up (2 x 11008x4096, one region) and down (4096x11008), each region after preparing its
// input once (quantized per 32 and per 256), rows split over the OpenMP threads in 16-row groups
// as the CPU backend splits them. The layers' packed matrices sit in one buffer (4 layers:
// ~450 MB in Q4_0, far past the L3) and a step reads every byte once, as a real decode step does.
// Formats: any GGUF type name the packed kernels run (q4_0, q4_k, q5_0, iq4_xs, f16, ...) and
// ringlm's INT4 types (i4s-g128, i4a-g32-f32, ...).
// --shape qwen3-30b-a3b runs a Qwen3-30B-A3B decode step's products instead (2048 columns: q|k|v,
// o, 8 experts' gate and up, their downs; ~30 MB a layer in Q4_0), the short matrices a
// mixture of experts reads.
//
// For every format, thread count and token count M it prints the median step time, the weight
// bytes read per second (GB/s, 1e9 bytes/s: the packed bytes, which are the file's bytes plus
// a few percent of header padding for some formats) and, for each thread count, the median read
// bandwidth of the same buffer by a plain read loop (AVX2 loads), measured in alternation with
// the steps so that both see the same machine load; "roofline" = GB/s / that figure. "2-stream"
// is a second probe taken in the same alternation: one parallel region for the whole step, each
// thread reading its slice of every matrix as two streams in lock-step, bench_bandwidth's best
// variant on some machines (Zen 3); where it reads well above the first probe, the kernels' one
// stream per thread and call is itself a limit.
// --hot cycles over the first q matrix only (L3-resident): the kernels' compute speed.
// Packing the model is timed once (file MB/s).
// --l2 runs instead a matrix of 4096 columns small enough for the L2 (about 256 KiB), 64 calls
// per step, and prints ns per 32 weights (all M tokens) per core: compute speed with little
// dependence on the memory load of a shared machine.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/kernel_packed.h"
#include "backends/cpu/quantize_acts.h"
#include "backends/cpu/tuning.h"
#include "quant/int4.h"
#include "tests/weight_formats.h"

namespace {

using ringlm::TensorType;

struct Options {
  int layers = 4;
  int runs = 7;
  bool hot = false;
  bool l2 = false;
  bool moe = false;  // --shape qwen3-30b-a3b
  std::vector<int> threads{1, 2};
  std::vector<int> tokens{1, 2, 4, 8, 16};
  std::vector<std::string> formats{"q4_0", "q4_k", "q6_k", "q5_0", "q8_0"};
};

// A weight type by name (case-insensitive): a GGUF type the packed kernels run, or one of
// ringlm's INT4 types ("i4s-g128" is i4s-g128 with fp16 scales).
std::optional<TensorType> parse_format(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& [type, test_name] : ringlm::test::packed_types()) {
    std::string spelled = test_name;
    for (char& c : spelled) c = c == '_' && type >= static_cast<TensorType>(ringlm::kInt4TypeBase) ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name == spelled) return type;
  }
  return std::nullopt;
}

struct Matrix {
  int64_t rows, cols;
  std::shared_ptr<const ringlm::cpu::PackedWeight> packed;  // shared by --hot's copies
};

// The calls of one decode step: each a list of matrices sharing one input (one parallel region).
using Region = std::vector<Matrix>;

struct Model {
  ringlm::cpu::WeightArena arena;  // the packed matrices, in the order a step reads them
  std::vector<const uint8_t*> spans;  // first byte of each distinct packed matrix (probe order)
  std::vector<size_t> span_bytes;
  size_t buffer = 0;     // packed bytes of distinct weights (the probe reads them all)
  size_t bytes = 0;      // packed bytes a step reads
  size_t file_bytes = 0;  // the bytes a step reads, as they are in the file
  size_t packed_file_bytes = 0;  // the distinct weights' bytes in the file (what packing read)
  std::vector<Region> step;
  double pack_s = 0;  // seconds packing took over all distinct matrices
};

constexpr int64_t kDim = 4096, kFf = 11008;
// Qwen3-30B-A3B: model width, expert width, heads of 128 (32 query, 4 key/value), experts used.
constexpr int64_t kMoeDim = 2048, kMoeFf = 768, kMoeQ = 4096, kMoeKv = 512;
constexpr int kMoeUsed = 8;
constexpr int kL2Calls = 64;             // --l2: calls per step
constexpr size_t kL2Bytes = 256 << 10;  // --l2: the matrix's size at most

enum class Mode { kDecode, kHot, kL2 };

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Random weights of the type, packed one matrix at a time (a 7B layer's worth of source bytes
// at most in memory).
struct Shape {
  int64_t rows, cols;
};

// A Qwen3-30B-A3B decode step's products, as the CPU backend's regions run them: q|k|v, o, the
// eight chosen experts' gate and up (one region, one input), their downs (one region; each
// expert's input is its own in the model, one shared input here: the weights' bytes are the
// same). The router (F32 in the files) is left out.
std::vector<std::vector<Shape>> moe_layer() {
  std::vector<Shape> gate_up, down;
  for (int e = 0; e < 2 * kMoeUsed; ++e) gate_up.push_back({kMoeFf, kMoeDim});
  for (int e = 0; e < kMoeUsed; ++e) down.push_back({kMoeDim, kMoeFf});
  return {{{kMoeQ, kMoeDim}, {kMoeKv, kMoeDim}, {kMoeKv, kMoeDim}}, {{kMoeDim, kMoeQ}}, gate_up, down};
}

std::unique_ptr<Model> make_model(TensorType type, int layers, Mode mode, bool moe) {
  const bool hot = mode != Mode::kDecode;  // every call on one matrix
  const int64_t l2_rows = std::max<int64_t>(
      16, static_cast<int64_t>(kL2Bytes / ringlm::row_bytes(type, kDim)) / 16 * 16);
  // Hot: a layer's seven products as seven calls on one 4096x4096 matrix. L2: kL2Calls calls
  // on one L2-sized matrix (one "layer").
  const std::vector<std::vector<Shape>> layer =
      mode == Mode::kL2 ? std::vector<std::vector<Shape>>(kL2Calls, {{l2_rows, kDim}})
      : hot             ? std::vector<std::vector<Shape>>(7, {{kDim, kDim}})
      : moe             ? moe_layer()
                        : std::vector<std::vector<Shape>>{{{kDim, kDim}, {kDim, kDim}, {kDim, kDim}},
                                                          {{kDim, kDim}},
                                                          {{kFf, kDim}, {kFf, kDim}},
                                                          {{kDim, kFf}}};
  if (mode == Mode::kL2) layers = 1;
  auto m = std::make_unique<Model>();
  std::mt19937 rng(1);
  std::shared_ptr<const ringlm::cpu::PackedWeight> shared;  // hot: one packed copy for all calls
  for (int l = 0; l < layers; ++l) {
    for (const auto& shapes : layer) {
      Region region;
      for (Shape s : shapes) {
        Matrix w{s.rows, s.cols, shared};
        if (!w.packed) {
          const std::vector<uint8_t> src = ringlm::test::random_weights(type, s.rows, s.cols, rng);
          m->pack_s += seconds([&] {
            w.packed = std::make_shared<const ringlm::cpu::PackedWeight>(ringlm::cpu::pack_weight(
                type, src.data(), ringlm::row_bytes(type, s.cols), s.rows, s.cols, &m->arena));
          });
          m->packed_file_bytes += src.size();
          m->spans.push_back(w.packed->data.get());
          m->span_bytes.push_back(w.packed->bytes());
          m->buffer += w.packed->bytes();
          if (hot) shared = w.packed;
        }
        region.push_back(w);
        m->bytes += w.packed->bytes();
        m->file_bytes += ringlm::row_bytes(type, s.cols) * static_cast<size_t>(s.rows);
      }
      m->step.push_back(region);
    }
  }
  return m;
}

// The input of up to 16 tokens of the longest row in every prepared form, from random values.
struct Acts {
  std::vector<float> x;
  std::vector<int8_t> q, q256;
  std::vector<float> d, s, d256;
  std::vector<int32_t> sum16, sum32, sum;
  Acts(int64_t tokens, int64_t k)
      : x(static_cast<size_t>(tokens * k)), q(x.size()), q256(x.size()), d(x.size() / 32), s(x.size() / 32),
        d256(x.size() / 256 + 1), sum16(x.size() / 16), sum32(x.size() / 32), sum(x.size() / 32) {
    std::mt19937 rng(2);
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(rng);
  }
  // Rows of k, quantized as the backend does once per region.
  ringlm::cpu::PackedInput prepare(int64_t tokens, int64_t k) {
    ringlm::cpu::PackedInput in;
    in.block = {q.data(), d.data(), s.data(), sum.data(), k};
    in.super = {q256.data(), d256.data(), sum16.data(), sum32.data(), k};
    in.f32 = x.data();
    ringlm::cpu::quantize_acts(x.data(), 0, tokens, in.block);
    if (k % 256 == 0) ringlm::cpu::quantize_acts_super(x.data(), 0, tokens, in.super);
    return in;
  }
};

// Thread t's share of `units` among n, as the backend splits tiles.
int64_t share(int64_t units, int t, int n) { return units * t / n; }

// One decode step: per region, prepare the input (one thread: it is tiny), then split the
// region's 16-row groups over the threads.
void run_step(const Model& model, Acts& acts, int64_t tokens, int threads, std::vector<float>& y) {
  constexpr int64_t unit = ringlm::cpu::kPackRows;
  for (const Region& region : model.step) {
    const ringlm::cpu::PackedInput in = acts.prepare(tokens, region[0].cols);
    int64_t tiles = 0;
    for (const Matrix& w : region) tiles += (w.rows + unit - 1) / unit;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t begin = share(tiles, t, n), end = share(tiles, t + 1, n);
      int64_t first = 0;  // of the current matrix, in the region's tile numbering
      for (const Matrix& w : region) {
        const int64_t count = (w.rows + unit - 1) / unit;
        const int64_t t0 = std::max(begin, first) - first, t1 = std::min(end, first + count) - first;
        if (t0 < t1) ringlm::cpu::gemm_packed(*w.packed, t0 * unit, std::min(w.rows, t1 * unit), in, tokens, y.data(), w.rows);
        first += count;
      }
    }
  }
}

// Sums 32-byte words of [p, p + n_vec) with four accumulators: bench_bandwidth's read loop.
__attribute__((target("avx2"))) uint64_t read_avx2(const __m256i* p, size_t n_vec) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 4 <= n_vec; i += 4) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(p + i));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(p + i + 1));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(p + i + 2));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(p + i + 3));
  }
  for (; i < n_vec; ++i) a0 = _mm256_add_epi64(a0, _mm256_load_si256(p + i));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// One read pass over the model's packed matrices with `threads` threads, each streaming its own
// slice of each.
uint64_t read_pass(const Model& model, int threads) {
  uint64_t total = 0;
  for (size_t i = 0; i < model.spans.size(); ++i) {
    const auto* buf = reinterpret_cast<const __m256i*>(model.spans[i]);
    const size_t n_vec = model.span_bytes[i] / sizeof(__m256i);
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      const size_t per = n_vec / static_cast<size_t>(omp_get_num_threads());
      total += read_avx2(buf + per * static_cast<size_t>(omp_get_thread_num()), per);
    }
  }
  return total;
}

// Two streams of 256-bit loads in lock-step, over [p, p + 2 * n_vec).
__attribute__((target("avx2"))) uint64_t read2_avx2(const __m256i* p, size_t n_vec) {
  const __m256i* q = p + n_vec;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 2 <= n_vec; i += 2) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(p + i));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(p + i + 1));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(q + i));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(q + i + 1));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// The read loop bench_bandwidth finds best on some machines: one parallel region, each thread
// reading its slice of every matrix as two streams in lock-step.
uint64_t read_pass_two_streams(const Model& model, int threads) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  for (size_t i = 0; i < model.spans.size(); ++i) {
    const auto* buf = reinterpret_cast<const __m256i*>(model.spans[i]);
    const size_t per = model.span_bytes[i] / sizeof(__m256i) / static_cast<size_t>(omp_get_num_threads()) / 4 * 2;
    total += read2_avx2(buf + 2 * per * static_cast<size_t>(omp_get_thread_num()), per);
  }
  return total;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<std::string> split(const char* text) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = text;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == '\0') break;
    } else {
      cur += *p;
    }
  }
  return out;
}

std::vector<int> int_list(const char* text, int lo, int hi) {
  std::vector<int> out;
  for (const std::string& s : split(text)) {
    const int v = std::atoi(s.c_str());
    if (v < lo || v > hi) {
      std::fprintf(stderr, "bench_gemv_roofline: %s is out of [%d, %d]\n", s.c_str(), lo, hi);
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--layers") {
      o.layers = std::max(1, std::atoi(argv[++i]));
    } else if (i + 1 < argc && a == "--runs") {
      o.runs = std::max(1, std::atoi(argv[++i]));
    } else if (i + 1 < argc && a == "--threads") {
      o.threads = int_list(argv[++i], 1, 1024);
    } else if (i + 1 < argc && a == "--tokens") {
      o.tokens = int_list(argv[++i], 1, 16);
    } else if (i + 1 < argc && a == "--formats") {
      o.formats = split(argv[++i]);
    } else if (a == "--hot") {
      o.hot = true;
    } else if (a == "--l2") {
      o.l2 = true;
    } else if (i + 1 < argc && a == "--shape" && std::string(argv[i + 1]) == "qwen3-30b-a3b") {
      o.moe = true;
      ++i;
    } else {
      std::fprintf(stderr,
                   "usage: bench_gemv_roofline [--layers N] [--runs R] [--threads 1,2] [--tokens 1,2,4,8,16]\n"
                   "                           [--formats q4_0,q4_k,...] [--hot | --l2] [--shape qwen3-30b-a3b]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  ringlm::apply_simd_target_override();  // RINGLM_SIMD_TARGET=AVX2 measures that target's kernels
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "bench_gemv_roofline: the bandwidth probe needs AVX2\n");
    return 1;
  }
  const Mode mode = o.l2 ? Mode::kL2 : o.hot ? Mode::kHot : Mode::kDecode;
  if (mode == Mode::kL2) {
    std::printf("L2-resident matrix (<= %zu KiB, K = %lld), %d calls per step, median of %d runs\n", kL2Bytes >> 10,
                static_cast<long long>(kDim), kL2Calls, o.runs);
    std::printf("%-14s %7s %6s %9s %13s\n", "format", "threads", "M", "ms/step", "ns/32w/core");
  } else {
    std::printf("%s decode step: %d layer(s)%s, median of %d runs\n", o.moe ? "Qwen3-30B-A3B" : "Llama-2-7B", o.layers,
                o.hot ? ", hot (one matrix)" : "", o.runs);
    std::printf("%-14s %7s %6s %9s %8s %11s %9s %9s\n", "format", "threads", "M", "ms/step", "GB/s", "probe GB/s",
                "roofline", "2-stream");
  }
  uint64_t sink = 0;
  for (const std::string& name : o.formats) {
    const std::optional<TensorType> type = parse_format(name);
    if (!type) {
      std::fprintf(stderr, "bench_gemv_roofline: unknown format %s\n", name.c_str());
      return 2;
    }
    const std::unique_ptr<Model> model = make_model(*type, o.layers, mode, o.moe);
    if (mode != Mode::kL2) {  // (an L2-sized matrix packs too fast to time)
      std::printf("%-14s packing: %.0f MB of file in %.3f s = %.0f MB/s (%d threads); packed %.0f MB\n", name.c_str(),
                  static_cast<double>(model->packed_file_bytes) / 1e6, model->pack_s,
                  static_cast<double>(model->packed_file_bytes) / 1e6 / model->pack_s, omp_get_max_threads(),
                  static_cast<double>(model->buffer) / 1e6);
    }
    Acts acts(16, kFf);
    std::vector<float> y(static_cast<size_t>(16 * kFf));
    int64_t blocks = 0;  // runs of 32 weights a step reads
    for (const Region& region : model->step) {
      for (const Matrix& w : region) blocks += w.rows * (w.cols / 32);
    }
    for (const int threads : o.threads) {
      for (const int tokens : o.tokens) {
        run_step(*model, acts, tokens, threads, y);  // warm-up
        if (mode != Mode::kL2) sink += read_pass(*model, threads);
        std::vector<double> step_s, probe_s, probe2_s;
        for (int r = 0; r < o.runs; ++r) {
          step_s.push_back(seconds([&] { run_step(*model, acts, tokens, threads, y); }));
          if (mode != Mode::kL2) probe_s.push_back(seconds([&] { sink += read_pass(*model, threads); }));
          if (mode != Mode::kL2) probe2_s.push_back(seconds([&] { sink += read_pass_two_streams(*model, threads); }));
        }
        const double t = median(step_s), gbs = static_cast<double>(model->bytes) / t / 1e9;
        if (mode == Mode::kL2) {
          std::printf("%-14s %7d %6d %9.3f %13.3f\n", name.c_str(), threads, tokens, t * 1e3,
                      t * 1e9 * threads / static_cast<double>(blocks));
        } else {
          const double probe = static_cast<double>(model->buffer) / median(probe_s) / 1e9;
          const double probe2 = static_cast<double>(model->buffer) / median(probe2_s) / 1e9;
          std::printf("%-14s %7d %6d %9.2f %8.2f %11.2f %9.2f %9.2f\n", name.c_str(), threads, tokens, t * 1e3, gbs, probe,
                      gbs / probe, probe2);
        }
        std::fflush(stdout);
      }
    }
    sink += static_cast<uint64_t>(y[0] != y[0]);
  }
  return sink == 42 ? 3 : 0;  // uses the sums, so the reads stay
}
