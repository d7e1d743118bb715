// The backend --device names: the CPU, a plugin's device, or (auto) the first GPU found.
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "backends/plugin_backend.h"

namespace ringlm {

std::unique_ptr<Backend> make_backend(const BackendChoice& choice, std::string& notice) {
  notice.clear();
  const DeviceSpec spec = parse_device_spec(choice.device);
  std::unique_ptr<Backend> cpu = make_cpu_backend(choice.n_threads, choice.compute);
  if (spec.kind == DeviceSpec::Kind::kCpu) return cpu;
  const std::vector<std::filesystem::path> dirs = plugin_search_dirs(choice.plugin_dir);
  if (spec.kind == DeviceSpec::Kind::kPlugin) {
    std::shared_ptr<OpenedDevice> device = open_plugin_device(spec, dirs, choice.cache_dir);
    return make_plugin_backend(std::move(device), std::move(cpu), choice.placement);
  }
  std::string why;
  std::shared_ptr<OpenedDevice> device = open_auto_device(dirs, choice.cache_dir, why);
  if (device == nullptr) {
    notice = "--device auto: " + why;
    return cpu;
  }
  try {
    return make_plugin_backend(std::move(device), std::move(cpu), choice.placement);
  } catch (const std::exception& e) {
    notice = std::string("--device auto: ") + e.what() + "; running on the CPU";
    return make_cpu_backend(choice.n_threads, choice.compute);
  }
}

}  // namespace ringlm
