// The AMX int8 peak of this CPU, measured: the denominator of "the products at N% of the AMX
// peak" (bench/README.md, "Intel AMX"). Per thread count, tile multiplies per second at depth 64
// and 32:
//   multiply only      four independent accumulating TDPBSSD (the unit's own rate)
//   + zero and store   each result zeroed before and stored after its multiply, as the packed
//                      products do per sub-block (tile_gemm-inl.h)
//   + scaling          each stored 16 x 16 result also converted and added into floats on AVX-512
//   + A and B loads    the operands loaded from L1 before each group of multiplies
// Needs a CPU with AMX-INT8 and a kernel that grants the tiles (`ringlm devices`: `amx  on`).
//
//   bench_amx_peak [MAX_THREADS]     (default 2: 1 and 2 threads)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
constexpr long kIterations = 1000000;

enum class Work { kMultiply, kZeroStore, kScale, kLoads };
const char* name(Work w) {
  switch (w) {
    case Work::kMultiply: return "multiply only";
    case Work::kZeroStore: return "+ zero and store";
    case Work::kScale: return "+ scaling";
    case Work::kLoads: return "+ A and B loads";
  }
  return "";
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) inline void zero_results() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Multiply-adds per second of one thread doing `work` at `depth` bytes per A row.
__attribute__((target("amx-tile,amx-int8,avx512f"))) double run(Work work, int depth) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {  // C0..C3
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  config.colsb[4] = static_cast<uint16_t>(depth);  // A
  config.rows[4] = 16;
  config.colsb[5] = 64;  // B
  config.rows[5] = static_cast<uint8_t>(depth / 4);
  _tile_loadconfig(&config);
  alignas(64) static thread_local int8_t a[16 * 64], b[16 * 64];
  alignas(64) static thread_local int32_t c[4][16 * 16];
  alignas(64) static thread_local float acc[4][16 * 16];
  for (int i = 0; i < 16 * 64; ++i) {
    a[i] = static_cast<int8_t>(i * 7);
    b[i] = static_cast<int8_t>(i * 13);
  }
  _tile_loadd(4, a, 64);
  _tile_loadd(5, b, 64);
  zero_results();
  const __m512 scale = _mm512_set1_ps(0.5f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
    if (work == Work::kLoads) {
      _tile_loadd(4, a, 64);
      _tile_loadd(5, b, 64);
    }
    if (work != Work::kMultiply) zero_results();
    _tile_dpbssd(0, 4, 5);
    _tile_dpbssd(1, 4, 5);
    _tile_dpbssd(2, 4, 5);
    _tile_dpbssd(3, 4, 5);
    if (work == Work::kMultiply) continue;
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    if (work == Work::kZeroStore) continue;
    for (int t = 0; t < 4; ++t) {
      for (int r = 0; r < 16; ++r) {
        const __m512 v = _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_load_si512(c[t] + 16 * r));  // (maskz: GCC 12 warns on the unmasked form)
        _mm512_store_ps(acc[t] + 16 * r, _mm512_fmadd_ps(v, scale, _mm512_load_ps(acc[t] + 16 * r)));
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_stored(0, c[0], 64);
  _tile_release();
  volatile float keep = acc[0][0] + static_cast<float>(c[0][0]);
  (void)keep;
  return 4.0 * kIterations * 16 * 16 * depth / seconds;
}

}  // namespace

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "bench_amx_peak: the kernel does not grant the AMX tiles here (no AMX, or an old kernel)\n");
    return 1;
  }
  const int max_threads = argc > 1 ? std::atoi(argv[1]) : 2;
  std::printf("| threads | depth | work | G multiply-adds/s |\n|---:|---:|---|---:|\n");
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    for (const int depth : {64, 32}) {
      for (const Work work : {Work::kMultiply, Work::kZeroStore, Work::kScale, Work::kLoads}) {
        std::vector<double> rates(static_cast<size_t>(threads));
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { rates[static_cast<size_t>(t)] = run(work, depth); });
        for (std::thread& th : pool) th.join();
        double total = 0;
        for (const double r : rates) total += r;
        std::printf("| %d | %d | %s | %.1f |\n", threads, depth, name(work), total / 1e9);
      }
    }
  }
  return 0;
}
