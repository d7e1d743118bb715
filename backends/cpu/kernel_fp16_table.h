// fp16 -> fp32 for every 16-bit pattern, so that the kernels read a weight block's fp16 scale
// with one broadcast load instead of a vector conversion and its shuffles.
#pragma once

namespace ringlm::cpu {

// The table, built on first use (thread-safe), 256 KiB. Only the few exponents a model's scales
// use are ever touched, so it costs the kernels a few cache lines, not the L2.
const float* fp16_table();

}  // namespace ringlm::cpu
