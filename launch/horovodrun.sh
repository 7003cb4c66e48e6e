#!/usr/bin/env bash
# Launch with horovodrun. One process per GPU (or per CPU slot); the run folder must be on a file system
# that every host sees.
#
#   launch/horovodrun.sh SHARDS RUN [NP] [HOSTS]        e.g. launch/horovodrun.sh data/s runs/a 2
#   HOSTS like "node1:8,node2:8" for two nodes of 8 GPUs (then NP=16).
# GPU clusters: Horovod must be built with NCCL (HOROVOD_GPU_OPERATIONS=NCCL scripts/setup/install.sh).
set -euo pipefail
SHARDS=${1:?shard set dir}; RUN=${2:?run dir}; NP=${3:-2}; HOSTS=${4:-localhost:$NP}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${VENV:-$ROOT/.venv}/bin"
exec "$BIN/horovodrun" -np "$NP" -H "$HOSTS" ${HVD_BACKEND:---gloo} \
  "$BIN/hvd-partialfc" train --config "$ROOT/configs/example.yaml" --shards "$SHARDS" --out "$RUN" "${@:5}"
