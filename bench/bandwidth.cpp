// Memory read-bandwidth probe: the denominator of the decode roofline (bytes per token / bandwidth).
//
//   bench_bandwidth [--size-mib N] [--runs R] [--threads T1,T2,...]
//
// OpenMP threads each stream their own slice of a buffer far larger than the last-level cache
// (default 1 GiB) with 256-bit AVX2 loads, summing into a few accumulators so the loads cannot
// be elided. Every thread count prints the median of R runs in GB/s (1e9 bytes/s), the unit the
// roofline figures use.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Options {
  size_t size_mib = 1024;
  int runs = 7;
  std::vector<int> threads;
};

// Sums 32-byte words of [p, p + n_vec): four independent accumulators keep several loads in
// flight per core, which a single dependency chain would not.
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
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// One pass over the whole buffer with `threads` threads; returns the seconds it took.
double timed_pass(const __m256i* buf, size_t n_vec, int threads, uint64_t& sink) {
  uint64_t total = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const size_t per = n_vec / static_cast<size_t>(omp_get_num_threads());
    const size_t begin = per * static_cast<size_t>(omp_get_thread_num());
    total += read_avx2(buf + begin, per);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  sink += total;
  return s;
}

std::vector<int> parse_list(const char* text) {
  std::vector<int> out;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p || v < 1 || v > 1024) {
      std::fprintf(stderr, "bench_bandwidth: --threads wants a list like 1,2\n");
      std::exit(2);
    }
    out.push_back(static_cast<int>(v));
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 < argc && a == "--size-mib") {
      o.size_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (i + 1 < argc && a == "--runs") {
      o.runs = std::max(1, std::atoi(argv[++i]));
    } else if (i + 1 < argc && a == "--threads") {
      o.threads = parse_list(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_bandwidth [--size-mib N] [--runs R] [--threads T1,T2,...]\n");
      std::exit(2);
    }
  }
  if (o.size_mib < 64) o.size_mib = 64;
  if (o.threads.empty()) {
    for (int t = 1; t <= omp_get_num_procs(); ++t) o.threads.push_back(t);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "bench_bandwidth: this CPU has no AVX2\n");
    return 1;
  }
  const size_t bytes = o.size_mib << 20;
  const size_t n_vec = bytes / sizeof(__m256i);
  std::unique_ptr<void, decltype(&std::free)> mem(std::aligned_alloc(4096, bytes), &std::free);
  if (mem == nullptr) {
    std::fprintf(stderr, "bench_bandwidth: cannot allocate %zu MiB\n", o.size_mib);
    return 1;
  }
  auto* raw = static_cast<__m256i*>(mem.get());
  // Touch every page first (in parallel, so pages spread as the readers will use them): the
  // first pass would otherwise time page faults, not reads.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < bytes / 4096; ++i) std::memset(reinterpret_cast<char*>(raw) + i * 4096, static_cast<int>(i), 4096);

  std::printf("buffer %zu MiB, median of %d runs\n", o.size_mib, o.runs);
  std::printf("%8s %10s\n", "threads", "GB/s");
  uint64_t sink = 0;
  for (const int t : o.threads) {
    timed_pass(raw, n_vec, t, sink);  // warm-up: thread start-up, TLB
    std::vector<double> gbs;
    for (int r = 0; r < o.runs; ++r) gbs.push_back(static_cast<double>(bytes) / timed_pass(raw, n_vec, t, sink) / 1e9);
    std::sort(gbs.begin(), gbs.end());
    std::printf("%8d %10.2f\n", t, gbs[gbs.size() / 2]);
    std::fflush(stdout);
  }
  return sink == 42 ? 3 : 0;  // uses the sums, so the reads stay
}
