#!/usr/bin/env bash
# Build the Horovod 0.28.1 wheel this project uses, against the torch of --python; the one recipe, used by
# scripts/setup/install.sh (which caches the wheel) and by the GPU check (scripts/gpu/gpu_check.sh).
#
#   bash scripts/setup/build_horovod.sh --python PY --wheel-dir DIR [--sdist FILE] [--cpu-only]
#
# The last line on stdout is the built wheel's path (everything else goes to stderr). Without --sdist the
# pinned sdist is downloaded with pip. Fails loudly (non-zero, one "error:" line) on anything unexpected.
#
# What it does, and why (docs/gpu.md, "Building Horovod for GPUs"):
# - GPU operations (NCCL) when HOROVOD_GPU_OPERATIONS=NCCL is set, or when torch has CUDA and a CUDA toolkit
#   (nvcc) is found; never with --cpu-only or HVD_PARTIALFC_HOROVOD_CPU_ONLY=1. The toolkit's major version
#   must be torch's; NCCL comes from HOROVOD_NCCL_*, else the pip package nvidia-nccl, else the system; the
#   kernels' compute capabilities from HOROVOD_BUILD_CUDA_CC_LIST, else the visible GPUs, else a default list.
#   scripts/setup/horovod_build_env.py decides all of this (and is what the tests exercise).
# - MPI when mpicc is found, else HOROVOD_WITHOUT_MPI (Gloo only).
# - Patches on the sdist, each checked after it is applied (and skipped when already there):
#   * C++14 -> 17 in the root and horovod/torch CMakeLists.txt: torch >= 2.1 headers need C++17 (upstream
#     did the same after 0.28.1, commit 3a31d933);
#   * CMAKE_CUDA_STANDARD 11 -> 17 in horovod/common/ops/cuda/CMakeLists.txt: the kernels get the host code's
#     standard (nvcc 13.0 compiled cuda_kernels.cu under both here; unused by CPU builds);
#   * the includes gcc >= 13 no longer brings in transitively: upstream commit ff4ca09d ("Fix build on
#     gcc 13: add missing headers", after 0.28.1: <stdexcept> in horovod/common/common.h, <string> in
#     horovod/common/group_table.h), and Gloo's later <cstdint> in gloo/types.h (pytorch/gloo 54cbae0).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOROVOD_VERSION="0.28.1"
PY="python3"; WHEEL_DIR=""; SDIST=""
CPU_ONLY="${HVD_PARTIALFC_HOROVOD_CPU_ONLY:-0}"

die() { echo "build_horovod: error: $*" >&2; exit 1; }
log() { echo "[build_horovod] $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="${2:?--python needs a value}"; shift 2 ;;
    --wheel-dir) WHEEL_DIR="${2:?--wheel-dir needs a value}"; shift 2 ;;
    --sdist) SDIST="${2:?--sdist needs a value}"; shift 2 ;;
    --cpu-only) CPU_ONLY=1; shift ;;
    *) die "unknown option $1 (known: --python PY --wheel-dir DIR [--sdist FILE] [--cpu-only])" ;;
  esac
done
[ -n "$WHEEL_DIR" ] || die "--wheel-dir is required"
[ -z "$SDIST" ] || [ -f "$SDIST" ] || die "--sdist $SDIST: no such file"
command -v cmake >/dev/null || die "cmake not found (Debian: apt-get install cmake; or pip install cmake)"
"$PY" -c "import torch" 2>/dev/null || die "$PY cannot import torch"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

HAVE_MPI=0; command -v mpicc >/dev/null && HAVE_MPI=1
ARGS=(env --link-dir "$WORK/nccl-lib")
[ "$HAVE_MPI" = 1 ] && ARGS+=(--mpi)
[ "$CPU_ONLY" != 0 ] && ARGS+=(--cpu-only)
BUILD_ENV="$("$PY" "$HERE/horovod_build_env.py" "${ARGS[@]}")" || die "see the error above"
eval "$BUILD_ENV"
# Horovod's cmake/build_utils.py runs the first `nvcc` on PATH before $HOROVOD_CUDA_HOME's: make them one.
if [ -n "${HOROVOD_CUDA_HOME:-}" ]; then export PATH="$HOROVOD_CUDA_HOME/bin:$PATH"; fi

if [ -z "$SDIST" ]; then
  "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    "horovod==$HOROVOD_VERSION" -d "$WORK" >&2
  SDIST="$WORK/horovod-$HOROVOD_VERSION.tar.gz"
fi
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$HOROVOD_VERSION"
[ -f "$SRC/setup.py" ] || die "$SDIST is not the Horovod $HOROVOD_VERSION sdist (no horovod-$HOROVOD_VERSION/setup.py)"

# replace FILE OLD NEW: sed OLD -> NEW, then NEW must be in FILE and OLD no longer.
replace() {
  sed -i "s/$2/$3/" "$SRC/$1"
  grep -q "$3" "$SRC/$1" && ! grep -q "$2" "$SRC/$1" || die "patch $1 ($2 -> $3) did not apply"
}
# add_include FILE ANCHOR HEADER: put '#include <HEADER>' on the line before '#include <ANCHOR>' (once).
add_include() {
  if ! grep -q "^#include <$3>" "$SRC/$1"; then
    sed -i "0,/^#include <$2>/s//#include <$3>\n#include <$2>/" "$SRC/$1"
  fi
  grep -q "^#include <$3>" "$SRC/$1" || die "patch $1 (#include <$3>) did not apply"
}
replace CMakeLists.txt "CMAKE_CXX_STANDARD 14" "CMAKE_CXX_STANDARD 17"
replace horovod/torch/CMakeLists.txt "CMAKE_CXX_STANDARD 14" "CMAKE_CXX_STANDARD 17"
replace horovod/common/ops/cuda/CMakeLists.txt "CMAKE_CUDA_STANDARD 11" "CMAKE_CUDA_STANDARD 17"
add_include horovod/common/common.h string stdexcept
add_include horovod/common/group_table.h unordered_map string
add_include third_party/gloo/gloo/types.h iostream cstdint

# Horovod's setup.py asks for cffi (setup_requires); with --no-build-isolation setuptools would fetch it from
# the network at build time, and an offline GPU node failed there (docs/evidence/gpu.md, 2026-12-04). Offline, install
# the cffi and pycparser wheels first (pip download on a machine with a network).
"$PY" -c "import setuptools, wheel, cffi" 2>/dev/null || "$PY" -m pip install -q wheel setuptools "cffi>=1.4.0" >&2 \
  || die "cannot install wheel, setuptools and cffi (Horovod's build needs them); offline, pip install their wheels first"
export MAKEFLAGS="-j$(nproc)"
log "building Horovod $HOROVOD_VERSION ($( [ "${HOROVOD_GPU_OPERATIONS:-}" = NCCL ] && echo "NCCL, CC ${HOROVOD_BUILD_CUDA_CC_LIST}" || echo "CPU")$( [ "$HAVE_MPI" = 1 ] && echo ", MPI" || echo ", no MPI")); ~5 minutes on 2 cores"
(cd "$SRC" && "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation -w "$WORK/wheel" . >&2) \
  || die "pip wheel failed (its output is above)"
BUILT=("$WORK"/wheel/horovod-*.whl)
[ "${#BUILT[@]}" = 1 ] && [ -f "${BUILT[0]}" ] || die "expected one wheel in $WORK/wheel, found: ${BUILT[*]}"
mkdir -p "$WHEEL_DIR"
cp "${BUILT[0]}" "$WHEEL_DIR/"
echo "$WHEEL_DIR/$(basename "${BUILT[0]}")"
