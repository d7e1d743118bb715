// Memory read-bandwidth probe: the denominator of the decode roofline (bytes per token / bandwidth).
//
//   bench_bandwidth [--size-mib N] [--runs R] [--threads T1,T2,...] [--json]
//                   [--loads avx2,avx512] [--streams 1,2,4,8]
//                   [--prefetch none,t0-1k,t0-4k,t0-16k,nta-1k,nta-4k,nta-16k] [--no-thp]
//
// OpenMP threads each read their own slice of a buffer far larger than the last-level cache
// (default 1 GiB, on 2 MiB transparent huge pages). One read loop (one stream of 256-bit loads
// per thread) leaves bandwidth on the table: a core reaches the memory's peak only with enough
// misses in flight, which more concurrent streams, wider loads or software prefetch can give. So
// every thread count runs each combination of
//   --loads     avx2 (256-bit) or avx512 (512-bit, only where the CPU has AVX-512F),
//   --streams   S (1, 2, 4, 8 or 16): each thread splits its slice into S equal parts read in lock-step,
//   --prefetch  none, or prefetcht0 / prefetchnta N KiB ahead of every stream,
// and prints each variant's median GB/s (1e9 bytes/s) over R runs and the best of them. The
// variants are interleaved within each run, so a load spike on this shared machine hits them
// all alike instead of one variant's runs.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr size_t kLine = 64;
// Bytes each stream advances per loop step: two cache lines, so one stream of 256-bit loads
// still has four independent loads per step.
constexpr size_t kStep = 2 * kLine;
constexpr size_t kHugePage = size_t{2} << 20;
// __builtin_prefetch locality: 3 = prefetcht0 (into L1), 0 = prefetchnta (non-temporal,
// keeps the streamed lines from evicting the caches); kNoPrefetch emits no prefetch at all.
constexpr int kNoPrefetch = -1;
constexpr int kT0 = 3;
constexpr int kNta = 0;

struct Prefetch {
  int locality = kNoPrefetch;
  size_t kib = 0;
};

struct Options {
  size_t size_mib = 1024;
  int runs = 7;
  std::vector<int> threads;
  std::vector<int> loads = {256, 512};
  std::vector<int> streams = {1, 2, 4, 8};
  std::vector<Prefetch> prefetch = {{}, {kT0, 1}, {kT0, 4}, {kT0, 16}, {kNta, 1}, {kNta, 4}, {kNta, 16}};
  bool json = false;
  bool thp = true;
};

// Reads S streams of stream_bytes each, starting at base, base + stream_bytes, ...: one step
// reads kStep bytes of every stream before any stream moves on.
using ReadFn = uint64_t (*)(const char* base, size_t stream_bytes, size_t ahead);

struct Variant {
  std::string name;
  int streams = 1;
  size_t ahead = 0;  // prefetch distance in bytes
  ReadFn fn = nullptr;
};

template <int S, int Locality>
__attribute__((target("avx2"))) uint64_t read_avx2(const char* base, size_t stream_bytes, size_t ahead) {
  __m256i acc[S];
  for (auto& a : acc) a = _mm256_setzero_si256();
  for (size_t off = 0; off < stream_bytes; off += kStep) {
    for (size_t s = 0; s < S; ++s) {
      const char* q = base + s * stream_bytes + off;
      if constexpr (Locality != kNoPrefetch) {
        __builtin_prefetch(q + ahead, 0, Locality);
        __builtin_prefetch(q + ahead + kLine, 0, Locality);
      }
      const auto* v = reinterpret_cast<const __m256i*>(q);
      const __m256i lo = _mm256_add_epi64(_mm256_load_si256(v), _mm256_load_si256(v + 1));
      const __m256i hi = _mm256_add_epi64(_mm256_load_si256(v + 2), _mm256_load_si256(v + 3));
      acc[s] = _mm256_add_epi64(acc[s], _mm256_add_epi64(lo, hi));
    }
  }
  for (size_t s = 1; s < S; ++s) acc[0] = _mm256_add_epi64(acc[0], acc[s]);
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

template <int S, int Locality>
__attribute__((target("avx512f"))) uint64_t read_avx512(const char* base, size_t stream_bytes, size_t ahead) {
  __m512i acc[S];
  for (auto& a : acc) a = _mm512_setzero_si512();
  for (size_t off = 0; off < stream_bytes; off += kStep) {
    for (size_t s = 0; s < S; ++s) {
      const char* q = base + s * stream_bytes + off;
      if constexpr (Locality != kNoPrefetch) {
        __builtin_prefetch(q + ahead, 0, Locality);
        __builtin_prefetch(q + ahead + kLine, 0, Locality);
      }
      const __m512i a = _mm512_load_si512(q);
      const __m512i b = _mm512_load_si512(q + kLine);
      acc[s] = _mm512_add_epi64(acc[s], _mm512_add_epi64(a, b));
    }
  }
  for (size_t s = 1; s < S; ++s) acc[0] = _mm512_add_epi64(acc[0], acc[s]);
  // Lanes summed through memory: GCC 12's _mm512_reduce_add_epi64 trips -Wuninitialized.
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, acc[0]);
  uint64_t sum = 0;
  for (const uint64_t lane : lanes) sum += lane;
  return sum;
}

// The locality of __builtin_prefetch must be a constant: one instantiation per hint.
template <int S>
ReadFn pick_hint(int bits, int locality) {
  if (bits == 512) {
    if (locality == kT0) return read_avx512<S, kT0>;
    if (locality == kNta) return read_avx512<S, kNta>;
    return read_avx512<S, kNoPrefetch>;
  }
  if (locality == kT0) return read_avx2<S, kT0>;
  if (locality == kNta) return read_avx2<S, kNta>;
  return read_avx2<S, kNoPrefetch>;
}

ReadFn pick(int bits, int streams, int locality) {
  switch (streams) {
    case 1: return pick_hint<1>(bits, locality);
    case 2: return pick_hint<2>(bits, locality);
    case 4: return pick_hint<4>(bits, locality);
    case 8: return pick_hint<8>(bits, locality);
    case 16: return pick_hint<16>(bits, locality);
    default: return nullptr;
  }
}

std::string prefetch_name(const Prefetch& p) {
  if (p.locality == kNoPrefetch) return "none";
  std::string name = p.locality == kT0 ? "t0-" : "nta-";
  name += std::to_string(p.kib);
  name += "k";
  return name;
}

// Names read like avx512-s4-t0-4k: loads, streams per thread, prefetch hint and distance.
std::vector<Variant> make_variants(const Options& o) {
  std::vector<Variant> out;
  for (const int bits : o.loads) {
    for (const int s : o.streams) {
      for (const Prefetch& p : o.prefetch) {
        // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string.
        std::string name = bits == 512 ? "avx512" : "avx2";
        name += "-s";
        name += std::to_string(s);
        if (p.locality != kNoPrefetch) name.append("-").append(prefetch_name(p));
        out.push_back({name, s, p.kib << 10, pick(bits, s, p.locality)});
      }
    }
  }
  return out;
}

// One pass of a variant over the buffer with `threads` threads; returns GB/s. Each thread's
// slice is cut to a whole number of steps of all its streams, and only what was read counts.
double timed_pass(const char* buf, size_t bytes, int threads, const Variant& v, uint64_t& sink) {
  uint64_t total = 0;
  size_t read = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total, read)
  {
    const size_t unit = kStep * static_cast<size_t>(v.streams);
    const size_t per = bytes / static_cast<size_t>(omp_get_num_threads()) / unit * unit;
    const char* begin = buf + per * static_cast<size_t>(omp_get_thread_num());
    total += v.fn(begin, per / static_cast<size_t>(v.streams), v.ahead);
    read += per;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  sink += total;
  return static_cast<double>(read) / s / 1e9;
}

struct Result {
  std::string name;
  double median = 0, min = 0, max = 0;
};

Result summarize(const std::string& name, std::vector<double> gbs) {
  std::sort(gbs.begin(), gbs.end());
  return {name, gbs[gbs.size() / 2], gbs.front(), gbs.back()};
}

// All variants at one thread count: run r does one pass of every variant in turn.
std::vector<Result> measure(const char* buf, size_t bytes, int threads, const std::vector<Variant>& variants,
                            int runs, uint64_t& sink) {
  timed_pass(buf, bytes, threads, variants.front(), sink);  // warm-up: thread start-up, TLB
  std::vector<std::vector<double>> gbs(variants.size());
  for (int r = 0; r < runs; ++r) {
    for (size_t i = 0; i < variants.size(); ++i) gbs[i].push_back(timed_pass(buf, bytes, threads, variants[i], sink));
  }
  std::vector<Result> out;
  for (size_t i = 0; i < variants.size(); ++i) out.push_back(summarize(variants[i].name, gbs[i]));
  return out;
}

const Result& best_of(const std::vector<Result>& results) {
  return *std::max_element(results.begin(), results.end(),
                           [](const Result& a, const Result& b) { return a.median < b.median; });
}

void print_table(int threads, const std::vector<Result>& results) {
  std::printf("\nthreads %d\n%-22s %8s %8s %8s\n", threads, "variant", "median", "min", "max");
  for (const Result& r : results) std::printf("%-22s %8.2f %8.2f %8.2f\n", r.name.c_str(), r.median, r.min, r.max);
  const Result& b = best_of(results);
  std::printf("best %d threads: %.2f GB/s (%s)\n", threads, b.median, b.name.c_str());
  std::fflush(stdout);
}

// One object per thread count, one per line, inside a JSON array.
void print_json(int threads, const std::vector<Result>& results, const Options& o, bool first, bool last) {
  const Result& b = best_of(results);
  std::printf("%s{\"threads\": %d, \"best_gbs\": %.3f, \"best_variant\": \"%s\", \"size_mib\": %zu, \"runs\": %d, "
              "\"variants\": {",
              first ? "[\n" : "", threads, b.median, b.name.c_str(), o.size_mib, o.runs);
  for (size_t i = 0; i < results.size(); ++i) {
    std::printf("%s\"%s\": %.3f", i ? ", " : "", results[i].name.c_str(), results[i].median);
  }
  std::printf("}}%s\n", last ? "\n]" : ",");
  std::fflush(stdout);
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_bandwidth [--size-mib N] [--runs R] [--threads T1,T2,...] [--json]\n"
               "                       [--loads avx2,avx512] [--streams 1,2,4,8]\n"
               "                       [--prefetch none,t0-1k,t0-4k,t0-16k,nta-1k,nta-4k,nta-16k] [--no-thp]\n");
  std::exit(2);
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t comma; (comma = text.find(',', start)) != std::string::npos; start = comma + 1) {
    out.push_back(text.substr(start, comma - start));
  }
  out.push_back(text.substr(start));
  return out;
}

int parse_int(const std::string& s, int lo, int hi) {
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > hi) usage();
  return static_cast<int>(v);
}

std::vector<int> parse_ints(const std::string& text, int lo, int hi) {
  std::vector<int> out;
  for (const std::string& s : split(text)) out.push_back(parse_int(s, lo, hi));
  return out;
}

// "avx2" / "avx512" (or the widths "256" / "512").
std::vector<int> parse_loads(const std::string& text) {
  std::vector<int> out;
  for (const std::string& s : split(text)) {
    if (s != "avx2" && s != "avx512" && s != "256" && s != "512") usage();
    out.push_back(s == "avx2" || s == "256" ? 256 : 512);
  }
  return out;
}

std::vector<int> parse_streams(const std::string& text) {
  std::vector<int> out = parse_ints(text, 1, 16);
  for (const int s : out) {
    if (pick(256, s, kNoPrefetch) == nullptr) usage();  // only the instantiated counts: 1, 2, 4, 8, 16
  }
  return out;
}

// "none", "t0-4k", "nta-16k": hint and distance in KiB.
std::vector<Prefetch> parse_prefetch(const std::string& text) {
  std::vector<Prefetch> out;
  for (const std::string& s : split(text)) {
    if (s == "none") {
      out.push_back({});
      continue;
    }
    const size_t dash = s.find('-');
    if (dash == std::string::npos || s.back() != 'k') usage();
    const std::string hint = s.substr(0, dash);
    if (hint != "t0" && hint != "nta") usage();
    const int kib = parse_int(s.substr(dash + 1, s.size() - dash - 2), 1, 1024);
    out.push_back({hint == "t0" ? kT0 : kNta, static_cast<size_t>(kib)});
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--no-thp") {
      o.thp = false;
    } else if (has_value && a == "--size-mib") {
      o.size_mib = static_cast<size_t>(parse_int(argv[++i], 1, 1 << 20));
    } else if (has_value && a == "--runs") {
      o.runs = parse_int(argv[++i], 1, 1000);
    } else if (has_value && a == "--threads") {
      o.threads = parse_ints(argv[++i], 1, 1024);
    } else if (has_value && a == "--loads") {
      o.loads = parse_loads(argv[++i]);
    } else if (has_value && a == "--streams") {
      o.streams = parse_streams(argv[++i]);
    } else if (has_value && a == "--prefetch") {
      o.prefetch = parse_prefetch(argv[++i]);
    } else {
      usage();
    }
  }
  o.size_mib = std::max<size_t>(o.size_mib, 64);
  if (o.threads.empty()) {
    for (int t = 1; t <= omp_get_num_procs(); ++t) o.threads.push_back(t);
  }
  return o;
}

// 512-bit loads only where the CPU runs them; says so rather than failing.
void drop_unsupported_loads(Options& o) {
  if (__builtin_cpu_supports("avx512f")) return;
  const auto n = o.loads.size();
  o.loads.erase(std::remove(o.loads.begin(), o.loads.end(), 512), o.loads.end());
  if (o.loads.size() != n) std::fprintf(stderr, "bench_bandwidth: no AVX-512F on this CPU, avx512 loads skipped\n");
  if (o.loads.empty()) o.loads.push_back(256);
}

size_t max_prefetch_bytes(const Options& o) {
  size_t m = 0;
  for (const Prefetch& p : o.prefetch) m = std::max(m, p.kib << 10);
  return m;
}

// How much of this process's anonymous memory the kernel gave huge pages (smaps_rollup).
size_t anon_huge_mib() {
  std::ifstream in("/proc/self/smaps_rollup");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::strtoull(line.c_str() + 14, nullptr, 10) >> 10;
  }
  return 0;
}

using Buffer = std::unique_ptr<char, decltype(&std::free)>;

// The buffer, plus room past its end for the farthest prefetch (prefetches never fault, but
// their addresses stay inside the allocation). Huge pages take TLB misses out of the figure.
Buffer allocate(size_t bytes, bool thp) {
  const size_t alloc = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  Buffer mem(static_cast<char*>(std::aligned_alloc(kHugePage, alloc)), &std::free);
  if (mem == nullptr) return mem;
  if (thp) madvise(mem.get(), alloc, MADV_HUGEPAGE);  // a hint: without THP, 4 KiB pages
  // Touch every page first (in parallel, so pages spread as the readers will use them): the
  // first pass would otherwise time page faults, not reads.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < alloc / 4096; ++i) std::memset(mem.get() + i * 4096, static_cast<int>(i), 4096);
  return mem;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "bench_bandwidth: this CPU has no AVX2\n");
    return 1;
  }
  drop_unsupported_loads(o);
  const size_t bytes = o.size_mib << 20;
  const Buffer mem = allocate(bytes + max_prefetch_bytes(o) + kStep, o.thp);
  if (mem == nullptr) {
    std::fprintf(stderr, "bench_bandwidth: cannot allocate %zu MiB\n", o.size_mib);
    return 1;
  }
  const std::vector<Variant> variants = make_variants(o);
  if (!o.json) {
    std::printf("buffer %zu MiB (%zu MiB on huge pages), %zu variants, median of %d runs, variants interleaved\n",
                o.size_mib, anon_huge_mib(), variants.size(), o.runs);
  }
  uint64_t sink = 0;
  for (size_t i = 0; i < o.threads.size(); ++i) {
    const std::vector<Result> results = measure(mem.get(), bytes, o.threads[i], variants, o.runs, sink);
    if (o.json) {
      print_json(o.threads[i], results, o, i == 0, i + 1 == o.threads.size());
    } else {
      print_table(o.threads[i], results);
    }
  }
  return sink == 42 ? 3 : 0;  // uses the sums, so the reads stay
}
