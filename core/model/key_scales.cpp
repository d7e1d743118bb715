#include "core/model/key_scales.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ringlm {

std::vector<float> calibrate_key_scales(std::span<const float> q, std::span<const float> k, int n,
                                        const KeyScaleShape& shape) {
  const int hd = shape.head_dim, kv_dim = shape.n_head_kv * hd;
  if (shape.n_head_kv <= 0 || hd <= 0 || shape.n_head % shape.n_head_kv != 0) {
    throw std::invalid_argument("calibrate_key_scales: inconsistent head shape");
  }
  if (n < 0 || q.size() < static_cast<size_t>(n) * shape.n_head * hd || k.size() < static_cast<size_t>(n) * kv_dim) {
    throw std::invalid_argument("calibrate_key_scales: fewer values than rows");
  }
  const int group = shape.n_head / shape.n_head_kv;
  std::vector<double> key_square(static_cast<size_t>(kv_dim), 0.0), query_square(static_cast<size_t>(kv_dim), 0.0);
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < kv_dim; ++c) {
      const double x = k[static_cast<size_t>(r) * kv_dim + c];
      key_square[static_cast<size_t>(c)] += x * x;
    }
    for (int h = 0; h < shape.n_head; ++h) {
      const float* head = q.data() + (static_cast<size_t>(r) * shape.n_head + h) * hd;
      double* into = query_square.data() + static_cast<size_t>(h / group) * hd;
      for (int i = 0; i < hd; ++i) into[i] += static_cast<double>(head[i]) * head[i];
    }
  }
  std::vector<float> scales(static_cast<size_t>(kv_dim), 1.0f);
  for (int kh = 0; kh < shape.n_head_kv; ++kh) {
    const size_t base = static_cast<size_t>(kh) * hd;
    std::vector<double> s(static_cast<size_t>(hd), 1.0);
    double log_sum = 0.0;
    for (int i = 0; i < hd; ++i) {
      const double ks = key_square[base + i], qs = query_square[base + i];
      if (ks > 0.0 && qs > 0.0) s[static_cast<size_t>(i)] = std::pow(ks / (qs / group), 0.25);
      log_sum += std::log(s[static_cast<size_t>(i)]);
    }
    const double mean = std::exp(log_sum / hd);
    for (int i = 0; i < hd; ++i) {
      scales[base + i] = static_cast<float>(std::clamp(s[static_cast<size_t>(i)] / mean, 1.0 / kKeyScaleLimit,
                                                       static_cast<double>(kKeyScaleLimit)));
    }
  }
  return scales;
}

}  // namespace ringlm
