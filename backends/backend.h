// The backend seam: how the model asks for its matrix products.
//
// The model hands every weight matrix to the backend once, at load (prepare), and from then on
// only asks for products with it (matmul). What "prepare" does is the backend's business:
// reference the mmap in place, repack into a kernel layout, or upload to a device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "quant/formats.h"

namespace ringlm {

// A weight matrix as stored in the model file: `rows` output features (N), each a contiguous
// row of `cols` input features (K) in `type`'s block layout.
struct WeightView {
  std::string name;
  TensorType type = TensorType::F32;
  int64_t rows = 0;
  int64_t cols = 0;
  const uint8_t* data = nullptr;
};

// A weight after the backend prepared it. Opaque to the model except for its shape.
class PreparedWeight {
 public:
  PreparedWeight(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) {}
  virtual ~PreparedWeight() = default;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }

 private:
  int64_t rows_;
  int64_t cols_;
};

// An input to a product: `n_tokens` rows of `cols` fp32 values. With `rms_weight` set, each row
// is RMS-normalised and scaled by it on the way in, x / sqrt(mean(x^2) + rms_eps) * rms_weight,
// so the normalisation is fused with whatever the backend does to its inputs (the CPU backend's
// int8 quantization) and never written out as a separate activation array.
struct MatmulInput {
  const float* x = nullptr;
  int64_t n_tokens = 0;
  const float* rms_weight = nullptr;  // [cols], or nullptr for no normalisation
  float rms_eps = 0.0f;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Called once per weight at load. Throws std::runtime_error naming the weight if its
  // type or shape cannot be run.
  virtual std::unique_ptr<PreparedWeight> prepare(const WeightView& weight) = 0;

  // y[m][n] = sum_k x[m][k] * W[n][k] for m < n_tokens: x is [n_tokens][cols], y is [n_tokens][rows].
  virtual void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) = 0;

  // ys[i] = input x weights[i]^T for every i, with the input prepared (normalised, quantized)
  // once and one pass over all the weights' rows: a fused QKV projection without copying the
  // three matrices into one. Every weight has the input's number of columns.
  virtual void matmul_many(std::span<const PreparedWeight* const> weights, const MatmulInput& input,
                           std::span<float* const> ys) = 0;

  // out = silu(input x gate^T) * (input x up^T), the SwiGLU feed-forward input, with the
  // activation applied as each output tile is produced. out is [n_tokens][gate.rows()].
  virtual void matmul_swiglu(const PreparedWeight& gate, const PreparedWeight& up, const MatmulInput& input,
                             float* out) = 0;
};

// The CPU backend with int8 compute (backends/cpu/cpu_backend.h has the other choices);
// `n_threads` OpenMP threads for every kernel.
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace ringlm
