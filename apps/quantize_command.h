#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm quantize`: rewrites a GGUF model with its weight matrices in another type.
void add_quantize_command(CLI::App& app);
}  // namespace ringlm
