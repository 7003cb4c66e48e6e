#!/usr/bin/env bash
# Build a shard set with mpirun: NP processes (over HOSTFILE's machines) each write every NP-th shard
# (--part from OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE), then `assemble` writes the manifests.
#
#   launch/build_shards_mpirun.sh FORMAT SRC OUT NUM_SHARDS [NP] [HOSTFILE] [-- extra build flags]
#   e.g. launch/build_shards_mpirun.sh recordio /data/glint360k/train /data/shards/glint-128 128 8 hosts
#
# SRC and OUT must be on a file system every host sees. Re-running the same command after a failure
# writes only the missing shards. No MPI communication happens: mpirun is only a process launcher here.
set -euo pipefail
FORMAT=${1:?format}; SRC=${2:?source}; OUT=${3:?out}; NUM_SHARDS=${4:?num shards}; NP=${5:-2}; HOSTFILE=${6:-}
shift $(( $# < 6 ? $# : 6 )); [ "${1:-}" = "--" ] && shift
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${VENV:-$ROOT/.venv}/bin"
HOSTS=(); [ -n "$HOSTFILE" ] && HOSTS=(--hostfile "$HOSTFILE")
ROOT_FLAG=(); [ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-run-as-root)
# Each process runs WORKERS decode processes: set it to (cores per host) / (processes per host).
WORKERS=${WORKERS:-1}
mpirun -np "$NP" "${HOSTS[@]}" "${ROOT_FLAG[@]}" --bind-to none --map-by slot -x PATH -x PYTHONPATH \
  "$BIN/hvd-partialfc-shards" build "$FORMAT" "$SRC" --out "$OUT" --num-shards "$NUM_SHARDS" \
  --workers "$WORKERS" "$@"
exec "$BIN/hvd-partialfc-shards" assemble "$OUT"
