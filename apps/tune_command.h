#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm tune`: measures the int8 kernels against dequantize + sgemm on each of a model's
// weight shapes and writes the crossovers as the backend's tuning table (backends/cpu/tuning.h).
void add_tune_command(CLI::App& app);
}  // namespace ringlm
