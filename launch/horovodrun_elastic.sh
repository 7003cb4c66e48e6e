#!/usr/bin/env bash
# Launch with horovodrun's elastic mode: a lost rank or host does not end the job. The survivors leave the
# failed collective, re-form the group in their own processes (same PIDs, CUDA context and compiled model kept)
# and resume the run's newest state (a memory snapshot, else the latest checkpoint), re-sharded at the new size;
# a host added by the discovery script joins. docs/reliability.md, "Going on in the same processes".
#
#   launch/horovodrun_elastic.sh SHARDS RUN DISCOVERY MIN_NP MAX_NP [NP] [train args...]
#   launch/horovodrun_elastic.sh shards runs/r1 ./hosts.sh 16 64 64 --config configs/ms1mv3_r50.yaml
#
# DISCOVERY: an executable that prints the hosts that may run ranks now, one "host:slots" a line (horovodrun
# calls it about once a second). The job runs on MIN_NP to MAX_NP ranks; NP (default MAX_NP) at the start.
# One slot a host name where a rank's crash should not take its host's other ranks: horovodrun blacklists a
# failed rank's whole host (and stops that host's other ranks). HOROVOD_GLOO_TIMEOUT_SECONDS bounds how long
# a new group waits for a host that is starting (default 30 s): raise it where start-up takes longer.
#
# Environment (defaults in brackets): CONFIG [configs/example.yaml], VENV [.venv], MEMORY_EVERY [20]
# (checkpoint.memory_every), NIC (horovodrun --network-interface: needed when the hosts have no common
# interface name that horovodrun can probe, e.g. all on one machine: lo), HOROVODRUN_ARGS (more horovodrun
# options, e.g. "--blacklist-cooldown-range 60 600" to let a failed host back after a cooldown).
set -euo pipefail
SHARDS=${1:?shard set dir}; RUN=${2:?run dir}; DISCOVERY=${3:?host discovery script}
MIN_NP=${4:?min ranks}; MAX_NP=${5:?max ranks}; NP=${6:-$MAX_NP}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${VENV:-$ROOT/.venv}/bin"
NIC_ARGS=(); [ -n "${NIC:-}" ] && NIC_ARGS=(--network-interface "$NIC")
# shellcheck disable=SC2086  # HOROVODRUN_ARGS: words on purpose
exec "$BIN/horovodrun" --gloo -np "$NP" --min-np "$MIN_NP" --max-np "$MAX_NP" \
  --host-discovery-script "$DISCOVERY" "${NIC_ARGS[@]}" ${HOROVODRUN_ARGS:-} \
  "$BIN/hvd-partialfc" train --config "${CONFIG:-$ROOT/configs/example.yaml}" --shards "$SHARDS" --out "$RUN" \
  --resume auto --set "checkpoint.memory_every=${MEMORY_EVERY:-20}" "${@:7}"
