#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm bench`: llama-bench's method and output (markdown table or JSON), so the two tools'
// numbers line up row for row.
void add_bench_command(CLI::App& app);
}  // namespace ringlm
