// Weight-matrix products on the CPU backend, per weight format, compute type (int8 kernels vs
// fp32 dequantize paths) and batch size M (1 = decode's GEMV, 4..16 flat GEMM, 64/512 prefill).
// Reports weight bytes read per second (bytes_per_second) and GFLOP/s.
//
// Weights are cycled over enough copies to exceed the last-level cache, as in a real model where
// each matrix is read once per token: M = 1 measures DRAM streaming, not L3.
//
//   bench_matmul --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//   bench_matmul --benchmark_filter='Q4_1/int8'
// Variants: int8 (the backend's choice: int8 kernels below the sgemm crossover), int8only (the
// int8 kernels for every M), fp32 (dequantized rows, sgemm from M = 16).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/cpu_backend.h"

namespace {

using ringlm::ComputeType;
using ringlm::TensorType;

constexpr size_t kColdBytes = size_t{160} << 20;  // more than any L3 this runs on

// Random weight blocks of `type`: the kernels' speed does not depend on the values.
std::vector<uint8_t> random_weights(TensorType type, int64_t rows, int64_t cols) {
  std::vector<uint8_t> bytes(ringlm::row_bytes(type, cols) * static_cast<size_t>(rows));
  std::mt19937 rng(1);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  // Keep fp16 scales finite: clear the top exponent bits of every 16-bit word.
  for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x3B;
  return bytes;
}

// RINGLM_BENCH_THREADS=1 measures one core: its CPU-time column is then robust to a loaded machine.
int bench_threads() {
  const char* env = std::getenv("RINGLM_BENCH_THREADS");
  return env ? std::atoi(env) : 0;
}

// int8_sgemm_min_tokens: 0 keeps the backend's crossover (large M on int8 runs sgemm); a huge
// value forces the int8 kernels for every M (prefill option (a) against sgemm's option (b)).
void BM_Matmul(benchmark::State& state, TensorType type, ComputeType compute, int64_t int8_sgemm_min_tokens) {
  const int64_t rows = state.range(0), cols = state.range(1), m = state.range(2);
  const std::vector<uint8_t> one = random_weights(type, rows, cols);
  // Copies to cycle through; large M is compute-bound and reuses W from cache anyway.
  const size_t copies = m <= 16 ? std::max<size_t>(1, kColdBytes / one.size()) : 1;
  std::vector<uint8_t> w(one.size() * copies);
  for (size_t c = 0; c < copies; ++c) std::memcpy(w.data() + c * one.size(), one.data(), one.size());
  auto backend = ringlm::make_cpu_backend(bench_threads(), compute, int8_sgemm_min_tokens);
  std::vector<std::unique_ptr<ringlm::PreparedWeight>> prepared;
  for (size_t c = 0; c < copies; ++c) prepared.push_back(backend->prepare({"bench", type, rows, cols, w.data() + c * one.size()}));
  std::vector<float> x(static_cast<size_t>(m * cols)), y(static_cast<size_t>(m * rows));
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  backend->matmul(*prepared[0], x.data(), m, y.data());  // first call sizes the buffers
  size_t next = 0;
  for (auto _ : state) {
    backend->matmul(*prepared[next], x.data(), m, y.data());
    benchmark::DoNotOptimize(y.data());
    next = next + 1 == copies ? 0 : next + 1;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(one.size()));
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * rows * cols * m * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

// SmolLM2-135M's matrices (q/o, k/v, gate/up, down, output) and Llama-7B's FFN and attention.
void Shapes(benchmark::internal::Benchmark* b) {
  for (auto [n, k] : {std::pair{576, 576}, {192, 576}, {1536, 576}, {576, 1536}, {49152, 576}}) {
    for (int m : {1, 4, 5, 8, 9, 16, 32, 64, 512}) {  // 5, 9: checking passes of 4, 8 drafted tokens
      if (n == 49152 && m == 512) continue;  // the output matrix only runs for the last token
      b->Args({n, k, m});
    }
  }
  for (auto [n, k] : {std::pair{11008, 4096}, {4096, 4096}}) {
    for (int m : {1, 4, 8, 16, 64}) b->Args({n, k, m});
  }
  b->ArgNames({"N", "K", "M"});
  b->Unit(benchmark::kMicrosecond);
  b->UseRealTime();
}

// Llama-3.2-1B's matrices (q/o, k/v, gate/up, down) at prompt-chunk sizes: the products of its
// prefill, and where the AMX tiles (from 16 tokens) take over from AVX-512 (bench/README.md).
void Llama1BPrefillShapes(benchmark::internal::Benchmark* b) {
  for (auto [n, k] : {std::pair{2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}}) {
    for (int m : {8, 16, 32, 64, 512}) b->Args({n, k, m});
  }
  b->ArgNames({"N", "K", "M"});
  b->Unit(benchmark::kMicrosecond);
  b->UseRealTime();
}

constexpr int64_t kDefault = 0, kInt8Only = int64_t{1} << 40;
BENCHMARK_CAPTURE(BM_Matmul, Q4_0/int8, TensorType::Q4_0, ComputeType::kInt8, kDefault)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_1/int8, TensorType::Q4_1, ComputeType::kInt8, kDefault)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q8_0/int8, TensorType::Q8_0, ComputeType::kInt8, kDefault)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_0/int8only, TensorType::Q4_0, ComputeType::kInt8, kInt8Only)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_1/int8only, TensorType::Q4_1, ComputeType::kInt8, kInt8Only)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q8_0/int8only, TensorType::Q8_0, ComputeType::kInt8, kInt8Only)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_0/fp32, TensorType::Q4_0, ComputeType::kFp32, kDefault)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_1/fp32, TensorType::Q4_1, ComputeType::kFp32, kDefault)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q8_0/fp32, TensorType::Q8_0, ComputeType::kFp32, kDefault)->Apply(Shapes);

BENCHMARK_CAPTURE(BM_Matmul, 1B/Q4_0/int8, TensorType::Q4_0, ComputeType::kInt8, kDefault)->Apply(Llama1BPrefillShapes);
BENCHMARK_CAPTURE(BM_Matmul, 1B/Q4_1/int8, TensorType::Q4_1, ComputeType::kInt8, kDefault)->Apply(Llama1BPrefillShapes);
BENCHMARK_CAPTURE(BM_Matmul, 1B/Q4_K/int8, TensorType::Q4_K, ComputeType::kInt8, kDefault)->Apply(Llama1BPrefillShapes);
BENCHMARK_CAPTURE(BM_Matmul, 1B/Q6_K/int8, TensorType::Q6_K, ComputeType::kInt8, kDefault)->Apply(Llama1BPrefillShapes);

}  // namespace
