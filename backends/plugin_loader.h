// Finding and loading backend plugins (backends/plugin_api.h) at run time.
//
// A plugin is a shared library named libringlm-<name>.so. It is looked for, in this order, in
// the --plugin-dir directory, in each directory of $RINGLM_PLUGIN_PATH (colon-separated), and
// next to the running executable. Loading checks the entry point and the ABI version; every
// failure carries its cause (library missing or not loadable, entry symbol missing, wrong ABI
// version, no device, device open error).
#pragma once

#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/plugin_api.h"

namespace ringlm {

class PluginError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A loaded plugin library; unloaded (dlclose) when the last reference goes.
class LoadedPlugin {
 public:
  ~LoadedPlugin();
  LoadedPlugin(const LoadedPlugin&) = delete;
  LoadedPlugin& operator=(const LoadedPlugin&) = delete;

  const ringlm_plugin& api() const { return *api_; }
  std::string name() const { return api_->name; }
  // The plugin ABI version the plugin speaks (1 to 3): only that version's entries are used.
  uint32_t abi_version() const { return api_->abi_version; }
  const std::filesystem::path& path() const { return path_; }
  // The plugin's devices; PluginError with the plugin's reason when it cannot list them.
  std::vector<ringlm_device_info> devices() const;
  // The plugin's last error text for `ctx` (nullptr: the calls without a context).
  std::string last_error(const ringlm_context* ctx = nullptr) const;

 private:
  friend std::shared_ptr<LoadedPlugin> load_plugin(const std::filesystem::path& library);
  LoadedPlugin(void* handle, const ringlm_plugin* api, std::filesystem::path path)
      : handle_(handle), api_(api), path_(std::move(path)) {}
  void* handle_;
  const ringlm_plugin* api_;
  std::filesystem::path path_;
};

// Loads one plugin library. PluginError naming the file and the cause: not found, dlopen's
// message, the entry symbol missing, a NULL table, an ABI version or table size mismatch.
std::shared_ptr<LoadedPlugin> load_plugin(const std::filesystem::path& library);

// The directories searched, in order: plugin_dir (if not empty), $RINGLM_PLUGIN_PATH's entries,
// the directory of the running executable (a build tree), then where `cmake --install` puts the
// plugins relative to it (<prefix>/lib/ringlm beside <prefix>/bin; RINGLM_INSTALLED_PLUGIN_DIR)
// when that exists. Duplicates removed.
std::vector<std::filesystem::path> plugin_search_dirs(const std::string& plugin_dir);

struct PluginLoadFailure {
  std::filesystem::path path;
  std::string reason;
};

struct PluginScan {
  std::vector<std::shared_ptr<LoadedPlugin>> loaded;  // in search order; a name found twice: the first
  std::vector<PluginLoadFailure> failed;
};

// Loads every libringlm-*.so in `dirs` (a missing directory is skipped; a directory given but
// unreadable is a failure), keeping the first plugin of each name.
PluginScan scan_plugins(const std::vector<std::filesystem::path>& dirs);

// --device: "cpu", "auto", or "<plugin name>[:<device index>]" (e.g. "opencl", "opencl:1").
struct DeviceSpec {
  enum class Kind { kCpu, kAuto, kPlugin } kind = Kind::kCpu;
  std::string plugin;  // kPlugin: the plugin's name
  int index = 0;       // kPlugin: the device index within the plugin
};
// std::invalid_argument naming the value and the accepted forms.
DeviceSpec parse_device_spec(const std::string& value);

// A plugin device chosen and opened; closes the context when destroyed.
struct OpenedDevice {
  std::shared_ptr<LoadedPlugin> plugin;
  ringlm_context* context = nullptr;
  int index = 0;
  ringlm_device_info info{};
  OpenedDevice() = default;
  OpenedDevice(const OpenedDevice&) = delete;
  OpenedDevice& operator=(const OpenedDevice&) = delete;
  ~OpenedDevice();
};

// Opens the device `spec` names (kPlugin), searching `dirs`. PluginError with the cause when it
// cannot: no plugin of that name (listing what was found and why others failed), no such device
// index, or the plugin's own open error (e.g. a kernel build log). cache_dir is passed to the
// plugin for its compiled programs.
std::unique_ptr<OpenedDevice> open_plugin_device(const DeviceSpec& spec, const std::vector<std::filesystem::path>& dirs,
                                                 const std::filesystem::path& cache_dir);

// --device auto: the first GPU or accelerator device of any plugin in `dirs`, opened; nullptr
// when there is none or none opens, with `why` set to a one-line reason for the notice.
std::unique_ptr<OpenedDevice> open_auto_device(const std::vector<std::filesystem::path>& dirs,
                                               const std::filesystem::path& cache_dir, std::string& why);

}  // namespace ringlm
