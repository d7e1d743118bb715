// The CPU backend, and the same with the crossover of its int8 kernels and sgemm set by hand
// (tests, tune).
#pragma once

#include <cstdint>
#include <memory>

#include "backends/backend.h"
#include "backends/cpu/tuning.h"

namespace ringlm {

// The CPU backend; `n_threads` OpenMP threads for every kernel (0: OpenMP's default). Under
// kInt8, a product takes the fp32 sgemm path from the number of tokens at which the tuning table
// (ringlm tune; backends/cpu/tuning.h) measured it faster, read once here.
std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute = ComputeType::kInt8);

// `n_threads` OpenMP threads per matmul (0: OpenMP's default). Under kInt8, a call on a weight
// takes the fp32 sgemm path, the faster prefill GEMM, from a number of tokens on: with
// `int8_sgemm_min_tokens` > 0, that many for every weight (tests pass a large value to keep
// int8, `ringlm tune` 1 to force sgemm); with 0, the crossover of the weight's shape in the
// tuning table (load_configured_kernel_table(): $RINGLM_TUNING or the cache), read once here.
std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, int64_t int8_sgemm_min_tokens);
// The same with the crossovers of a given table (shapes it lacks: the nearest entry, or the default).
std::unique_ptr<Backend> make_cpu_backend(int n_threads, ComputeType compute, const KernelTable& table);

}  // namespace ringlm
