#!/usr/bin/env bash
# The speed run in one GPU call (docs/gpu.md, "The one call"): scripts/gpu/gpu_check.sh with its Horovod build
# and stage left out (both passed on the H200 twice), so that the speed stage gets their ~3.5 minutes.
#
#   bash scripts/gpu/gpu_speed_run.sh          # ARCFACE_DIR defaults to .dev/insightface/recognition/arcface_torch
#   GPU_CHECK_SKIP= HOROVOD_SDIST=.dev/horovod-0.28.1.tar.gz bash scripts/gpu/gpu_speed_run.sh    # the whole check too
#   GPU_CHECK_TINY=1 ARCFACE_DIR=DIR OUT=DIR bash scripts/gpu/gpu_speed_run.sh      # the CPU dry run (its test)
#
# Refuses to start (exit 2, one line) without arcface_torch in ARCFACE_DIR: the machine has no network, so it
# travels with the call (carry .dev), and the call's headline is ours against it.
# One deadline for everything: GPU_CALL_S seconds from the start (default 570 of the GPU call's 600); every
# stage and every speed cell is cut at it. $OUT is written as the call goes, at every stage's start and after
# every speed cell (scripts/gpu/publish.py), so a call cut early brings back what was measured until then:
# speed_table.md (the GPU speed table), speed.json, face_check.json, gpu_check.tgz (every result and log but the
# kernel traces) and traces.tgz (the step and kernel traces, Chrome's format). The exit status is
# gpu_check.sh's (124: cut at the deadline; 2: refused).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to (the GPU call sets it)}"
START=$(date +%s)
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1
ARCFACE_DIR="${ARCFACE_DIR:-$ROOT/.dev/insightface/recognition/arcface_torch}"
has_arcface() {   # as hvd_partialfc/tools/arcface_step.py find_arcface looks: the folder or its recognition/arcface_torch
  local d
  for d in "$1" "$1/recognition/arcface_torch"; do
    [ -f "$d/partial_fc_v2.py" ] && [ -d "$d/backbones" ] && return 0
  done
  return 1
}
if ! has_arcface "$ARCFACE_DIR"; then
  echo "gpu_speed_run: no arcface_torch in $ARCFACE_DIR (partial_fc_v2.py and backbones/): copy an InsightFace checkout's recognition/arcface_torch into .dev/insightface and carry .dev (docs/gpu.md, The one call)" >&2
  exit 2
fi
WORKDIR="$(mktemp -d)"
trap 'rm -rf "$WORKDIR"' EXIT
R="$WORKDIR/gpu_check"
mkdir -p "$R" "$OUT"
CALL_S="${GPU_CALL_S:-570}"
export GPU_CHECK_DEADLINE=$(( START + CALL_S )) GPU_PUBLISH_FROM="$WORKDIR" GPU_PUBLISH_TO="$OUT"
# the cap holds what overruns the deadline (a hung report) to leave the last publishing its seconds
GPU_CHECK_SKIP="${GPU_CHECK_SKIP-build,horovod}" OUT="$R" ARCFACE_DIR="$ARCFACE_DIR" \
  timeout -k 5 "$(( CALL_S + 5 - ($(date +%s) - START) ))" bash scripts/gpu/gpu_check.sh 2>&1 | tee "$WORKDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
"${PYTHON:-python3}" -m scripts.gpu.publish "$WORKDIR" "$OUT" || rc=$(( rc ? rc : 1 ))
ls -la "$OUT"
exit "$rc"
