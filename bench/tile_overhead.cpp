// The AMX products' work outside the tile instructions, timed on any CPU with AVX-512 (bench/README.md,
// "Intel AMX: the work around the tiles"). The packed products on the tiles (tile_gemm-inl.h)
// widen the weight codes to B tiles, multiply on the tiles, store each 16 x 16 result, and scale
// the integers into the float sums on AVX-512. Here the same code runs with tile instructions that
// cost nothing (a store still writes its 1 KiB): its time is what the cores spend beside the tile
// unit, so it bounds the products from above whatever the tiles cost, and machines without AMX
// (or whose hypervisor hides it) can measure and shrink it. One thread; beside it, the AVX-512
// VNNI kernels' time on the same product (gemm_packed, one thread).
//
//   bench_tile_overhead --benchmark_filter='Q4_0'
// Counters: MMAC/s at which the products would run if the tile instructions were free
// ("free_tiles"), and the non-tile nanoseconds per tile multiply ("ns_per_multiply"; one
// multiply of 16 x 16 x 32 int8 at AMX's 1,024 multiply-adds a cycle takes 8 cycles).
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/amx.h"
#include "backends/cpu/kernel_packed.h"
#include "tests/packed_input.h"
#include "tests/weight_formats.h"

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")
#endif
#endif

// The same instruction sets as amx_native.cpp's copy, without the tile instructions.
#define RINGLM_TILE_NAMESPACE free_tiles
#include "backends/cpu/tile_gemm-inl.h"  // IWYU pragma: keep
#undef RINGLM_TILE_NAMESPACE

namespace {

// Tiles whose instructions take no time: loads and multiplies only count, a store writes a fixed
// 16 x 16 result (the bytes a TILESTORED writes, for the scaling that reads them).
struct FreeTiles {
  int64_t multiplies = 0;
  alignas(64) int32_t result[16 * 16] = {};
  void load(int, const void*, int64_t) {}
  void zero(int) {}
  void dpbssd(int, int, int) { ++multiplies; }
  void store(int, void* base, int64_t stride) {
    for (int r = 0; r < 16; ++r) {  // as a TILESTORED would: 64 bytes a row (a memcpy may become rep movs)
      _mm512_storeu_si512(static_cast<uint8_t*>(base) + r * stride, _mm512_load_si512(result + 16 * r));
    }
  }
};

void run_free_tiles(FreeTiles& tiles, const ringlm::cpu::PackedWeight& w, const ringlm::cpu::PackedInput& x,
                    const ringlm::cpu::TileTokenTerms& terms, int64_t m, float* y) {
  ringlm::cpu::free_tiles::tile_gemm(tiles, w, 0, w.rows, x, terms, m, y, w.rows);
}

}  // namespace

#if defined(__x86_64__)
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace {

using ringlm::TensorType;

struct Product {
  ringlm::cpu::PackedWeight w;
  ringlm::test::Input x;
  std::vector<float> y;
};

Product make_product(TensorType type, int64_t n, int64_t k, int64_t m) {
  std::mt19937 rng(1);
  const std::vector<uint8_t> file = ringlm::test::random_weights(type, n, k, rng);
  Product p{ringlm::cpu::pack_weight(type, file.data(), ringlm::row_bytes(type, k), n, k),
            ringlm::test::Input(ringlm::test::random_acts(m, k, rng), m, k), {}};
  p.y.resize(static_cast<size_t>(m * n));
  return p;
}

void report(benchmark::State& state, int64_t n, int64_t k, int64_t m) {
  state.counters["MMAC/s"] = benchmark::Counter(static_cast<double>(n * k * m) * static_cast<double>(state.iterations()) / 1e6,
                                                benchmark::Counter::kIsRate);
}

// The products on tiles that cost nothing: the cores' share of an AMX product.
void BM_FreeTiles(benchmark::State& state, TensorType type) {
  const int64_t n = state.range(0), k = state.range(1), m = state.range(2);
  Product p = make_product(type, n, k, m);
  FreeTiles tiles;
  ringlm::cpu::TileTokenTerms terms;
  for (auto _ : state) {
    // The tokens' terms are part of the product's work: the backend makes them once per product.
    terms.make(*ringlm::cpu::packed_format(type), p.x.packed().block, m);
    run_free_tiles(tiles, p.w, p.x.packed(), terms, m, p.y.data());
    benchmark::DoNotOptimize(p.y.data());
  }
  report(state, n, k, m);
  state.counters["ns_per_multiply"] = benchmark::Counter(static_cast<double>(tiles.multiplies),
                                                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// The AVX-512 VNNI kernels (this CPU's best target) on the same product, one thread.
void BM_Kernels(benchmark::State& state, TensorType type) {
  const int64_t n = state.range(0), k = state.range(1), m = state.range(2);
  Product p = make_product(type, n, k, m);
  for (auto _ : state) {
    ringlm::cpu::gemm_packed(p.w, 0, n, p.x.packed(), m, p.y.data(), n);
    benchmark::DoNotOptimize(p.y.data());
  }
  report(state, n, k, m);
}

// Llama-3.2-1B's q/o, gate/up and down matrices, a prompt chunk of 512 tokens and a batched step of 16.
void Shapes(benchmark::internal::Benchmark* b) {
  for (auto [n, k] : {std::pair{2048, 2048}, {8192, 2048}, {2048, 8192}}) {
    for (int m : {16, 64, 128, 256, 512}) b->Args({n, k, m});
  }
  b->ArgNames({"N", "K", "M"});
  b->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}

#define TILE_OVERHEAD(type)                                                        \
  BENCHMARK_CAPTURE(BM_FreeTiles, type, TensorType::type)->Apply(Shapes);          \
  BENCHMARK_CAPTURE(BM_Kernels, type, TensorType::type)->Apply(Shapes);
TILE_OVERHEAD(Q4_0)
TILE_OVERHEAD(Q4_1)
TILE_OVERHEAD(Q8_0)
TILE_OVERHEAD(Q4_K)
TILE_OVERHEAD(Q6_K)

}  // namespace
