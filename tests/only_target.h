// Runs Highway-dispatched kernels with one SIMD target at a time, so that a test covers every
// target the machine can run, not only the best one; the real choice comes back at the end of
// the scope.
#pragma once

#include <cstdint>
#include <vector>

#include "hwy/targets.h"

namespace ringlm::test {

// The targets the packed kernels (kernel_packed.cpp, quantize_acts.cpp) are built for that this
// CPU runs, best first: AVX-512 VNNI, AVX-512, AVX2 and the baseline. Not SSE4 and SSSE3, which
// those files leave out (a CPU without AVX2 runs their baseline copy, as forcing either would).
// Written out rather than hwy::SupportedAndGeneratedTargets(), which lists the targets of the
// calling file: in a test, no AVX3_DL unless that file asks for it too.
inline std::vector<int64_t> packed_kernel_targets() {
  std::vector<int64_t> out;
  for (const int64_t t : {int64_t{HWY_AVX3_DL}, int64_t{HWY_AVX3}, int64_t{HWY_AVX2}, int64_t{HWY_STATIC_TARGET}}) {
    if ((hwy::SupportedTargets() & t) != 0) out.push_back(t);
  }
  return out;
}

class OnlyTarget {
 public:
  explicit OnlyTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~OnlyTarget() { hwy::SetSupportedTargetsForTest(0); }
  OnlyTarget(const OnlyTarget&) = delete;
  OnlyTarget& operator=(const OnlyTarget&) = delete;
};

}  // namespace ringlm::test
