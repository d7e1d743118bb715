// CPU backend, reference path: each weight row is dequantized to fp32 once per call and
// multiplied with every token's activations (so a prefill of M tokens dequantizes W once).
// Rows are split across OpenMP threads; each output element is one thread's sequential sum,
// so results do not depend on the thread count.
#include <omp.h>

#include <stdexcept>
#include <vector>

#include "backends/backend.h"

namespace ringlm {
namespace {

class CpuWeight final : public PreparedWeight {
 public:
  explicit CpuWeight(const WeightView& w)
      : PreparedWeight(w.rows, w.cols), type(w.type), data(w.data), row_stride(row_bytes(w.type, w.cols)) {}
  TensorType type;
  const uint8_t* data;
  size_t row_stride;
};

// Eight independent partial sums let the compiler keep a vector register per lane.
float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads) : n_threads_(n_threads > 0 ? n_threads : omp_get_max_threads()) {}

  std::string_view name() const override { return "CPU"; }

  std::unique_ptr<PreparedWeight> prepare(const WeightView& w) override {
    const std::optional<TypeTraits> traits = type_traits(static_cast<uint32_t>(w.type));
    if (!traits || !traits->readable) {
      throw std::runtime_error("weight '" + w.name + "': tensor type " +
                               std::string(traits ? traits->name : "unknown") + " is not supported");
    }
    if (w.cols % traits->block_elems != 0) {
      throw std::runtime_error("weight '" + w.name + "': row length " + std::to_string(w.cols) +
                               " is not a multiple of the block size " + std::to_string(traits->block_elems));
    }
    return std::make_unique<CpuWeight>(w);
  }

  void matmul(const PreparedWeight& prepared, const float* x, int64_t n_tokens, float* y) override {
    const auto& w = static_cast<const CpuWeight&>(prepared);
    const int64_t rows = w.rows();
    const int64_t cols = w.cols();
#pragma omp parallel num_threads(n_threads_)
    {
      std::vector<float> row(static_cast<size_t>(cols));
#pragma omp for schedule(static)
      for (int64_t n = 0; n < rows; ++n) {
        dequantize_row(w.type, w.data + static_cast<size_t>(n) * w.row_stride, row.data(), cols);
        for (int64_t m = 0; m < n_tokens; ++m) y[m * rows + n] = dot_f32(x + m * cols, row.data(), cols);
      }
    }
  }

 private:
  int n_threads_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads) { return std::make_unique<CpuBackend>(n_threads); }

}  // namespace ringlm
