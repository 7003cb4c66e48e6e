#!/usr/bin/env bash
# The GPU check: one machine with one NVIDIA GPU and no network (docs/gpu.md says what it needs and what
# its figures mean). Fails loudly: a stage that fails is named and the script exits non-zero. A measuring stage
# (prepare, torch, speed, horovod, report) that fails does not stop the stages after it, so the speed stage
# runs whatever the torch stage did; env and build end the script at once (nothing after them could run).
# One deadline for the whole script (GPU_CHECK_DEADLINE, seconds since the epoch; else 9 minutes from its
# start): every stage runs under a timeout of its own limit or what the deadline leaves, whichever is less.
#
#   OUT=results HOROVOD_SDIST=.dev/horovod-0.28.1.tar.gz [ARCFACE_DIR=DIR] bash scripts/gpu/gpu_check.sh
#   OUT=results GPU_CHECK_TINY=1 bash scripts/gpu/gpu_check.sh     # CPU: toy sizes, the installed Horovod (the dry run)
#   GPU_CHECK_SKIP=build,horovod ...                               # those stages left out: the speed stage gets their time
#   (env, torch and speed may be left out alike; prepare and report always run)
#
# Stages (each timed, in OUT/stages.tsv):
#   env       torch, CUDA, the GPU, nvcc, NCCL: what the build and the runs will use (OUT/env.txt)
#   prepare   two JPEG shard sets (125,000 and 1,000 classes) and the loader's sustained rate (cold queue);
#             data.decode=gpu against PIL and both decodes' rates (OUT/gpu_decode.json)
#   torch     the trainer under torchrun (torch.distributed + NCCL; needs no build): iresnet50, batch 128,
#             fp16 and bf16, a 125k-class local head against a 1k-class one, peak memory per precision
#   speed     the GPU speed table (scripts/gpu/gpu_speed_check.py): ours against arcface_torch (ARCFACE_DIR: an
#             InsightFace checkout; without it ours alone, said), the step profile, the fast-path keys on
#             and off, nvJPEG in the trainer, the largest batch; as many cells as fit SPEED_BUDGET_S
#             (default: what the deadline leaves after the stages still to come), the rest named
#             with the command that runs them (OUT/speed.json, OUT/speed_table.md, OUT/speed/)
#   build     Horovod from its sdist with NCCL (scripts/setup/build_horovod.sh); horovod.torch.nccl_built() must
#             be non-zero; the GPU smoke tests (pytest -m gpu, torch engine) run beside it
#   horovod   the same trainer runs under horovodrun -np 1, and the smoke tests that need Horovod
#   report    OUT/face_check.json and face_check.txt; exit 1 when a run is missing or looks wrong
# One GPU: NCCL refuses two ranks on one device, so np = 1; the engines' collectives still run through NCCL
# at size 1 (the smoke tests check them on CUDA tensors). Everything goes to mktemp -d folders. With
# GPU_PUBLISH_FROM and GPU_PUBLISH_TO set (gpu_speed_run.sh), the results are copied into the GPU call's
# $OUT at every stage's start and after every speed cell (scripts/gpu/publish.py).
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
TINY="${GPU_CHECK_TINY:-0}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
STAGE=start
FAILED=""
trap 'echo "gpu_check: FAILED in stage $STAGE (exit $?)${FAILED:+, after$FAILED}; its output is above and in $OUT" >&2' ERR
T0=$(date +%s); TS=$T0
DEADLINE="${GPU_CHECK_DEADLINE:-$((T0 + 540))}"
publish() { [ -z "${GPU_PUBLISH_TO:-}" ] || "$PY" -m scripts.gpu.publish "$GPU_PUBLISH_FROM" "$GPU_PUBLISH_TO" || true; }
stage() {   # stage NAME: close the previous stage's timing, open NAME's, and bring the call's $OUT up to date
  local now; now=$(date +%s)
  [ "$STAGE" = start ] || printf '%s\t%s\n' "$STAGE" "$((now - TS))" >> "$OUT/stages.tsv"
  STAGE="$1"; TS=$now
  echo "=== $1 ($((now - T0)) s, $((DEADLINE - now)) s to the deadline)"
  publish
}
failed() {  # failed NAME STATUS: named now and at the end; the stages after it still run
  FAILED="$FAILED $1"
  echo "gpu_check: stage $1 failed (exit $2$( [ "$2" = 124 ] || [ "$2" = 137 ] && echo ': cut at its limit')); the stages after it still run" >&2
}
limit() {   # limit SECONDS [RESERVE]: a stage's own limit, or what the deadline leaves after RESERVE s, if less
  local left=$(( DEADLINE - $(date +%s) - ${2:-0} ))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -ge 1 ] || left=1
  echo "$left"
}
capped() { local s=$1; shift; timeout -k 5 "$s" "$@"; }   # capped SECONDS COMMAND...
TINY_ARG=(); [ "$TINY" = 1 ] && TINY_ARG=(--tiny)
# The dry run's ops are tiny: torch's idle OpenMP thread spun between them (libgomp's active wait), 2.5 of a
# rank's 9 CPU-seconds on a busy 2-core machine; passive, it sleeps at once (0.4). Not on the GPU.
[ "$TINY" = 1 ] && export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
SKIP=",${GPU_CHECK_SKIP:-},"
# Two probes run as `python -c`: what torch sees (env) and what Horovod's build holds (build; `horovodrun
# --check-build` says the same, but first probes every framework: 9 s). The dry run starts no process for them
# (each would import torch again: 2 CPU-s); its test runs both in its own (tests/test_gpu_check.py).
ENV_PROBE="import torch, torch.distributed as d; n = torch.cuda.device_count(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', n, [torch.cuda.get_device_name(i) for i in range(n)]); print('torch.distributed: nccl', d.is_nccl_available(), 'gloo', d.is_gloo_available())"
BUILD_PROBE="import horovod, horovod.torch as h; print('horovod', horovod.__version__, 'nccl', h.nccl_built(), 'gloo', h.gloo_built(), 'mpi', h.mpi_built())"
skipped() { case "$SKIP" in *",$1,"*) echo "=== $1 skipped (GPU_CHECK_SKIP)"; return 0;; esac; return 1; }
# what the stages after speed need: the report (10 s), and the build and Horovod's stage where they run (230 s
# measured, 113 + 82 + 2, with margin)
AFTER=10; skipped build >/dev/null || AFTER=240
: > "$OUT/stages.tsv"

if ! skipped env; then
stage env
{
  if [ "$TINY" != 1 ]; then capped "$(limit 120)" "$PY" -c "$ENV_PROBE"; fi
  if [ "$TINY" != 1 ]; then nvidia-smi -L; command -v nvcc >/dev/null && nvcc --version | tail -2; fi
  nproc
} 2>&1 | tee "$OUT/env.txt"
if [ "$TINY" != 1 ]; then
  capped "$(limit 60)" "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
    || { echo "no CUDA device visible" >&2; false; }
fi
fi

stage prepare
capped "$(limit 240 "$AFTER")" "$PY" -m scripts.gpu.gpu_face_check prepare "$WORK" "${TINY_ARG[@]}" || failed prepare $?

if [ "$TINY" != 1 ]; then   # data.decode=gpu: nvJPEG's distance to PIL, and the loader's rate with either decode
  capped "$(limit 120 "$AFTER")" "$PY" -m data_tools.bench_loader --gpu-decode "$OUT" \
    --workers "$(( $(nproc) > 10 ? 8 : 1 ))" --seconds 5 --device cuda || failed prepare-decode $?
fi

ENGINES=""      # the engines whose stage ran, for the report
if ! skipped torch; then
ENGINES=torch
stage torch
{ capped "$(limit 240 "$AFTER")" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m scripts.gpu.gpu_face_check measure "$WORK" --engine torch "${TINY_ARG[@]}" 2>&1 \
    | tr '\r' '\n' | sed '/it\/s\]$/d' | tee "$OUT/torch.log"; } || failed torch $?
fi

if ! skipped speed; then
stage speed
# Until the deadline less what the stages after it need; its cells start while their estimates fit and each
# is cut at its own limit (gpu_speed_check.py), the stage itself at its end (5 s after the cells' deadline)
SPEED_END=$(( DEADLINE - AFTER ))
BUDGET="${SPEED_BUDGET_S:-$(( SPEED_END - 5 - $(date +%s) ))}"
speed_rc=0
{ capped "$(limit 100000 "$AFTER")" "$PY" -m scripts.gpu.gpu_speed_check "$WORK" "$OUT" --budget "$BUDGET" \
    --deadline "$(( SPEED_END - 5 ))" ${ARCFACE_DIR:+--arcface-dir "$ARCFACE_DIR"} "${TINY_ARG[@]}" 2>&1 \
    | tee "$OUT/speed.log"; } || speed_rc=$?
case "$speed_rc" in
  0) ;;
  124|137) echo "speed: cut at the deadline; OUT/speed.json holds the cells that finished" ;;
  *) failed speed "$speed_rc" ;;
esac
fi

if ! skipped build; then
stage build
if [ "$TINY" = 1 ]; then
  # The installed (CPU) Horovod: nothing to build, and BUILD_PROBE is its test's. GPU_CHECK_HOROVODRUN: the
  # launcher the dry run's test hands it, horovodrun with its build pre-check answered (tests/mr/horovodrun.py).
  HOROVODRUN="${GPU_CHECK_HOROVODRUN:-$(command -v horovodrun)}"
  echo "build: the installed Horovod (the dry run)"
else
  : "${HOROVOD_SDIST:?set HOROVOD_SDIST to horovod-0.28.1.tar.gz (pip download --no-deps --no-binary :all: horovod==0.28.1)}"
  # The smoke tests that need no Horovod run on the GPU while Horovod compiles on the CPUs.
  capped "$(limit 300 10)" env HVD_PARTIALFC_TEST_GPU=1 "$PY" -m pytest -q -m gpu -k "not horovod" tests \
    -p no:cacheprovider > "$OUT/smoke_torch.log" 2>&1 & SMOKE=$!
  WHEEL="$(capped "$(limit 300 100)" bash scripts/setup/build_horovod.sh --python "$PY" --wheel-dir "$WORK/wheel" \
           --sdist "$HOROVOD_SDIST" 2> "$OUT/build.log" | tail -1)" || { tail -40 "$OUT/build.log" >&2; false; }
  "$PY" -m pip install -q --no-deps --no-compile --target "$WORK/hvd" "$WHEEL"
  export PYTHONPATH="$PYTHONPATH:$WORK/hvd" PATH="$WORK/hvd/bin:$PATH"
  # Horovod's NCCL operations load libnccl.so.2 at run time: the pip package's, where torch has it from
  NCCL_LIB="$("$PY" -c "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null || true)"
  [ -z "$NCCL_LIB" ] || export LD_LIBRARY_PATH="$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  HOROVODRUN="$WORK/hvd/bin/horovodrun"
  wait "$SMOKE" || { tail -30 "$OUT/smoke_torch.log" >&2; failed smoke-torch 1; }
  tail -3 "$OUT/smoke_torch.log"
  "$PY" -c "$BUILD_PROBE" | tee "$OUT/horovod_build.txt"     # what the build holds
  grep -Eq "nccl ([1-9]|True)" "$OUT/horovod_build.txt" || { echo "Horovod built without NCCL" >&2; false; }
fi
fi

if ! skipped horovod; then
ENGINES="${ENGINES:+$ENGINES,}horovod"
stage horovod
{ capped "$(limit 240 10)" "$PY" "$HOROVODRUN" -np 1 --gloo "$PY" -m scripts.gpu.gpu_face_check measure "$WORK" \
    --engine horovod "${TINY_ARG[@]}" 2>&1 | tr '\r' '\n' | sed '/it\/s\]$/d' | tee "$OUT/horovod.log"; } \
  || failed horovod $?
if [ "$TINY" != 1 ]; then
  { capped "$(limit 120 10)" env HVD_PARTIALFC_TEST_GPU=1 "$PY" -m pytest -q -m gpu -k horovod tests \
      -p no:cacheprovider 2>&1 | tee "$OUT/smoke_horovod.log" | tail -3; } || failed smoke-horovod $?
fi
fi

stage report
capped "$(limit 60)" "$PY" -m scripts.gpu.gpu_face_check report "$WORK" "$OUT" --engines "$ENGINES" || failed report $?
stage done
TOTAL=$(( $(date +%s) - T0 ))
if [ -n "$FAILED" ]; then
  echo "gpu_check: FAILED in stage(s)$FAILED, after $TOTAL s; every later stage ran; results in $OUT" >&2
  exit 1
fi
# Its budget: 9 minutes, the build included (a device command may run 10; the rest is for a rerun)
[ "$TINY" = 1 ] || [ "$TOTAL" -le 540 ] || echo "gpu_check: WARNING: $TOTAL s, over its 540 s budget (stages.tsv)"
echo "gpu_check: passed in $TOTAL s; results in $OUT (face_check.txt, face_check.json, speed_table.md, speed.json, stages.tsv)"
