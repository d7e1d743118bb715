#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm run`: one prompt in, generated text streamed to stdout, a speed summary on stderr.
void add_run_command(CLI::App& app);
}  // namespace ringlm
