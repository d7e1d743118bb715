#!/usr/bin/env bash
# Runs every test: the Release build's suites, then the same suites built with
# AddressSanitizer + UndefinedBehaviorSanitizer. Expects scripts/setup.sh to have run.
#
# Environment: BUILD_DIR (default build), ASAN_BUILD_DIR (default build-asan),
# RINGLM_SKIP_SANITIZERS=1 to run only the Release suites (local iteration).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
ASAN_BUILD_DIR="${ASAN_BUILD_DIR:-build-asan}"
jobs="$(nproc)"
# shellcheck source=scripts/phases.sh
. scripts/phases.sh
# shellcheck source=scripts/build_config.sh
. scripts/build_config.sh
# Tests run side by side (ctest -j), each with its own OpenMP threads: threads that wait passively
# give the cores to the other test instead of spinning on them.
export OMP_WAIT_POLICY=PASSIVE

echo "== Release build: tests" >&2
phase "Release build"
configure_build "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$jobs"
phase "Release suite"
# Each suite leaves its per-test times in ctest-junit.xml (scripts/ci_report.py lists the slowest).
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$jobs" --output-junit "$PWD/$BUILD_DIR/ctest-junit.xml"
phase_end

if [ "${RINGLM_SKIP_SANITIZERS:-0}" != "1" ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build: tests" >&2
  phase "ASan+UBSan build"
  # -O1 -g1: half the compile time of -O2 -g under the sanitizers (33 s against 15 s for
  # attention.cpp), still line numbers in every report. The benches are not tests: Release builds them.
  configure_build "$ASAN_BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRINGLM_SANITIZE=ON \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DRINGLM_BUILD_BENCH=OFF
  cmake --build "$ASAN_BUILD_DIR" -j"$jobs"
  phase "ASan+UBSan suite"
  # LeakSanitizer ignores only what PoCL's in-process LLVM compiler leaves behind (tests/lsan_suppressions.txt).
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    LSAN_OPTIONS="suppressions=$PWD/tests/lsan_suppressions.txt" \
    ctest --test-dir "$ASAN_BUILD_DIR" --output-on-failure -j"$jobs" --output-junit "$PWD/$ASAN_BUILD_DIR/ctest-junit.xml"
  phase_end
fi
