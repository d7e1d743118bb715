#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm chat`: an interactive conversation kept in the KV cache (libedit on a terminal), or
// one user message per line of stdin when it is not a terminal.
void add_chat_command(CLI::App& app);
}  // namespace ringlm
