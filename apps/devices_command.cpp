// `ringlm devices`: what --device can name on this machine. One line for the CPU backend, one per
// device of each plugin that loads (labelled as --device takes it: "opencl:0"), then the plugins
// that did not load and why, then the directories searched. It is the first thing to run when a
// plugin is not picked up, so it never fails on a broken plugin: it reports it and exits 0.
#include "apps/devices_command.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "apps/common_options.h"
#include "backends/cpu/amx.h"
#include "backends/cpu/tuning.h"
#include "backends/plugin_loader.h"

namespace ringlm {

namespace {

struct DevicesOptions {
  std::string plugin_dir;
};

// One row of the table: a --device label and what it is.
struct Row {
  std::string label;
  std::string description;
};

std::string device_type_name(uint32_t type) {
  switch (type) {
    case RINGLM_DEVICE_CPU: return "CPU";
    case RINGLM_DEVICE_GPU: return "GPU";
    case RINGLM_DEVICE_ACCELERATOR: return "accelerator";
    default: return "other device";
  }
}

std::string memory_text(uint64_t bytes) {
  char buf[32];
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (static_cast<double>(bytes) >= kGiB) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(bytes) / kGiB);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  }
  return buf;
}

// "pthread-haswell-AMD EPYC — CPU, 2 compute units, 21.9 GiB, OpenCL 3.0 PoCL 3.1   [path]"
std::string device_description(const ringlm_device_info& info, const LoadedPlugin& plugin) {
  std::string text = std::string(info.name) + " — " + device_type_name(info.type);
  if (info.compute_units > 0) text += std::string(", ") + std::to_string(info.compute_units) + " compute units";
  if (info.memory_bytes > 0) text += std::string(", ") + memory_text(info.memory_bytes);
  if (info.version[0] != '\0') text += std::string(", ") + info.version;
  return text + ", plugin ABI " + std::to_string(plugin.abi_version()) + "   [" + plugin.path().string() + "]";
}

// The loader's messages start with the file name; in a row that already shows it, drop it.
std::string without_path(const std::string& message, const std::filesystem::path& path) {
  const std::string prefix = path.string() + ": ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

// A plugin's reason may span lines (a driver's log): keep them under the entry they belong to.
std::string indent_continuation_lines(std::string text, const std::string& indent) {
  for (size_t at = text.find('\n'); at != std::string::npos; at = text.find('\n', at + 1 + indent.size())) {
    text.insert(at + 1, indent);
  }
  return text;
}

Row cpu_row() {
  const TuningMachine machine = this_machine(resolve_threads(0));
  return {"cpu", machine.cpu + " (" + std::to_string(machine.threads) + " threads), SIMD target " + machine.target +
                     " (Highway)"};
}

// Intel AMX: whether this process could use the tiles, and why not.
Row amx_row() {
  const cpu::AmxState state = cpu::amx_state();
  std::string words = cpu::amx_state_words(state);
  if (state == cpu::AmxState::kOn) {
    words += " (prompt chunks of " + std::to_string(KernelTable::kDefaultTilesFrom) +
             " tokens or more, or from where `ringlm tune` measured the tiles faster)";
  }
  if (state == cpu::AmxState::kEmulated) words += ": the tile products in plain C++, for tests (slow)";
  return {"amx", words};
}

// A plugin's rows: one per device, or one saying why it has none to offer.
std::vector<Row> plugin_rows(const LoadedPlugin& plugin) {
  std::vector<ringlm_device_info> devices;
  try {
    devices = plugin.devices();
  } catch (const PluginError& e) {
    return {{plugin.name(), without_path(e.what(), plugin.path()) + "   [" + plugin.path().string() + "]"}};
  }
  if (devices.empty()) return {{plugin.name(), std::string("no devices   [") + plugin.path().string() + "]"}};
  std::vector<Row> rows;
  for (size_t i = 0; i < devices.size(); ++i) {
    rows.push_back({plugin.name() + ":" + std::to_string(i), device_description(devices[i], plugin)});
  }
  return rows;
}

void print_rows(const std::vector<Row>& rows) {
  size_t width = 0;
  for (const Row& row : rows) width = std::max(width, row.label.size());
  const std::string indent(width + 2, ' ');
  for (const Row& row : rows) {
    std::printf("%-*s  %s\n", static_cast<int>(width), row.label.c_str(),
                indent_continuation_lines(row.description, indent).c_str());
  }
}

void print_failures(const std::vector<PluginLoadFailure>& failed) {
  if (failed.empty()) return;
  std::printf("plugins that could not load:\n");
  for (const PluginLoadFailure& f : failed) {
    std::printf("  %s: %s\n", f.path.string().c_str(), indent_continuation_lines(f.reason, "    ").c_str());
  }
}

void print_search_dirs(const std::vector<std::filesystem::path>& dirs) {
  std::string line = "plugin directories searched:";
  for (size_t i = 0; i < dirs.size(); ++i) {
    std::error_code ec;
    line += (i == 0 ? " " : ", ") + dirs[i].string() + (std::filesystem::exists(dirs[i], ec) ? "" : " (absent)");
  }
  std::printf("%s\n", dirs.empty() ? "plugin directories searched: none" : line.c_str());
}

void list_devices(const DevicesOptions& o) {
  const std::vector<std::filesystem::path> dirs = plugin_search_dirs(o.plugin_dir);
  const PluginScan scan = scan_plugins(dirs);
  std::vector<Row> rows = {cpu_row(), amx_row()};
  for (const auto& plugin : scan.loaded) {
    for (Row& row : plugin_rows(*plugin)) rows.push_back(std::move(row));
  }
  print_rows(rows);
  print_failures(scan.failed);
  print_search_dirs(dirs);
  std::fflush(stdout);
}

}  // namespace

void add_devices_command(CLI::App& app) {
  auto o = std::make_shared<DevicesOptions>();
  CLI::App* cmd = app.add_subcommand("devices", "list the CPU and the plugin devices --device can name");
  cmd->add_option("--plugin-dir", o->plugin_dir,
                  "also look for plugins (libringlm-<name>.so) here, before $RINGLM_PLUGIN_PATH and the executable's "
                  "directory");
  cmd->callback([o] { list_devices(*o); });
}

}  // namespace ringlm
