// How much of the real model's work a test does in this build. The sanitizer build (scripts/
// test.sh's second one) runs the model about 7x slower: there the end-to-end tests keep every
// assertion but run shorter inputs, and the tests that repeat a model-level check on every SIMD
// target run it on the best one (the kernels themselves are checked on every target in both
// builds: test_cpu_packed, test_attention, test_activation). The Release build keeps the long
// inputs and every target: it checks numbers, the sanitizers check memory.
#pragma once

#include <cstdint>
#include <vector>

#include "hwy/targets.h"

namespace ringlm::test {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif

// `release` in the Release build, `sanitized` in the sanitizer build: the size of an input.
constexpr int scaled(int release, int sanitized) { return kSanitizedBuild ? sanitized : release; }

// The SIMD targets a model-level check runs on: every one this machine runs (best first), or in
// the sanitizer build the best one.
inline std::vector<int64_t> model_test_targets() {
  std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  if (kSanitizedBuild && targets.size() > 1) targets.resize(1);
  return targets;
}

}  // namespace ringlm::test
