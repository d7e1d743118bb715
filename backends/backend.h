// The backend seam: how the model asks for its matrix products.
//
// The model hands every weight matrix to the backend once, at load (prepare), and from then on
// only asks for products with it (matmul). What "prepare" does is the backend's business:
// reference the mmap in place, repack into a kernel layout, or upload to a device.
#pragma once

#include <cstdint>
#include <memory>
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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Called once per weight at load. Throws std::runtime_error naming the weight if its
  // type or shape cannot be run.
  virtual std::unique_ptr<PreparedWeight> prepare(const WeightView& weight) = 0;

  // y[m][n] = sum_k x[m][k] * W[n][k] for m < n_tokens: x is [n_tokens][cols], y is [n_tokens][rows].
  virtual void matmul(const PreparedWeight& weight, const float* x, int64_t n_tokens, float* y) = 0;
};

// The CPU backend; `n_threads` OpenMP threads for every kernel.
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace ringlm
