#pragma once
#include <CLI/CLI.hpp>

namespace ringlm {
// `ringlm devices`: the CPU, every device of every plugin found (backends/plugin_loader.h), and
// each plugin that could not load with the reason. A report: it exits 0 whatever it finds.
void add_devices_command(CLI::App& app);
}  // namespace ringlm
