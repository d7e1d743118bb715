#include "backends/backend.h"

#include <cmath>

namespace ringlm {

const float* normalized_input_row(const MatmulInput& in, int64_t m, int64_t cols, float* out) {
  const float* x = in.x + m * cols;
  if (in.rms_weight == nullptr) return x;
  // 1 / RMS in double: a long row of large activations would lose digits in a float sum.
  double sum_sq = 0;
  for (int64_t i = 0; i < cols; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
  const auto scale = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + in.rms_eps));
  for (int64_t i = 0; i < cols; ++i) out[i] = x[i] * scale * in.rms_weight[i];
  return out;
}

}  // namespace ringlm
