#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm batch`: a file of prompts through continuous batching, one JSON line per result,
// resumable.
void add_batch_command(CLI::App& app);
}  // namespace ringlm
