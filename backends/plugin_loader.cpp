// The plugin loader: finds libringlm-<name>.so files, loads them with dlopen, checks their table
// against plugin_api.h, and opens the device --device names. Every failure says which file and
// why, because a plugin that silently does not load looks to the user like a slow CPU run.
#include "backends/plugin_loader.h"

#include <dlfcn.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string_view>
#include <system_error>
#include <utility>

namespace ringlm {

namespace {

namespace fs = std::filesystem;

constexpr std::string_view kLibraryPrefix = "libringlm-";
constexpr std::string_view kLibrarySuffix = ".so";

// A load failure with its cause kept apart from the file name, so that scan_plugins can report
// "path: cause" in its own layout while load_plugin's callers still catch a PluginError.
class PluginLoadError : public PluginError {
 public:
  PluginLoadError(const fs::path& library, std::string cause)
      : PluginError(library.string() + ": " + cause), cause_(std::move(cause)) {}
  const std::string& cause() const { return cause_; }

 private:
  std::string cause_;
};

// dlclose on every path out of load_plugin that does not hand the handle to a LoadedPlugin.
struct LibraryCloser {
  void operator()(void* handle) const { dlclose(handle); }
};
using LibraryHandle = std::unique_ptr<void, LibraryCloser>;

std::string dlerror_text() {
  const char* text = dlerror();
  return text != nullptr ? text : "unknown dlopen error";
}

// dlerror usually starts with the file name, which our message already leads with.
std::string without_path_prefix(std::string text, const std::string& path) {
  const std::string prefix = path + ": ";
  if (text.rfind(prefix, 0) == 0) text.erase(0, prefix.size());
  return text;
}

// Every function of the table: the loader calls some, the plugin backend the others; a NULL one
// would crash ringlm later instead of being refused here.
void check_required_fields(const ringlm_plugin& api, const fs::path& library) {
  if (api.name == nullptr || *api.name == '\0') throw PluginLoadError(library, "plugin table has no name");
  const std::pair<const char*, bool> functions[] = {
      {"last_error", api.last_error != nullptr}, {"device_count", api.device_count != nullptr},
      {"device_info", api.device_info != nullptr}, {"open", api.open != nullptr},
      {"close", api.close != nullptr}, {"alloc", api.alloc != nullptr},
      {"free", api.free != nullptr}, {"upload", api.upload != nullptr},
      {"download", api.download != nullptr}, {"supports", api.supports != nullptr},
      {"matmul", api.matmul != nullptr}, {"attention", api.attention != nullptr},
      {"rope_shift", api.rope_shift != nullptr},
  };
  for (const auto& [field, present] : functions) {
    if (!present) throw PluginLoadError(library, std::string("plugin table has no '") + field + "' function");
  }
}

// Every version-2 function: a table that says it is version 2 has them all.
void check_v2_fields(const ringlm_plugin& api, const fs::path& library) {
  const std::pair<const char*, bool> functions[] = {
      {"upload_async", api.upload_async != nullptr}, {"finish", api.finish != nullptr},
      {"copy", api.copy != nullptr},                 {"rms_norm", api.rms_norm != nullptr},
      {"add", api.add != nullptr},                   {"scale", api.scale != nullptr},
      {"glu", api.glu != nullptr},                   {"rope", api.rope != nullptr},
      {"store_kv", api.store_kv != nullptr},         {"get_rows", api.get_rows != nullptr},
      {"attention2", api.attention2 != nullptr},     {"counters", api.counters != nullptr},
      {"matmul2", api.matmul2 != nullptr},           {"rope_store", api.rope_store != nullptr},
  };
  for (const auto& [field, present] : functions) {
    if (!present) throw PluginLoadError(library, std::string("plugin table (ABI 2) has no '") + field + "' function");
  }
}

// Checks the table the entry point returned: ABI version first (its first two fields are the
// same in every ABI version, so they can be read whatever the plugin was built for). Any version
// this ringlm speaks loads; only its own entries are read.
void check_table(const ringlm_plugin* api, const fs::path& library) {
  if (api == nullptr) throw PluginLoadError(library, std::string(RINGLM_PLUGIN_ENTRY) + " returned NULL");
  if (api->abi_version < RINGLM_PLUGIN_ABI_MIN_VERSION || api->abi_version > RINGLM_PLUGIN_ABI_VERSION) {
    throw PluginLoadError(library, std::string("built for plugin ABI ") + std::to_string(api->abi_version) +
                                       ", this ringlm speaks " + std::to_string(RINGLM_PLUGIN_ABI_MIN_VERSION) +
                                       " to " + std::to_string(RINGLM_PLUGIN_ABI_VERSION));
  }
  const size_t needed = api->abi_version >= 4   ? sizeof(ringlm_plugin)
                        : api->abi_version == 3 ? RINGLM_PLUGIN_V3_SIZE
                        : api->abi_version == 2 ? RINGLM_PLUGIN_V2_SIZE
                                                : RINGLM_PLUGIN_V1_SIZE;
  if (api->struct_size < needed) {
    throw PluginLoadError(library, std::string("plugin table is ") + std::to_string(api->struct_size) +
                                       " bytes, plugin ABI " + std::to_string(api->abi_version) + " needs " +
                                       std::to_string(needed));
  }
  check_required_fields(*api, library);
  if (api->abi_version >= 2) check_v2_fields(*api, library);
  if (api->abi_version >= 3 && api->top_k == nullptr) {
    throw PluginLoadError(library, "plugin table (ABI 3) has no 'top_k' function");
  }
  if (api->abi_version >= 4 && api->attention3 == nullptr) {
    throw PluginLoadError(library, "plugin table (ABI 4) has no 'attention3' function");
  }
}

bool is_plugin_file_name(const std::string& name) {
  return name.size() > kLibraryPrefix.size() + kLibrarySuffix.size() && name.starts_with(kLibraryPrefix) &&
         name.ends_with(kLibrarySuffix);
}

// The plugin libraries in one directory, sorted by name so that a scan does not depend on the
// file system's directory order. `failed` gets the directory when it exists but cannot be read.
std::vector<fs::path> plugin_files_in(const fs::path& dir, std::vector<PluginLoadFailure>& failed) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return {};  // a directory on the path that is absent is not an error
  if (!fs::is_directory(dir, ec)) {
    failed.push_back({dir, "not a directory"});
    return {};
  }
  std::vector<fs::path> files;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code status_ec;
    // is_regular_file follows symbolic links: a link to a library is a library.
    if (is_plugin_file_name(it->path().filename().string()) && fs::is_regular_file(it->path(), status_ec)) {
      files.push_back(it->path());
    }
  }
  if (ec) failed.push_back({dir, std::string("cannot read the directory: ") + ec.message()});
  std::sort(files.begin(), files.end());
  return files;
}

// The key two spellings of one directory share ("/a/b/", "/a/./b", a symbolic link to it).
fs::path directory_identity(const fs::path& dir) {
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) return dir.lexically_normal();
  return canonical;
}

void add_unique_dir(std::vector<fs::path>& dirs, std::vector<fs::path>& identities, const fs::path& dir) {
  fs::path identity = directory_identity(dir);
  if (std::find(identities.begin(), identities.end(), identity) != identities.end()) return;
  identities.push_back(std::move(identity));
  dirs.push_back(dir);
}

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : separator) + parts[i];
  return out;
}

std::string dir_list(const std::vector<fs::path>& dirs) {
  std::vector<std::string> names;
  for (const fs::path& d : dirs) names.push_back(d.string());
  return names.empty() ? std::string("no directories") : join(names, ", ");
}

// A plugin's message can be a whole kernel build log; a notice gets its first line.
std::string first_line(const std::string& text) {
  const size_t start = text.find_first_not_of(" \t\r\n");
  if (start == std::string::npos) return "no reason given";
  const size_t end = text.find_first_of("\r\n", start);
  if (end == std::string::npos) return text.substr(start);
  const bool more = text.find_first_not_of(" \t\r\n", end) != std::string::npos;
  return text.substr(start, end - start) + (more ? " [...]" : "");
}

std::string or_no_reason(std::string text) { return text.empty() ? std::string("no reason given") : text; }

std::string device_type_name(uint32_t type) {
  switch (type) {
    case RINGLM_DEVICE_CPU: return "CPU";
    case RINGLM_DEVICE_GPU: return "GPU";
    case RINGLM_DEVICE_ACCELERATOR: return "accelerator";
    default: return "other";
  }
}

bool is_gpu_like(const ringlm_device_info& info) {
  return info.type == RINGLM_DEVICE_GPU || info.type == RINGLM_DEVICE_ACCELERATOR;
}

std::string device_count_text(size_t n) {
  return std::to_string(n) + (n == 1 ? " device" : " devices");
}

// "0", "0-1": the indices --device accepts.
std::string index_range(size_t n) { return n == 1 ? std::string("0") : std::string("0-") + std::to_string(n - 1); }

std::shared_ptr<LoadedPlugin> find_plugin(const PluginScan& scan, const std::string& name) {
  for (const auto& plugin : scan.loaded) {
    if (plugin->name() == name) return plugin;
  }
  return nullptr;
}

// "no plugin named 'x'" with everything the search found, so that the user sees at once whether
// the file was missing, misnamed, or present but unloadable.
std::string no_such_plugin_message(const std::string& name, const std::vector<fs::path>& dirs, const PluginScan& scan) {
  std::string message = std::string("no plugin named '") + name + "' in " + dir_list(dirs);
  if (scan.loaded.empty() && scan.failed.empty()) {
    return message + " (no plugin files there; a plugin is a file named libringlm-<name>.so)";
  }
  for (const auto& plugin : scan.loaded) {
    message += std::string("\n  found: ") + plugin->name() + " (" + plugin->path().string() + ")";
  }
  for (const auto& failure : scan.failed) {
    message += std::string("\n  could not load: ") + failure.path.string() + ": " + failure.reason;
  }
  return message;
}

ringlm_open_options open_options(const fs::path& cache_dir, const std::string& cache_dir_text) {
  ringlm_open_options options{};
  options.struct_size = sizeof(options);
  options.cache_dir = cache_dir.empty() ? nullptr : cache_dir_text.c_str();
  options.verbose = 0;
  return options;
}

// Opens device `index` (described by `info`) of `plugin`; nullptr with the plugin's reason in
// `error` when its open fails.
std::unique_ptr<OpenedDevice> try_open(const std::shared_ptr<LoadedPlugin>& plugin, int index,
                                       const ringlm_device_info& info, const fs::path& cache_dir, std::string& error) {
  const std::string cache_dir_text = cache_dir.string();
  const ringlm_open_options options = open_options(cache_dir, cache_dir_text);
  ringlm_context* context = plugin->api().open(index, &options);
  if (context == nullptr) {
    error = or_no_reason(plugin->last_error());
    return nullptr;
  }
  auto device = std::make_unique<OpenedDevice>();
  device->plugin = plugin;
  device->context = context;
  device->index = index;
  device->info = info;
  return device;
}

// The label --device would use for a device: "opencl:0".
std::string device_label(const LoadedPlugin& plugin, int index) { return plugin.name() + ":" + std::to_string(index); }

// One plugin's part of open_auto_device's reason: what it has instead of a GPU.
std::string non_gpu_summary(const LoadedPlugin& plugin, const std::vector<ringlm_device_info>& devices) {
  if (devices.empty()) return plugin.name() + ": no devices";
  std::vector<std::string> parts;
  for (const ringlm_device_info& info : devices) parts.push_back(device_type_name(info.type) + " device " + info.name);
  return plugin.name() + ": " + join(parts, ", ");
}

}  // namespace

LoadedPlugin::~LoadedPlugin() { dlclose(handle_); }

std::vector<ringlm_device_info> LoadedPlugin::devices() const {
  const int32_t count = api_->device_count();
  if (count < 0) {
    throw PluginError(path_.string() + ": " + name() + " cannot list its devices: " + or_no_reason(last_error()));
  }
  std::vector<ringlm_device_info> devices(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) {
    ringlm_device_info& info = devices[static_cast<size_t>(i)];
    if (api_->device_info(i, &info) != RINGLM_OK) {
      throw PluginError(path_.string() + ": " + name() + " cannot describe device " + std::to_string(i) + ": " +
                        or_no_reason(last_error()));
    }
    // A C plugin may fill the whole array: never read past it.
    info.name[sizeof(info.name) - 1] = '\0';
    info.version[sizeof(info.version) - 1] = '\0';
  }
  return devices;
}

std::string LoadedPlugin::last_error(const ringlm_context* ctx) const {
  const char* text = api_->last_error(ctx);
  return text != nullptr ? text : "";
}

std::shared_ptr<LoadedPlugin> load_plugin(const fs::path& library) {
  std::error_code ec;
  if (!fs::exists(library, ec)) throw PluginLoadError(library, "plugin library not found");
  // An absolute path: dlopen would search the system's library path for a bare file name.
  const std::string absolute = fs::absolute(library, ec).string();
  LibraryHandle handle(dlopen(absolute.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (handle == nullptr) {
    throw PluginLoadError(library, std::string("cannot load: ") + without_path_prefix(dlerror_text(), absolute));
  }
  // A function's address is never NULL, so NULL means the symbol is absent (no dlerror needed).
  void* symbol = dlsym(handle.get(), RINGLM_PLUGIN_ENTRY);
  if (symbol == nullptr) {
    throw PluginLoadError(library,
                          std::string("entry symbol '") + RINGLM_PLUGIN_ENTRY + "' missing (not a ringlm plugin?)");
  }
  const auto entry = reinterpret_cast<ringlm_plugin_entry_fn>(symbol);
  const ringlm_plugin* api = entry();
  check_table(api, library);
  return std::shared_ptr<LoadedPlugin>(new LoadedPlugin(handle.release(), api, library));
}

std::vector<fs::path> plugin_search_dirs(const std::string& plugin_dir) {
  std::vector<fs::path> dirs, identities;
  if (!plugin_dir.empty()) add_unique_dir(dirs, identities, plugin_dir);
  if (const char* env = std::getenv("RINGLM_PLUGIN_PATH"); env != nullptr) {
    std::string_view rest = env;
    while (!rest.empty()) {
      const size_t colon = rest.find(':');
      const std::string_view entry = rest.substr(0, colon);
      if (!entry.empty()) add_unique_dir(dirs, identities, fs::path(entry));
      rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    }
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    add_unique_dir(dirs, identities, exe.parent_path());
    const fs::path installed = exe.parent_path() / RINGLM_INSTALLED_PLUGIN_DIR;
    if (fs::is_directory(installed, ec)) add_unique_dir(dirs, identities, installed);
  }
  return dirs;
}

PluginScan scan_plugins(const std::vector<fs::path>& dirs) {
  PluginScan scan;
  for (const fs::path& dir : dirs) {
    for (const fs::path& file : plugin_files_in(dir, scan.failed)) {
      std::shared_ptr<LoadedPlugin> plugin;
      try {
        plugin = load_plugin(file);
      } catch (const PluginLoadError& e) {
        scan.failed.push_back({file, e.cause()});
        continue;
      }
      if (const auto first = find_plugin(scan, plugin->name())) {
        // Reported, not silently dropped: a shadowed build explains "my new plugin is not used".
        scan.failed.push_back(
            {file, std::string("ignored: plugin '") + plugin->name() + "' already loaded from " + first->path().string()});
        continue;
      }
      scan.loaded.push_back(std::move(plugin));
    }
  }
  return scan;
}

DeviceSpec parse_device_spec(const std::string& value) {
  const auto invalid = [&value] {
    return std::invalid_argument(std::string("invalid device '") + value +
                                 "': expected cpu, auto, NAME or NAME:N (a plugin's name, N a device index: "
                                 "opencl, opencl:1)");
  };
  if (value == "cpu") return {DeviceSpec::Kind::kCpu, "", 0};
  if (value == "auto") return {DeviceSpec::Kind::kAuto, "", 0};
  const size_t colon = value.find(':');
  const std::string name = value.substr(0, colon);
  const bool name_ok = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
  // "cpu:0" and "auto:1" are typos for a plugin device, not a plugin called "cpu".
  if (!name_ok || name == "cpu" || name == "auto") throw invalid();
  DeviceSpec spec{DeviceSpec::Kind::kPlugin, name, 0};
  if (colon == std::string::npos) return spec;
  const std::string_view digits = std::string_view(value).substr(colon + 1);
  const bool all_digits =
      !digits.empty() && std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!all_digits) throw invalid();
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), spec.index);
  if (error != std::errc() || end != digits.data() + digits.size()) throw invalid();
  return spec;
}

OpenedDevice::~OpenedDevice() {
  if (context != nullptr && plugin != nullptr) plugin->api().close(context);
}

std::unique_ptr<OpenedDevice> open_plugin_device(const DeviceSpec& spec, const std::vector<fs::path>& dirs,
                                                 const fs::path& cache_dir) {
  if (spec.kind != DeviceSpec::Kind::kPlugin) {
    throw std::invalid_argument("open_plugin_device: the spec names no plugin");
  }
  const PluginScan scan = scan_plugins(dirs);
  const std::shared_ptr<LoadedPlugin> plugin = find_plugin(scan, spec.plugin);
  if (plugin == nullptr) throw PluginError(no_such_plugin_message(spec.plugin, dirs, scan));
  const std::vector<ringlm_device_info> devices = plugin->devices();
  const std::string where = plugin->path().string() + ": ";
  if (devices.empty()) throw PluginError(where + plugin->name() + " has no devices");
  if (spec.index < 0 || static_cast<size_t>(spec.index) >= devices.size()) {
    throw PluginError(where + plugin->name() + " has " + device_count_text(devices.size()) + " (" +
                      index_range(devices.size()) + "); asked for " + std::to_string(spec.index));
  }
  const ringlm_device_info& info = devices[static_cast<size_t>(spec.index)];
  std::string error;
  auto device = try_open(plugin, spec.index, info, cache_dir, error);
  if (device == nullptr) {
    throw PluginError(where + "cannot open " + device_label(*plugin, spec.index) + " (" + info.name + "): " + error);
  }
  return device;
}

std::unique_ptr<OpenedDevice> open_auto_device(const std::vector<fs::path>& dirs, const fs::path& cache_dir,
                                               std::string& why) {
  const PluginScan scan = scan_plugins(dirs);
  std::vector<std::string> reasons;
  bool saw_gpu = false;
  for (const auto& plugin : scan.loaded) {
    std::vector<ringlm_device_info> devices;
    try {
      devices = plugin->devices();
    } catch (const PluginError&) {
      reasons.push_back(plugin->name() + ": cannot list devices: " + first_line(or_no_reason(plugin->last_error())));
      continue;
    }
    bool plugin_has_gpu = false;
    for (size_t i = 0; i < devices.size(); ++i) {
      if (!is_gpu_like(devices[i])) continue;
      saw_gpu = plugin_has_gpu = true;
      std::string error;
      if (auto device = try_open(plugin, static_cast<int>(i), devices[i], cache_dir, error)) {
        why.clear();
        return device;
      }
      reasons.push_back(device_label(*plugin, static_cast<int>(i)) + " (" + devices[i].name + ") failed to open: " +
                        first_line(error));
    }
    if (!plugin_has_gpu) reasons.push_back(non_gpu_summary(*plugin, devices));
  }
  for (const auto& failure : scan.failed) {
    reasons.push_back(failure.path.filename().string() + " did not load: " + first_line(failure.reason));
  }
  if (reasons.empty()) reasons.push_back(std::string("no plugins in ") + dir_list(dirs));
  why = std::string(saw_gpu ? "no GPU could be opened" : "no GPU found") + " (" + join(reasons, "; ") +
        "); running on the CPU";
  return nullptr;
}

}  // namespace ringlm
