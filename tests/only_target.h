// Runs Highway-dispatched kernels with one SIMD target at a time, so that a test covers every
// target the machine can run, not only the best one; the real choice comes back at the end of
// the scope.
#pragma once

#include <cstdint>

#include "hwy/targets.h"

namespace ringlm::test {

class OnlyTarget {
 public:
  explicit OnlyTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~OnlyTarget() { hwy::SetSupportedTargetsForTest(0); }
  OnlyTarget(const OnlyTarget&) = delete;
  OnlyTarget& operator=(const OnlyTarget&) = delete;
};

}  // namespace ringlm::test
