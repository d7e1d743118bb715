// Wall time for the timing lines the commands and the chat print (--stats, tune, the chat's
// per-turn figures): one clock and one unit for all of them.
#pragma once

#include <chrono>

namespace ringlm {

// Milliseconds of the steady clock since `start`.
inline double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace ringlm
