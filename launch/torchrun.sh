#!/usr/bin/env bash
# Launch with torchrun, elastic: the same command on every node (one node, or many; Slurm:
# launch/slurm_torchrun.sbatch runs it on each of its nodes). The run folder must be on a file system that
# every node sees; extra arguments go to `hvd-partialfc train` (a later --config or --set wins).
#
#   launch/torchrun.sh SHARDS RUN [NPROC] [NNODES] [train args...]
#   launch/torchrun.sh shards runs/r1 8 1 --config configs/ms1mv3_r50.yaml         one node, 8 GPUs
#   RDZV_ENDPOINT=node1:29400 RDZV_ID=r1 launch/torchrun.sh shards runs/r1 8 2:4    on each of 2 to 4 nodes
#
# NPROC: ranks on this node (default: the GPUs nvidia-smi lists, else 1). NNODES: N, or MIN:MAX (default 1).
# The run resumes its latest checkpoint or memory snapshot (--resume auto: a restart must, docs/engines.md),
# takes memory snapshots every MEMORY_EVERY steps, and evicts a straggler's node (train.stragglers=evict).
#
# The rendezvous (torchrun's c10d backend; docs/engines.md, "Elastic" and "Timeouts"):
#   --nnodes MIN:MAX  the job runs on any number of nodes from MIN to MAX: a node that is lost or evicted
#                     leaves it, and the others restart without it, re-sharded from the last snapshot or
#                     checkpoint; a node whose agent starts later joins it (the workers restart, re-sharded).
#                     Below MIN the job waits for nodes (join_timeout), then fails. On fewer nodes each rank
#                     holds a larger classifier slice: choose MIN so that it still fits. N alone: a fixed size.
#                     MIN is also train.straggler_min_nodes (a worker cannot see it): never evicted below it.
#   --max-restarts    MAX_RESTARTS (3): how many times this node's agent restarts its workers after a
#                     failure (a crashed or killed rank, a rank's exit 75 or 76, and a user's error, exit 2,
#                     too: torchrun cannot tell them apart). A change of members (a node lost or joining)
#                     restarts the workers without counting.
#   --rdzv-endpoint   RDZV_ENDPOINT (localhost:29400): HOST:PORT of the c10d store, hosted by the agent on HOST
#                     (the node whose name or address is HOST). Losing that node ends the whole job: make it
#                     the safest one (the rendezvous node is never evicted as a straggler, for this reason).
#   --rdzv-id         RDZV_ID (default: the run folder's name): the job's name at that store, the same on every
#                     node; agents with another id form another job (and wait for this run folder's lock).
#   --rdzv-conf       RDZV_CONF, torch's defaults written out: join_timeout (600 s: how long agents wait for
#                     MIN nodes), last_call_timeout (30 s: once MIN have joined, how long a round waits for
#                     more, up to MAX), keep_alive_interval x keep_alive_max_attempt (5 s x 3: an agent silent
#                     that long is dropped, its node lost). A recovery takes about the keep-alive plus the last
#                     call plus a start-up: tests/test_elastic.py uses last_call_timeout=3,keep_alive_interval=1,
#                     keep_alive_max_attempt=3 on one host (10 s, not 31). On a busy cluster keep the defaults:
#                     a node slowed by a loaded file system or network would be dropped as lost, and an agent
#                     that starts a few seconds late would miss the first round (the job starts smaller, then
#                     restarts when it joins). Raise join_timeout where nodes start minutes apart.
#
# Environment (defaults in brackets): CONFIG [configs/example.yaml], VENV [.venv], MAX_RESTARTS [3],
# RDZV_ENDPOINT [localhost:29400], RDZV_ID [the run folder's name], RDZV_CONF [torch's defaults, above],
# MEMORY_EVERY [50] (0: no memory snapshots), MEMORY_DIR [unset: checkpoint.memory_dir from the config, else
# /dev/shm] (each node needs its own: a %n in it becomes the node's number, $SLURM_NODEID, else 0),
# STRAGGLERS [evict] (warn, off), SHUTDOWN_TIMEOUT [240] (seconds the agent waits, after a stop signal, for
# its ranks' checkpoint before it kills them: under Slurm's 300 s warning; torch 2.13 reads it, an older one
# waits 30 s), FORWARD_SIGNALS [1; 0 under srun] (below), HVD_PARTIALFC_EXIT_DIR [a temporary folder of its
# own] (where the ranks write their exit status, below; launch/slurm_torchrun.sbatch gives all nodes one).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE [1]: each rendezvous round gets a new store on a new port. With torch's
# shared store a node that joins a running job hangs torchrun's own rendezvous (torch 2.13; docs/engines.md).
#
# Signals: a stop signal (SIGTERM: preemption, scancel; SIGUSR1: Slurm's --signal ahead of the time limit)
# reaches the agent, which passes it to its ranks: every rank of the job finishes its step, checkpoints and
# exits 75. This script outlives the signal and passes it on to torchrun (FORWARD_SIGNALS=1: a container's
# PID 1, `kill` of this script), except under srun (FORWARD_SIGNALS=0 when SLURM_STEP_ID is set): Slurm signals
# every process of the task, torchrun included, and a second copy cuts torch's first shutdown short (it then
# sends SIGTERM and waits again: no harm, a traceback in the log). torchrun handles SIGUSR1 from torch 2.9 on
# (set here through PET_SIGNALS_TO_HANDLE); an older one is ended by it (its ranks still stop where the
# signal reaches them too, as under Slurm).
#
# Exit status: torchrun says 1 for every failure, so each rank writes its own into HVD_PARTIALFC_EXIT_DIR
# (hvd_partialfc/cli_support.py) and, when torchrun fails, this script exits with the newest one there (a stop
# and a user's error are agreed by every rank; a folder that every node sees gives every node the job's):
#   0   trained to the end
#   75  stopped by a signal after a checkpoint: requeue the same command, it resumes (a scheduler's job)
#   76  this node was evicted as a straggler; the other nodes went on without it (do not restart it here)
#   2   a user's error that every rank refused (config, shard set, checkpoint, a full disk): fix it first
#   1   anything else: restarts used up, the rendezvous node lost, fewer than MIN nodes
set -euo pipefail
SHARDS=${1:?shard set dir}; RUN=${2:?run dir}
NPROC=${3:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}; [ "${NPROC:-0}" != 0 ] || NPROC=1
NNODES=${4:-1}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${VENV:-$ROOT/.venv}/bin"
NODE=${SLURM_NODEID:-0}
RDZV_CONF=${RDZV_CONF:-join_timeout=600,last_call_timeout=30,keep_alive_interval=5,keep_alive_max_attempt=3}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}
MEMORY=(); [ -n "${MEMORY_DIR:-}" ] && MEMORY=(--set "checkpoint.memory_dir=${MEMORY_DIR//%n/$NODE}")
OWN_EXIT_DIR=
if [ -z "${HVD_PARTIALFC_EXIT_DIR:-}" ]; then
  HVD_PARTIALFC_EXIT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/hvd_partialfc-exit.XXXXXX"); OWN_EXIT_DIR=1
fi
export HVD_PARTIALFC_EXIT_DIR
FORWARD_SIGNALS=${FORWARD_SIGNALS:-$([ -n "${SLURM_STEP_ID:-}" ] && echo 0 || echo 1)}
pid=; caught=
stop() { caught=$1; [ "$FORWARD_SIGNALS" = 1 ] && [ -n "$pid" ] && kill -s "$1" "$pid" 2>/dev/null; return 0; }
for sig in TERM INT HUP QUIT USR1; do trap "stop $sig" "$sig"; done

"$BIN/torchrun" --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "${MAX_RESTARTS:-3}" \
  --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:-localhost:29400}" \
  --rdzv-id "${RDZV_ID:-$(basename "$RUN")}" --rdzv-conf "$RDZV_CONF" \
  -m hvd_partialfc.cli train --config "${CONFIG:-$ROOT/configs/example.yaml}" \
  --shards "$SHARDS" --out "$RUN" --resume auto \
  --set "checkpoint.memory_every=${MEMORY_EVERY:-50}" "${MEMORY[@]}" \
  --set "train.stragglers=${STRAGGLERS:-evict}" --set "train.straggler_min_nodes=${NNODES%%:*}" \
  "${@:5}" &
pid=$!
while :; do      # a trapped signal ends `wait` early: wait again, for torchrun's own status
  caught=; rc=0; wait "$pid" || rc=$?
  [ "$rc" -gt 128 ] && [ -n "$caught" ] || break
done
trap - TERM INT HUP QUIT USR1

code=$rc
if [ "$rc" -ne 0 ]; then
  last=$(ls -t "$HVD_PARTIALFC_EXIT_DIR"/rank-* 2>/dev/null | head -1 || true)
  ranks=$([ -n "$last" ] && cat "$last" || true)
  case "$ranks" in 2|75|76) code=$ranks ;; esac
  echo "launch/torchrun.sh: torchrun exited $rc; the ranks' last exit status: ${ranks:-none}; exit $code" >&2
fi
[ -n "$OWN_EXIT_DIR" ] && rm -rf "$HVD_PARTIALFC_EXIT_DIR"
exit "$code"
