#!/usr/bin/env bash
# Idempotent set-up of everything hvd_partialfc needs, on a fresh Debian machine or a CI clone.
#
#   bash scripts/setup/install.sh               # both engines: Debian Open MPI + cmake (for the Horovod build),
#                                               # .venv, torch, deps, Horovod (built once, cached), the package
#                                               # (editable)
#   bash scripts/setup/install.sh --no-horovod  # the torch.distributed engine only (torchrun): .venv, torch, deps,
#                                               # the package (editable); no Open MPI/cmake packages, no Horovod
#                                               # build. The torch engine needs no Horovod. An already installed
#                                               # Horovod is left in place.
#   bash scripts/setup/install.sh --fonts       # also the Debian CJK font packages used by the `fonts` data set
#                                               # (combines with --no-horovod)
#   bash scripts/setup/install.sh --test-fonts  # also the four small font packages the suite's font tests render
#                                               # with (make test passes it: the demo's data path is tested in CI)
#
# The venv is $HVD_PARTIALFC_VENV (default .venv in the repository root, the Makefile's VENV).
#
# Why Horovod is built by hand: Horovod 0.28.1 (its last release) sets CMAKE_CXX_STANDARD 14 in its root and
# horovod/torch CMakeLists.txt, torch >= 2.1 headers need C++17, and gcc >= 13 needs includes that upstream
# added after the release. scripts/setup/build_horovod.sh fetches the sdist, patches it and builds the wheel
# (about 5 minutes on 2 cores). The wheel is kept in a cache folder outside the repository ($HVD_PARTIALFC_CACHE,
# default ~/.cache/hvd_partialfc), so a fresh clone installs it in seconds.
#
# GPUs (docs/gpu.md, "Building Horovod for GPUs"): when torch has CUDA and a CUDA toolkit of the same major
# version is found (CUDA_HOME, HOROVOD_CUDA_HOME or nvcc on PATH), or HOROVOD_GPU_OPERATIONS=NCCL is set, the
# build has NCCL, and an installed Horovod without it is rebuilt. HVD_PARTIALFC_HOROVOD_CPU_ONLY=1 builds
# without. Every HOROVOD_* variable passes through to the build (HOROVOD_NCCL_HOME, HOROVOD_BUILD_CUDA_CC_LIST,
# ...). The cached wheel's name carries a hash of those variables, of torch's CUDA version, the GPU operations
# and the compute capabilities, so a CPU wheel is never reused for a GPU build, nor one GPU's for another.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${HVD_PARTIALFC_VENV:-$ROOT/.venv}"
CACHE="${HVD_PARTIALFC_CACHE:-$HOME/.cache/hvd_partialfc}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"
WITH_FONTS=0
WITH_TEST_FONTS=0
WITH_HOROVOD=1
for arg in "$@"; do
  case "$arg" in
    --fonts) WITH_FONTS=1 ;;
    --test-fonts) WITH_TEST_FONTS=1 ;;
    --no-horovod) WITH_HOROVOD=0 ;;
    *) echo "install.sh: unknown option $arg (known: --fonts, --test-fonts, --no-horovod)" >&2; exit 2 ;;
  esac
done

log() { echo "[install] $*"; }
SUDO=""; if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

# Font packages of the `fonts` data set (docs/data.md names them): many CJK families and styles. Every name
# was checked with `apt-cache policy` on Debian 12 (bookworm); fonts-moe-standard-{kai,song}, fonts-wqy-bitmap
# and fonts-jigmo are not in bookworm and were dropped. Fonts without a glyph for a character are skipped
# per character by the importer (cmap check), so a non-CJK-complete package only adds what it has.
FONT_PACKAGES="fontconfig fonts-wqy-zenhei fonts-wqy-microhei fonts-arphic-ukai fonts-arphic-uming \
fonts-arphic-bkai00mp fonts-arphic-bsmi00lp fonts-arphic-gbsn00lp fonts-arphic-gkai00mp \
fonts-noto-cjk fonts-noto-cjk-extra fonts-lxgw-wenkai fonts-ipafont-gothic fonts-ipafont-mincho \
fonts-ipaexfont-gothic fonts-ipaexfont-mincho fonts-takao-gothic fonts-takao-mincho fonts-vlgothic \
fonts-horai-umefont fonts-umeplus fonts-komatuna fonts-hanazono fonts-mona fonts-motoya-l-cedar \
fonts-motoya-l-maruberi fonts-seto fonts-misaki fonts-droid-fallback fonts-cwtex-fs fonts-cwtex-heib \
fonts-cwtex-kai fonts-cwtex-ming fonts-cwtex-yen fonts-ukij-uyghur fonts-smiley-sans fonts-ipamj-mincho \
fonts-klee fonts-kouzan-mouhitsu fonts-nanum"
# What tests/test_data_tools.py and tests/test_fonts_cjk.py render with (about 30 MB; seconds to install).
TEST_FONT_PACKAGES="fontconfig fonts-wqy-zenhei fonts-wqy-microhei fonts-droid-fallback fonts-vlgothic fonts-arphic-gbsn00lp"

apt_install() {
  # Install only what is missing; `apt-get update` once, only when something is missing.
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  # Packages absent from this Debian release are skipped one by one rather than failing the whole set.
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    for p in "${missing[@]}"; do
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$p" >/dev/null 2>&1 \
        || log "skipped unavailable package $p"
    done
  fi
}

if command -v apt-get >/dev/null; then
  # Open MPI and cmake serve only Horovod: its build (cmake, mpicc) and its MPI controller (mpirun).
  if [ "$WITH_HOROVOD" = 1 ]; then apt_install openmpi-bin libopenmpi-dev cmake; fi
  if [ "$WITH_FONTS" = 1 ]; then apt_install $FONT_PACKAGES; fi
  if [ "$WITH_TEST_FONTS" = 1 ]; then apt_install $TEST_FONT_PACKAGES; fi
elif [ "$WITH_HOROVOD" = 1 ]; then
  log "no apt-get: install MPI (optional), cmake >= 3.13 and the fonts yourself"
else
  log "no apt-get: install the fonts yourself"
fi

# --- venv and Python packages -------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"
# Each group below is checked on its own; whatever is missing is installed by ONE pip call at the end of
# this section (one resolve and one pip start-up instead of four).
PIP_PKGS=()
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  PIP_PKGS+=("torch==$TORCH_VERSION")
fi
if ! "$PY" -c "import numpy, h5py, PIL, tqdm, yaml, pytest, fontTools, matplotlib, cloudpickle, psutil" 2>/dev/null; then
  # cloudpickle and psutil are horovodrun's own run-time needs; we list them so the Horovod wheel
  # can be installed without touching the index again (--no-deps below).
  PIP_PKGS+=(numpy h5py Pillow tqdm PyYAML pytest pytest-timeout fonttools matplotlib \
    cloudpickle psutil pyyaml packaging)
fi
# pytest-xdist: make test runs the single-process tests on both cores (-n 2); the multi-rank ones after,
# alone, as their ranks need the cores. Pinned with its one dependency.
if ! "$PY" -c "import xdist, sys; sys.exit(xdist.__version__ != '3.8.0')" 2>/dev/null; then
  PIP_PKGS+=("pytest-xdist==3.8.0" "execnet==2.1.2")
fi

# ONNX export (`hvd-partialfc export --onnx`, docs/faces.md) and its tests: torch's exporter needs onnx and
# onnxscript, the check runs onnxruntime. Their new dependencies are pinned too (the set `pip install
# --dry-run` resolved against torch 2.13's venv); sympy, numpy, packaging come with torch.
ONNX_PACKAGES="onnx==1.23.1 onnxscript==0.7.2 onnx-ir==1.1.0 onnxruntime==1.30.0 protobuf==7.36.2 \
ml_dtypes==0.6.0 flatbuffers==25.12.19"
if ! "$PY" -c "import onnx, onnxscript, onnxruntime, sys; sys.exit((onnx.__version__, onnxruntime.__version__, onnxscript.__version__) != ('1.23.1', '1.30.0', '0.7.2'))" 2>/dev/null; then
  PIP_PKGS+=($ONNX_PACKAGES)
fi

# TensorBoard (train.tensorboard; also the extra `hvd_partialfc[tensorboard]`): optional for users, installed
# here so its tests run. absl-py is the one dependency the event writer and reader import beyond ours.
TENSORBOARD_VERSION="2.21.0"
if ! "$PY" -c "import tensorboard, sys; sys.exit(tensorboard.__version__ != '$TENSORBOARD_VERSION')" 2>/dev/null; then
  PIP_PKGS+=("tensorboard==$TENSORBOARD_VERSION" "absl-py==2.5.1")
fi

# Byte-compiled at install (pip's default), on purpose: with PYTHONDONTWRITEBYTECODE=1 (set on this project's CI
# and dev machines) Python never writes a .pyc at import, so every launched rank compiled torch's modules again:
# about 2 s more per process start, and a fresh clone's `make test` went from 12 to 22.5 minutes.
if [ ${#PIP_PKGS[@]} -gt 0 ]; then
  log "pip install ${PIP_PKGS[*]}"
  $PIP install "${PIP_PKGS[@]}"
fi

# torchvision (data.decode=gpu: its decode_jpeg runs nvJPEG; also the extra `hvd_partialfc[torchvision]`): 0.28.0
# is the release built against torch 2.13.0. Installed only beside a CUDA torch: PyPI's Linux torchvision wheels
# are CUDA builds, which fail at import against a +cpu torch ("operator torchvision::nms does not exist"), and
# the CPU path needs none. --no-deps: its exact torch pin must never replace the torch installed above.
TORCHVISION_VERSION="0.28.0"
if ! "$PY" -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  log "CPU torch: no torchvision (data.decode=gpu needs a CUDA torch; data.decode=cpu needs none)"
elif ! "$PY" -c "import torchvision, sys; sys.exit(torchvision.__version__.split('+')[0] != '$TORCHVISION_VERSION')" 2>/dev/null; then
  log "pip install torchvision==$TORCHVISION_VERSION"
  $PIP install --no-deps "torchvision==$TORCHVISION_VERSION"
fi

# --- Horovod (skipped with --no-horovod) -----------------------------------------------------------
# The build itself is scripts/setup/build_horovod.sh (the one recipe, also the GPU check's);
# scripts/setup/horovod_build_env.py decides its GPU operations, and reads `horovodrun --check-build` for the
# check below.
HAVE_MPI=0; command -v mpicc >/dev/null && HAVE_MPI=1
HVD_ENV="$ROOT/scripts/setup/horovod_build_env.py"

horovod_ok() {
  # True when the installed Horovod has PyTorch + Gloo (+ MPI when mpicc exists, + NCCL when a build here
  # would have it: HOROVOD_GPU_OPERATIONS=NCCL, or torch with CUDA and a CUDA toolkit found).
  local out flags=()
  out="$("$VENV/bin/horovodrun" --check-build 2>/dev/null)" || return 1
  [ "$HAVE_MPI" = 1 ] && flags+=(--mpi)
  [ "$GPU_OPS" = NCCL ] && flags+=(--nccl)
  echo "$out" | "$PY" "$HVD_ENV" check-build "${flags[@]}" || return 1
  "$PY" -c "import horovod.torch" 2>/dev/null || return 1
}

if [ "$WITH_HOROVOD" = 0 ]; then
  log "--no-horovod: Horovod not built (the torch.distributed engine, torchrun, needs none)"
else
  GPU_OPS="$("$PY" "$HVD_ENV" gpu-ops)"     # NCCL | none (exits with its one-line reason if asked for both)
  HVD_WHAT="PyTorch/Gloo"
  if [ "$HAVE_MPI" = 1 ]; then HVD_WHAT+="/MPI"; fi
  if [ "$GPU_OPS" = NCCL ]; then HVD_WHAT+="/NCCL"; fi
  if horovod_ok; then
    log "Horovod $HOROVOD_VERSION already built with $HVD_WHAT"
  else
    # The wheel's cache key: torch version, Python, MPI or not, torch's CUDA with the GPU operations and
    # compute capabilities (nothing for a CPU torch built without them, so the CPU key is unchanged), and every
    # HOROVOD_* build variable.
    GPU_KEY="$("$PY" "$HVD_ENV" key)"
    KEY="$( { echo "torch=$TORCH_VERSION mpi=$HAVE_MPI py=$("$PY" -c 'import sys;print(sys.version_info[:2])')"; \
              if [ -n "$GPU_KEY" ]; then echo "$GPU_KEY"; fi; \
              { env | grep '^HOROVOD_' || true; } | sort; } | sha256sum | cut -c1-12)"
    WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-$KEY"
    WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -1 || true)"
    if [ -z "$WHEEL" ]; then
      log "building Horovod $HOROVOD_VERSION with $HVD_WHAT from source (about 5 minutes on 2 cores); cache: $WHEEL_DIR"
      WHEEL="$(bash "$ROOT/scripts/setup/build_horovod.sh" --python "$PY" --wheel-dir "$WHEEL_DIR" | tail -1)"
    else
      log "installing cached Horovod wheel $WHEEL"
    fi
    $PIP install --no-deps --force-reinstall "$WHEEL"
    horovod_ok || { echo "[install] Horovod installed but 'horovodrun --check-build' lacks some of $HVD_WHAT" >&2; exit 1; }
  fi
fi

# --- the package itself (editable), with its console scripts --------------------------------------
# Checked from / so that the repository folder itself is not on sys.path: the import must come from the
# editable install of *this* checkout, and the console scripts must exist.
if [ -f "$ROOT/setup.cfg" ] && ! { [ -x "$VENV/bin/hvd-partialfc" ] && [ -x "$VENV/bin/hvd-partialfc-shards" ] && \
    (cd / && "$PY" -c "import os, sys, hvd_partialfc, data_tools; sys.exit(os.path.dirname(os.path.dirname(os.path.abspath(hvd_partialfc.__file__))) != '$ROOT')") 2>/dev/null; }; then
  log "pip install -e ."
  $PIP install --no-deps --no-build-isolation -e "$ROOT"
fi
if [ "$WITH_HOROVOD" = 1 ]; then
  HVD_INFO="$("$VENV/bin/horovodrun" --version 2>/dev/null | tail -1 || true)"
elif [ -x "$VENV/bin/horovodrun" ]; then
  HVD_INFO="--no-horovod: the Horovod already there left as it is"
else
  HVD_INFO="no Horovod: torch engine only"
fi
log "ready: $VENV ($("$PY" -c 'import torch;print("torch", torch.__version__)'), $HVD_INFO)"
