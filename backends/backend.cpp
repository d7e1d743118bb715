#include "backends/backend.h"

#include <cmath>

namespace ringlm {

const float* normalized_input_row(const MatmulInput& in, int64_t m, int64_t cols, float* out) {
  const float* x = in.x + m * cols;
  if (in.rms_weight == nullptr) return x;
  // 1 / RMS in double: a long row of large activations would lose digits in a float sum. Four
  // partial sums in a fixed order: one chain of dependent additions would be the slowest part
  // of the row, and the compiler may not reorder it on its own.
  double part[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= cols; i += 4) {
    for (int j = 0; j < 4; ++j) part[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (; i < cols; ++i) part[0] += static_cast<double>(x[i]) * x[i];
  const double sum_sq = (part[0] + part[1]) + (part[2] + part[3]);
  const auto scale = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(cols) + in.rms_eps));
  for (i = 0; i < cols; ++i) out[i] = x[i] * scale * in.rms_weight[i];
  return out;
}

}  // namespace ringlm
