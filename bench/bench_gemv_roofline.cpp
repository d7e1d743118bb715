// Decode's weight products against the memory-bandwidth roofline.
//
//   bench_gemv_roofline [--layers 4] [--threads 1,2] [--tokens 1,2,4,8,16] [--runs 7]
//                       [--formats q4_0,i4s-g128,...] [--hot]
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
#include "quant/int4.h"

namespace {

using ringlm::Int4Format;
using ringlm::ScaleType;
using ringlm::TensorType;

struct Options {
  int layers = 4;
  int runs = 7;
  bool hot = false;
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
};

// The calls of one decode step: each a list of matrices sharing one input (one parallel region).
using Region = std::vector<Matrix>;

struct Model {
  std::unique_ptr<uint8_t, decltype(&std::free)> mem{nullptr, &std::free};
  size_t buffer = 0;  // bytes of distinct weights (the probe reads them all)
  size_t bytes = 0;   // weight bytes a step reads
  std::vector<Region> step;
};

constexpr int64_t kDim = 4096, kFf = 11008;

Model make_model(const Format& f, int layers, bool hot) {
  struct Shape {
    int64_t rows, cols;
  };
  // Hot: a layer's seven products as seven calls on one 4096x4096 matrix.
  const std::vector<std::vector<Shape>> layer =
      hot ? std::vector<std::vector<Shape>>(7, {{kDim, kDim}})
          : std::vector<std::vector<Shape>>{
                {{kDim, kDim}, {kDim, kDim}, {kDim, kDim}}, {{kDim, kDim}}, {{kFf, kDim}, {kFf, kDim}}, {{kDim, kFf}}};
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
  for (int l = 0; l < layers; ++l) {
    for (const auto& shapes : layer) {
      Region region;
      for (Shape s : shapes) {
        region.push_back({s.rows, s.cols, m.mem.get() + (hot ? 0 : off), matrix_bytes(s) / static_cast<size_t>(s.rows)});
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
// region's 4-row tiles over the threads.
void run_step(TensorType type, const Model& model, Acts& acts, int64_t tokens, int threads, std::vector<float>& y) {
  for (const Region& region : model.step) {
    const int64_t k = region[0].cols;
    const ringlm::cpu::QuantizedActs xq{acts.q.data(), acts.d.data(), acts.s.data(), k};
    ringlm::cpu::quantize_acts(acts.x.data(), 0, tokens, xq);
    int64_t tiles = 0;
    for (const Matrix& w : region) tiles += (w.rows + 3) / 4;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), n = omp_get_num_threads();
      const int64_t begin = share(tiles, t, n), end = share(tiles, t + 1, n);
      int64_t first = 0;  // of the current matrix, in the region's tile numbering
      for (const Matrix& w : region) {
        const int64_t count = (w.rows + 3) / 4;
        const int64_t t0 = std::max(begin, first) - first, t1 = std::min(end, first + count) - first;
        if (t0 < t1) {
          ringlm::cpu::gemm_int8(type, w.data, w.row_stride, t0 * 4, std::min(w.rows, t1 * 4), xq, tokens, y.data(),
                                 w.rows);
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

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
    } else {
      std::fprintf(stderr,
                   "usage: bench_gemv_roofline [--layers N] [--runs R] [--threads 1,2] [--tokens 1,2,4,8,16]\n"
                   "                           [--formats q4_0,i4s-g128,...] [--hot]\n");
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "bench_gemv_roofline: the bandwidth probe needs AVX2\n");
    return 1;
  }
  std::printf("Llama-2-7B decode step: %d layer(s)%s, median of %d runs\n", o.layers, o.hot ? ", hot (one matrix)" : "",
              o.runs);
  std::printf("%-14s %7s %6s %9s %8s %11s %9s\n", "format", "threads", "M", "ms/step", "GB/s", "probe GB/s", "roofline");
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
    const Model model = make_model(*f, o.layers, o.hot);
    Acts acts(16, kFf);
    std::vector<float> y(static_cast<size_t>(16 * kFf));
    for (const int threads : o.threads) {
      for (const int tokens : o.tokens) {
        run_step(f->type, model, acts, tokens, threads, y);  // warm-up: threads, TLB, page faults
        sink += read_pass(model, model.buffer, threads);
        std::vector<double> step_s, probe_s;
        for (int r = 0; r < o.runs; ++r) {
          step_s.push_back(seconds([&] { run_step(f->type, model, acts, tokens, threads, y); }));
          probe_s.push_back(seconds([&] { sink += read_pass(model, model.buffer, threads); }));
        }
        const double t = median(step_s), gbs = static_cast<double>(model.bytes) / t / 1e9;
        const double probe = static_cast<double>(model.buffer) / median(probe_s) / 1e9;
        std::printf("%-14s %7d %6d %9.2f %8.2f %11.2f %9.2f\n", name.c_str(), threads, tokens, t * 1e3, gbs, probe,
                    gbs / probe);
        std::fflush(stdout);
      }
    }
    sink += static_cast<uint64_t>(y[0] != y[0]);
  }
  return sink == 42 ? 3 : 0;  // uses the sums, so the reads stay
}
