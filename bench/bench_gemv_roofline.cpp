// Decode's weight products against the memory-bandwidth roofline.
//
//   bench_gemv_roofline [--layers 4] [--threads 1,2] [--tokens 1,2,4,8,16] [--runs 7]
//                       [--formats q4_0,i4s-g128,...] [--kernels inplace,packed] [--hot | --l2]
//
// One "step" is what a decode step asks of the int8 kernels on Llama-2-7B: per layer the q/k/v
// projections (3 x 4096x4096, one parallel region as matmul_many runs them), o (4096x4096),
// gate/up (2 x 11008x4096, one region) and down (4096x11008), each region after quantizing its
// input once, rows split over the OpenMP threads in 4-row tiles as the CPU backend splits them.
// The layers' matrices sit in one buffer (4 layers: ~450 MB in Q4_0, far past the 32 MiB L3) and
// a step reads every byte once, as a real decode step does.
//
// For every format, thread count and token count M it prints the median step time, the weight
// bytes read per second (GB/s, 1e9 bytes/s) and, for each thread count, the median read
// bandwidth of the same buffer by the bench_bandwidth loop (AVX2 loads), measured in alternation
// with the steps so that both see the same machine load; "roofline" = GB/s / that figure.
// --hot cycles over the first q matrix only (L3-resident): the kernels' compute speed.
//
// Kernels: "inplace" (gemm_int8 on the stored blocks, rows split in 4-row tiles) and "packed"
// (gemm_int8_packed on the row-interleaved copy made by pack_int8, rows split in 8-row groups),
// timed in alternation within each run so that both see the same machine load; the packed rows
// also print their speed-up over in-place. Packing the model is timed once (source MB/s).
// --l2 runs instead a matrix of 4096 columns small enough for the L2 (about 256 KiB), 64 calls
// per step, and prints ns per weight block (32 weights, all M tokens) per core: compute speed
// with little dependence on the memory load of a shared machine.
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

#include "backends/cpu/int8_kernels.h"
#include "backends/cpu/kernel_packed.h"
#include "quant/int4.h"

namespace {

using ringlm::Int4Format;
using ringlm::ScaleType;
using ringlm::TensorType;

struct Options {
  int layers = 4;
  int runs = 7;
  bool hot = false;
  bool l2 = false;
  std::vector<std::string> kernels{"inplace", "packed"};
  std::vector<int> threads{1, 2};
  std::vector<int> tokens{1, 2, 4, 8, 16};
  std::vector<std::string> formats{"q4_0", "q4_1", "q8_0", "i4s-g32", "i4s-g128", "i4a-g128", "i4s-g128-bf16",
                                   "i4a-g32-f32"};
};

// A weight format by name: GGML's q4_0/q4_1/q8_0 or ringlm's i4s/i4a-g32/g128[-f16|-bf16|-f32].
struct Format {
  std::string name;
  TensorType type;
  int group;           // weights per block
  size_t block_bytes;  // bytes per block
  ScaleType scale;     // storage of the scale (and min) at the block's start
  bool asymmetric;     // a min follows the scale
};

std::optional<Format> parse_format(const std::string& name) {
  if (name == "q4_0") return Format{name, TensorType::Q4_0, 32, 18, ScaleType::kF16, false};
  if (name == "q4_1") return Format{name, TensorType::Q4_1, 32, 20, ScaleType::kF16, true};
  if (name == "q8_0") return Format{name, TensorType::Q8_0, 32, 34, ScaleType::kF16, false};
  for (uint32_t id = ringlm::kInt4TypeBase; id < ringlm::kInt4TypeBase + 12; ++id) {
    const Int4Format f = *ringlm::int4_format(id);
    const std::string base = std::string(f.asymmetric ? "i4a" : "i4s") + "-g" + std::to_string(f.group);
    const char* suffix[] = {"-f16", "-bf16", "-f32"};
    const std::string full = base + suffix[static_cast<int>(f.scale)];
    if (name == full || (f.scale == ScaleType::kF16 && name == base)) {
      return Format{name, static_cast<TensorType>(id), f.group, ringlm::int4_block_bytes(f), f.scale, f.asymmetric};
    }
  }
  return std::nullopt;
}

// Random codes with small finite scales (and mins) of the format's storage type: the kernels'
// speed does not depend on the values, but NaN or subnormal scales would not be a fair test.
void fill_random(const Format& f, uint8_t* bytes, size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const int n_scales = f.asymmetric ? 2 : 1;
  for (size_t off = 0; off + f.block_bytes <= size; off += f.block_bytes) {
    for (int s = 0; s < n_scales; ++s) {
      const float v = scale(rng);
      if (f.scale == ScaleType::kF32) {
        std::memcpy(bytes + off + 4 * s, &v, 4);
      } else {
        const uint16_t h = f.scale == ScaleType::kF16 ? ringlm::fp32_to_fp16(v) : ringlm::fp32_to_bf16(v);
        std::memcpy(bytes + off + 2 * s, &h, 2);
      }
    }
  }
}

struct Matrix {
  int64_t rows, cols;
  const uint8_t* data;
  size_t row_stride;
  std::shared_ptr<const ringlm::cpu::PackedWeight> packed;  // the same weights, packed (shared by --hot's copies)
};

// The calls of one decode step: each a list of matrices sharing one input (one parallel region).
using Region = std::vector<Matrix>;

struct Model {
  std::unique_ptr<uint8_t, decltype(&std::free)> mem{nullptr, &std::free};
  size_t buffer = 0;  // bytes of distinct weights (the probe reads them all)
  size_t bytes = 0;   // weight bytes a step reads
  std::vector<Region> step;
  double pack_s = 0;  // seconds pack_int8 took over all distinct matrices
};

constexpr int64_t kDim = 4096, kFf = 11008;
constexpr int kL2Calls = 64;             // --l2: calls per step
constexpr size_t kL2Bytes = 256 << 10;  // --l2: the matrix's size at most

enum class Mode { kDecode, kHot, kL2 };

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Model make_model(const Format& f, int layers, Mode mode, bool packed) {
  struct Shape {
    int64_t rows, cols;
  };
  const bool hot = mode != Mode::kDecode;  // every call on one matrix
  const int64_t l2_rows = static_cast<int64_t>(kL2Bytes / (static_cast<size_t>(kDim / f.group) * f.block_bytes)) / 8 * 8;
  // Hot: a layer's seven products as seven calls on one 4096x4096 matrix. L2: kL2Calls calls
  // on one L2-sized matrix (one "layer").
  const std::vector<std::vector<Shape>> layer =
      mode == Mode::kL2 ? std::vector<std::vector<Shape>>(kL2Calls, {{l2_rows, kDim}})
      : hot             ? std::vector<std::vector<Shape>>(7, {{kDim, kDim}})
                        : std::vector<std::vector<Shape>>{{{kDim, kDim}, {kDim, kDim}, {kDim, kDim}},
                                                          {{kDim, kDim}},
                                                          {{kFf, kDim}, {kFf, kDim}},
                                                          {{kDim, kFf}}};
  if (mode == Mode::kL2) layers = 1;
  const auto matrix_bytes = [&](Shape s) { return static_cast<size_t>(s.rows) * static_cast<size_t>(s.cols / f.group) * f.block_bytes; };
  size_t layer_bytes = 0;
  for (const auto& region : layer) {
    for (Shape s : region) layer_bytes += matrix_bytes(s);
  }
  Model m;
  const size_t alloc = hot ? matrix_bytes(layer[0][0]) : layer_bytes * static_cast<size_t>(layers);
  m.buffer = alloc;
  m.mem.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, (alloc + 4095) / 4096 * 4096)));
  if (m.mem == nullptr) {
    std::fprintf(stderr, "bench_gemv_roofline: cannot allocate %zu MB\n", alloc >> 20);
    std::exit(1);
  }
  fill_random(f, m.mem.get(), alloc, 1);
  size_t off = 0;
  std::shared_ptr<const ringlm::cpu::PackedWeight> shared;  // hot: one packed copy for all calls
  for (int l = 0; l < layers; ++l) {
    for (const auto& shapes : layer) {
      Region region;
      for (Shape s : shapes) {
        Matrix w{s.rows, s.cols, m.mem.get() + (hot ? 0 : off), matrix_bytes(s) / static_cast<size_t>(s.rows), shared};
        if (packed && !w.packed) {
          m.pack_s += seconds([&] {
            w.packed = std::make_shared<const ringlm::cpu::PackedWeight>(
                ringlm::cpu::pack_int8(f.type, w.data, w.row_stride, w.rows, w.cols));
          });
          if (hot) shared = w.packed;
        }
        region.push_back(w);
        if (!hot) off += matrix_bytes(s);
        m.bytes += matrix_bytes(s);
      }
      m.step.push_back(region);
    }
  }
  return m;
}

// Quantized activations for up to 16 tokens of the longest row, quantized from random inputs.
struct Acts {
  std::vector<float> x;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Acts(int64_t tokens, int64_t k)
      : x(static_cast<size_t>(tokens * k)), q(x.size()), d(x.size() / 32), s(x.size() / 32) {
    std::mt19937 rng(2);
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(rng);
  }
};

// Thread t's share of `units` among n, as the backend splits tiles.
int64_t share(int64_t units, int t, int n) { return units * t / n; }

// One decode step: per region, quantize the input (one thread: it is tiny), then split the
// region's tiles over the threads: 4-row tiles in place, 8-row groups packed.
void run_step(TensorType type, bool packed, const Model& model, Acts& acts, int64_t tokens, int threads,
              std::vector<float>& y) {
  const int64_t unit = packed ? 8 : 4;
  for (const Region& region : model.step) {
    const int64_t k = region[0].cols;
    const ringlm::cpu::QuantizedActs xq{acts.q.data(), acts.d.data(), acts.s.data(), k};
    ringlm::cpu::quantize_acts(acts.x.data(), 0, tokens, xq);
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
        if (t0 < t1 && packed) {
          ringlm::cpu::gemm_int8_packed(*w.packed, t0 * unit, std::min(w.rows, t1 * unit), xq, tokens, y.data(), w.rows);
        } else if (t0 < t1) {
          ringlm::cpu::gemm_int8(type, w.data, w.row_stride, t0 * unit, std::min(w.rows, t1 * unit), xq, tokens,
                                 y.data(), w.rows);
        }
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

// One read pass over the model's buffer with `threads` threads, each streaming its own slice.
uint64_t read_pass(const Model& model, size_t bytes, int threads) {
  const auto* buf = reinterpret_cast<const __m256i*>(model.mem.get());
  const size_t n_vec = bytes / sizeof(__m256i);
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const size_t per = n_vec / static_cast<size_t>(omp_get_num_threads());
    total += read_avx2(buf + per * static_cast<size_t>(omp_get_thread_num()), per);
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
    } else if (i + 1 < argc && a == "--kernels") {
      o.kernels = split(argv[++i]);
      for (const std::string& k : o.kernels) {
        if (k != "inplace" && k != "packed") {
          std::fprintf(stderr, "bench_gemv_roofline: unknown kernel %s (inplace, packed)\n", k.c_str());
          std::exit(2);
        }
      }
    } else if (a == "--hot") {
      o.hot = true;
    } else if (a == "--l2") {
      o.l2 = true;
    } else {
      std::fprintf(stderr,
                   "usage: bench_gemv_roofline [--layers N] [--runs R] [--threads 1,2] [--tokens 1,2,4,8,16]\n"
                   "                           [--formats q4_0,i4s-g128,...] [--kernels inplace,packed] [--hot | --l2]\n");
      std::exit(2);
    }
  }
  if (o.kernels.empty()) o.kernels = {"inplace"};
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "bench_gemv_roofline: the bandwidth probe needs AVX2\n");
    return 1;
  }
  const Mode mode = o.l2 ? Mode::kL2 : o.hot ? Mode::kHot : Mode::kDecode;
  const bool any_packed = std::find(o.kernels.begin(), o.kernels.end(), "packed") != o.kernels.end();
  if (mode == Mode::kL2) {
    std::printf("L2-resident matrix (<= %zu KiB, K = %lld), %d calls per step, median of %d runs\n", kL2Bytes >> 10,
                static_cast<long long>(kDim), kL2Calls, o.runs);
    std::printf("%-14s %-8s %7s %6s %9s %13s %8s\n", "format", "kernel", "threads", "M", "ms/step", "ns/block/core",
                "speedup");
  } else {
    std::printf("Llama-2-7B decode step: %d layer(s)%s, median of %d runs\n", o.layers,
                o.hot ? ", hot (one matrix)" : "", o.runs);
    std::printf("%-14s %-8s %7s %6s %9s %8s %11s %9s %8s\n", "format", "kernel", "threads", "M", "ms/step", "GB/s",
                "probe GB/s", "roofline", "speedup");
  }
  uint64_t sink = 0;
  for (const std::string& name : o.formats) {
    const std::optional<Format> f = parse_format(name);
    if (!f) {
      std::fprintf(stderr, "bench_gemv_roofline: unknown format %s\n", name.c_str());
      return 2;
    }
    if (!ringlm::cpu::int8_supported(f->type)) {
      std::printf("%-14s (no int8 kernel)\n", name.c_str());
      continue;
    }
    const Model model = make_model(*f, o.layers, mode, any_packed);
    if (any_packed && mode != Mode::kL2) {  // (an L2-sized matrix packs too fast to time)
      std::printf("%-14s packing: %.0f MB in %.3f s = %.0f MB/s (%d threads)\n", name.c_str(),
                  static_cast<double>(model.buffer) / 1e6, model.pack_s,
                  static_cast<double>(model.buffer) / 1e6 / model.pack_s, omp_get_max_threads());
    }
    Acts acts(16, kFf);
    std::vector<float> y(static_cast<size_t>(16 * kFf));
    int64_t blocks = 0;  // weight blocks of 32 a step reads
    for (const Region& region : model.step) {
      for (const Matrix& w : region) blocks += w.rows * (w.cols / 32);
    }
    for (const int threads : o.threads) {
      for (const int tokens : o.tokens) {
        const size_t nk = o.kernels.size();
        for (const std::string& k : o.kernels) run_step(f->type, k == "packed", model, acts, tokens, threads, y);  // warm-up
        if (mode != Mode::kL2) sink += read_pass(model, model.buffer, threads);
        std::vector<std::vector<double>> step_s(nk);
        std::vector<double> probe_s;
        for (int r = 0; r < o.runs; ++r) {
          for (size_t i = 0; i < nk; ++i) {
            const bool packed = o.kernels[i] == "packed";
            step_s[i].push_back(seconds([&] { run_step(f->type, packed, model, acts, tokens, threads, y); }));
          }
          if (mode != Mode::kL2) probe_s.push_back(seconds([&] { sink += read_pass(model, model.buffer, threads); }));
        }
        const double base = median(step_s[0]);
        const double probe = mode != Mode::kL2 ? static_cast<double>(model.buffer) / median(probe_s) / 1e9 : 0;
        for (size_t i = 0; i < nk; ++i) {
          const double t = median(step_s[i]), gbs = static_cast<double>(model.bytes) / t / 1e9;
          if (mode == Mode::kL2) {
            std::printf("%-14s %-8s %7d %6d %9.3f %13.3f %8.2f\n", name.c_str(), o.kernels[i].c_str(), threads, tokens,
                        t * 1e3, t * 1e9 * threads / static_cast<double>(blocks), base / t);
          } else {
            std::printf("%-14s %-8s %7d %6d %9.2f %8.2f %11.2f %9.2f %8.2f\n", name.c_str(), o.kernels[i].c_str(),
                        threads, tokens, t * 1e3, gbs, probe, gbs / probe, base / t);
          }
        }
        std::fflush(stdout);
      }
    }
    sink += static_cast<uint64_t>(y[0] != y[0]);
  }
  return sink == 42 ? 3 : 0;  // uses the sums, so the reads stay
}
