// The CPU backend with an explicit compute type.
#pragma once

#include <cstdint>
#include <memory>

#include "backends/backend.h"
#include "backends/cpu/tuning.h"

namespace ringlm {

// How the CPU backend multiplies weights:
//  - kInt8: the packed kernels (kernel_packed.h): activations quantized to int8 per block of 32
//    (per 256 for the K-quants and IQ4_XS) on the fly, integer dot products, one float
//    multiply-add per block (fast; activations carry a rounding error of at most max|x|/254 of
//    their block); F32/F16/BF16 weights multiply the fp32 activations.
//  - kFp32: weights dequantized to fp32 and multiplied with the fp32 activations (reference).
enum class ComputeType { kInt8, kFp32 };

// `n_threads` OpenMP threads per matmul (0: OpenMP's default). Under kInt8, a call on a weight
// takes the fp32 sgemm path, the faster prefill GEMM, from a number of tokens on: with
// `int8_sgemm_min_tokens` > 0, that many for every weight (tests pass a large value to keep
// int8, `ringlm tune` 1 to force sgemm); with 0, the crossover of the weight's shape in the
// tuning table (load_configured_kernel_table(): $RINGLM_TUNING or the cache), read once here.
std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, int64_t int8_sgemm_min_tokens = 0);
// The same with the crossovers of a given table (shapes it lacks: the nearest entry, or the default).
std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, const KernelTable& table);

}  // namespace ringlm
