// Decode attention (backends/cpu/attention.h) at depth, one step over every layer's cache; and
// the attention of a speculative draft's checking pass: its rows run one decode call after
// another (what a backend without attention_steps gets, and what the CPU backend ran before it)
// against attention_steps, which converts the keys once and runs every row at once.
// SmolLM2-135M's heads (9 query, 3 KV, 64 wide), an fp16 cache of `past` tokens, 1 + drafted
// rows. Time per layer.
//
//   bench_attention --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/attention.h"
#include "quant/formats.h"
#include "quant/quantize.h"

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
  const KvLayer kv{k.data(), v.data(), kv_width, ringlm::KvType::kF16, ringlm::KvType::kF16, positions.data(), n, nullptr};
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

// One decode step's attention at depth, every layer of a model in turn (the caches together far
// larger than the last-level cache, as in a real step): SmolLM2-135M (9 query heads, 3 KV heads,
// 64 wide, 30 layers) or Llama-3.2-1B (32, 8, 64; 16 layers), an fp16 or q8_0 cache of `depth`
// tokens. Time per step; bytes/s counts the keys and values read once, in the cache's type.
void BM_DecodeAttention(benchmark::State& state) {
  const int depth = static_cast<int>(state.range(0));
  const bool llama_1b = state.range(1) != 0;
  const ringlm::KvType type = state.range(2) != 0 ? ringlm::KvType::kQ8_0 : ringlm::KvType::kF16;
  const ringlm::AttentionShape shape = llama_1b ? ringlm::AttentionShape{32, 8, 64} : ringlm::AttentionShape{9, 3, 64};
  // RINGLM_BENCH_LAYERS: fewer layers, e.g. 1 or 2, whose caches stay in the last-level cache
  // (the kernels' own speed, without the memory's).
  const char* layers_env = std::getenv("RINGLM_BENCH_LAYERS");
  const int layers = layers_env != nullptr ? std::atoi(layers_env) : llama_1b ? 16 : 30;
  const int kv_width = shape.n_head_kv * shape.head_dim, n = depth + 1;
  const int64_t q_width = static_cast<int64_t>(shape.n_head) * shape.head_dim;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<size_t>(kv_width));
  const size_t row_bytes = ringlm::kv_bytes_of(type, kv_width);
  std::vector<uint8_t> kv_pool(static_cast<size_t>(n) * row_bytes);
  for (int j = 0; j < n; ++j) {
    for (float& x : values) x = normal(rng);
    uint8_t* row = kv_pool.data() + static_cast<size_t>(j) * row_bytes;
    if (type == ringlm::KvType::kQ8_0) {
      ringlm::quantize_row(ringlm::TensorType::Q8_0, values.data(), row, kv_width);
    } else {
      for (int e = 0; e < kv_width; ++e) {
        const uint16_t h = ringlm::fp32_to_fp16(values[static_cast<size_t>(e)]);
        std::memcpy(row + 2 * e, &h, 2);
      }
    }
  }
  // Every layer's keys and values: copies of one random pool (filling each with fresh numbers
  // would take longer than the benchmark).
  std::vector<std::vector<uint8_t>> k(static_cast<size_t>(layers)), v(static_cast<size_t>(layers));
  for (auto* side : {&k, &v}) {
    for (auto& layer : *side) layer = kv_pool;
  }
  std::vector<float> q(static_cast<size_t>(q_width)), out(q.size());
  for (float& x : q) x = normal(rng);
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = i;
  AttentionScratch scratch;
  const int threads = bench_threads();
  std::vector<std::vector<float>> phi(static_cast<size_t>(layers), std::vector<float>(static_cast<size_t>(shape.n_head), NAN));
  for (auto _ : state) {
    for (int l = 0; l < layers; ++l) {
      const KvLayer kv{k[static_cast<size_t>(l)].data(), v[static_cast<size_t>(l)].data(), kv_width, type, type,
                       positions.data(), n, nullptr};
      ringlm::cpu::attention_causal(shape, q.data(), kv, depth, 1, out.data(), scratch, threads,
                                    phi[static_cast<size_t>(l)].data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * int64_t{layers} * 2 * n * static_cast<int64_t>(row_bytes));
}

BENCHMARK(BM_DecodeAttention)
    ->ArgsProduct({{256, 4096, 8000, 16384}, {0, 1}, {0, 1}})
    ->ArgNames({"depth", "llama_1b", "q8_0"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_CAPTURE(BM_CheckingAttention, rows_one_by_one, false)->Apply(Passes);
BENCHMARK_CAPTURE(BM_CheckingAttention, attention_steps, true)->Apply(Passes);

}  // namespace
