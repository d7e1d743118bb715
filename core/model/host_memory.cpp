#include "core/model/host_memory.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace ringlm {

namespace {

std::string gib(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace

HostMemory host_memory() {
  HostMemory m;
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream fields(line);
    std::string key;
    size_t kib = 0;
    if (!(fields >> key >> kib)) continue;
    if (key == "MemTotal:") m.total = kib * 1024;
    if (key == "MemAvailable:") m.available = kib * 1024;
  }
  return m;
}

void check_weights_fit(size_t weight_bytes, const HostMemory& memory) {
  if (memory.available == 0 || weight_bytes <= memory.available) return;
  throw std::runtime_error("the model's weights take " + gib(weight_bytes) + " in memory, but this machine has " +
                           gib(memory.available) + " available (" + gib(memory.total) +
                           " in all): close other programs, or use a smaller quantization of the model");
}

}  // namespace ringlm
