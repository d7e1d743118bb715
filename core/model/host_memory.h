// Whether a model's weights fit in this machine's memory, asked before anything is packed: a
// model larger than RAM is refused with the numbers, not killed by the kernel halfway through
// loading.
#pragma once

#include <cstddef>

namespace ringlm {

struct HostMemory {
  size_t total = 0;      // MemTotal
  size_t available = 0;  // MemAvailable: free memory and the page cache the kernel can drop
};

// /proc/meminfo's figures (zeros where it cannot be read: nothing is then refused).
HostMemory host_memory();

// std::runtime_error naming the sizes when `weight_bytes` (the CPU's copy of the weights) exceed
// the memory available. The file's own cached pages count as available: the CPU backend gives
// them back as it packs.
void check_weights_fit(size_t weight_bytes, const HostMemory& memory);

}  // namespace ringlm
