#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm serve`: an OpenAI-compatible HTTP server on the continuous-batching scheduler.
void add_serve_command(CLI::App& app);
}  // namespace ringlm
