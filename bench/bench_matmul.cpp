// Weight-matrix products on the CPU backend, per weight format and batch size M
// (M = 1 is decode's GEMV, M = 512 a prefill chunk). Reports weight bytes read per second.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "backends/backend.h"

namespace {

using ringlm::TensorType;

// Random weight blocks of `type`: the kernels' speed does not depend on the values.
std::vector<uint8_t> random_weights(TensorType type, int64_t rows, int64_t cols) {
  std::vector<uint8_t> bytes(ringlm::row_bytes(type, cols) * static_cast<size_t>(rows));
  std::mt19937 rng(1);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  // Keep fp16 scales finite: clear the top exponent bits of every 16-bit word.
  for (size_t i = 1; i < bytes.size(); i += 2) bytes[i] &= 0x3B;
  return bytes;
}

void BM_Matmul(benchmark::State& state, TensorType type) {
  const int64_t rows = state.range(0), cols = state.range(1), m = state.range(2);
  const std::vector<uint8_t> w = random_weights(type, rows, cols);
  auto backend = ringlm::make_cpu_backend(0);
  auto prepared = backend->prepare({"bench", type, rows, cols, w.data()});
  std::vector<float> x(static_cast<size_t>(m * cols), 0.5f), y(static_cast<size_t>(m * rows));
  for (auto _ : state) {
    backend->matmul(*prepared, x.data(), m, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(w.size()));
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * rows * cols * m * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

// SmolLM2-135M's FFN shape and Llama-7B's, at decode and prefill batch sizes.
void Shapes(benchmark::internal::Benchmark* b) {
  for (int m : {1, 8, 64}) b->Args({1536, 576, m});
  b->Args({11008, 4096, 1});
  b->Unit(benchmark::kMicrosecond);
}

BENCHMARK_CAPTURE(BM_Matmul, Q4_0, TensorType::Q4_0)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q4_1, TensorType::Q4_1)->Apply(Shapes);
BENCHMARK_CAPTURE(BM_Matmul, Q8_0, TensorType::Q8_0)->Apply(Shapes);

}  // namespace
