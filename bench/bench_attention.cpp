// The attention of a speculative draft's checking pass (backends/cpu/attention.h): its rows run
// one decode call after another (what a backend without attention_steps gets, and what the CPU
// backend ran before it) against attention_steps, which converts the keys once and runs every
// row at once. SmolLM2-135M's heads (9 query, 3 KV, 64 wide), an fp16 cache of `past` tokens,
// 1 + drafted rows. Time per layer.
//
//   bench_attention --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "backends/cpu/attention.h"
#include "quant/formats.h"

namespace {

using ringlm::cpu::AttentionJob;
using ringlm::cpu::AttentionScratch;
using ringlm::cpu::KvLayer;

int bench_threads() {
  const char* env = std::getenv("RINGLM_BENCH_THREADS");
  return env ? std::atoi(env) : 2;
}

void BM_CheckingAttention(benchmark::State& state, bool steps) {
  const int past = static_cast<int>(state.range(0)), rows = static_cast<int>(state.range(1));
  const ringlm::AttentionShape shape{9, 3, 64};
  const int kv_width = shape.n_head_kv * shape.head_dim, n = past + rows;
  const int64_t q_width = static_cast<int64_t>(shape.n_head) * shape.head_dim;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> k(static_cast<size_t>(n) * kv_width), v(k.size());
  for (auto& x : k) x = static_cast<uint16_t>(ringlm::fp32_to_fp16(normal(rng)));
  for (auto& x : v) x = static_cast<uint16_t>(ringlm::fp32_to_fp16(normal(rng)));
  std::vector<float> q(static_cast<size_t>(rows * q_width)), out(q.size());
  for (float& x : q) x = normal(rng);
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = i;
  const KvLayer kv{k.data(), v.data(), kv_width, true, positions.data(), n, nullptr};
  AttentionScratch scratch;
  const int threads = bench_threads();
  std::vector<float> phi(static_cast<size_t>(shape.n_head));
  for (auto _ : state) {
    std::fill(phi.begin(), phi.end(), 3.0f);  // as a previous step leaves it
    if (steps) {
      const AttentionJob job{q.data(), kv, past, rows, out.data(), phi.data(), nullptr};
      ringlm::cpu::attention_steps(shape, job, scratch, threads);
    } else {
      for (int i = 0; i < rows; ++i) {
        ringlm::cpu::attention_causal(shape, q.data() + i * q_width, kv, past + i, 1, out.data() + i * q_width, scratch,
                                      threads, phi.data());
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
}

void Passes(benchmark::internal::Benchmark* b) {
  for (int past : {100, 200, 400, 800}) {
    for (int rows : {5, 9}) b->Args({past, rows});
  }
  b->ArgNames({"past", "rows"});
  b->Unit(benchmark::kMicrosecond);
  b->UseRealTime();
}

BENCHMARK_CAPTURE(BM_CheckingAttention, rows_one_by_one, false)->Apply(Passes);
BENCHMARK_CAPTURE(BM_CheckingAttention, attention_steps, true)->Apply(Passes);

}  // namespace
