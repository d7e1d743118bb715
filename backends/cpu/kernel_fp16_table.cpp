#include "backends/cpu/kernel_fp16_table.h"

#include <cstdint>
#include <vector>

#include "quant/formats.h"

namespace ringlm::cpu {

const float* fp16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(size_t{1} << 16);
    for (uint32_t h = 0; h < t.size(); ++h) t[h] = fp16_to_fp32(static_cast<f16_bits>(h));
    return t;
  }();
  return table.data();
}

}  // namespace ringlm::cpu
