#!/usr/bin/env bash
# Launch with Open MPI's mpirun directly (Horovod's MPI controller).
#
#   launch/mpirun.sh SHARDS RUN [NP] [HOSTFILE]
# --bind-to none lets each rank use its share of cores (set train.threads to pin a number);
# -x passes the environment variables Horovod and NCCL read to every rank.
set -euo pipefail
SHARDS=${1:?shard set dir}; RUN=${2:?run dir}; NP=${3:-2}; HOSTFILE=${4:-}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${VENV:-$ROOT/.venv}/bin"
HOSTS=(); [ -n "$HOSTFILE" ] && HOSTS=(--hostfile "$HOSTFILE")
ROOT_FLAG=(); [ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-run-as-root)
exec mpirun -np "$NP" "${HOSTS[@]}" "${ROOT_FLAG[@]}" --bind-to none --map-by slot \
  -x PATH -x LD_LIBRARY_PATH -x NCCL_DEBUG -x HOROVOD_TIMELINE \
  "$BIN/hvd-partialfc" train --config "$ROOT/configs/example.yaml" --shards "$SHARDS" --out "$RUN" "${@:5}"
