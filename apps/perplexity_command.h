#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm perplexity`: llama-perplexity's method (non-overlapping chunks, second half scored).
void add_perplexity_command(CLI::App& app);
}  // namespace ringlm
