# Sourced by setup.sh and test.sh: how both configure a build directory.
#
#   configure_build DIR [CMAKE ARGS...]
#
# - Ninja as the generator: it compiles the objects of a target while the library that target
#   links is still being compiled (Make waits for the whole library), so the two cores stay busy
#   through the long kernel files.
# - ccache in front of the compilers, its cache under setup.sh's cache directory
#   ($RINGLM_CACHE_DIR/ccache): a second build on the same machine recompiles only what changed.
#   Paths under the checkout are hashed relative to it (CCACHE_BASEDIR, CCACHE_NOHASHDIR), so a
#   fresh clone in another directory still finds its objects.
# A build directory made by another generator (an older checkout's Make build) is configured
# afresh: CMake cannot change the generator of a build directory.

RINGLM_CACHE_DIR_RESOLVED="${RINGLM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ringlm}"
export CCACHE_DIR="${CCACHE_DIR:-$RINGLM_CACHE_DIR_RESOLVED/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-3G}"

configure_build() {
  local dir="$1"
  shift
  local args=()
  if command -v ninja >/dev/null; then
    args+=(-G Ninja)
    if [ -f "$dir/CMakeCache.txt" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$dir/CMakeCache.txt"; then
      echo "[build] $dir was configured with another generator: configuring it afresh for Ninja" >&2
      rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
    fi
  fi
  if command -v ccache >/dev/null; then
    args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  cmake -S . -B "$dir" "${args[@]}" "$@" >/dev/null
}
