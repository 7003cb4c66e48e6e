#!/usr/bin/env python3
"""Launch the torch.distributed engine so that a lost rank does not end the job: the survivors re-form the group in
their own processes (same PIDs, CUDA context and compiled model kept) and resume the run's newest state (a memory
snapshot, else the latest checkpoint), re-sharded at the new size. docs/reliability.md, "Going on in the same
processes"; the engine's side is hvd_partialfc/engine/generation.py.

    launch/torch_inprocess.py SHARDS RUN NPROC [train args...]
    launch/torch_inprocess.py shards runs/r1 8 --config configs/ms1mv3_r50.yaml

It starts, on this node, a store process (``python -m hvd_partialfc.engine.gen_store``: the keys through which the
survivors agree who is left, and a death watch; it trains nothing and outlives the ranks) and NPROC ranks of
``hvd-partialfc train --resume auto``, each told the store's address (``HVD_PARTIALFC_GEN_STORE``), and waits for
them. Why not torchrun: its agent ends every local worker when one fails (scripts/studies/elastic_torch/FINDINGS.md,
"4"); this launcher restarts nothing while a rank is left. A rank lost (killed, crashed, its heartbeat silent) is
reported in one line and the others go on; the job's exit is 0 when the last group finished (any rank exited 0),
else 75 (preempted) or 2 (a user's error) as the ranks said, else the job starts again from the run's newest state,
up to MAX_RESTARTS times (the fallback: the store lost, every rank gone).

One node only. Across nodes the same needs one store process on the safest node, its address given to every node
(``--host`` of gen_store, reachable by all), a per-node starter of the ranks with their global ``RANK`` and the
job's ``WORLD_SIZE``, and ``GLOO_SOCKET_IFNAME`` (or ``HVD_PARTIALFC_HEARTBEAT_ADDR``) for the ranks' addresses.

A rank that fails while others run is started again, REJOIN times in all: while the others train it imports the
trainer, builds and warms up its backbone (hvd_partialfc/run/prejoin.py) and only then asks to join; at their next
step they checkpoint it and re-form the group with it (the engine's ``Generations.join``), paused only for that and
the start at the new size.

Environment (defaults in brackets): CONFIG [configs/example.yaml], VENV [.venv], MEMORY_EVERY [20]
(checkpoint.memory_every), MAX_RESTARTS [3], REJOIN [0].
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_PREEMPTED, EXIT_USER_ERROR = 75, 2
END_GRACE_S = 60.0      # after a rank ended the run (exit 0), how long the others have to end too


def start_store(python: str) -> "tuple[subprocess.Popen, str]":
    """The store process and its ``HOST:PORT`` (its first line)."""
    p = subprocess.Popen([python, "-m", "hvd_partialfc.engine.gen_store"], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    if len(line) != 2 or line[0] != "store":
        p.kill()
        raise SystemExit(f"[torch_inprocess] the store process did not start (said {' '.join(line)!r})")
    return p, line[1]


def job_exit(codes: "dict[int, int]"):
    """The job's exit from its ranks' codes, or None to start it again (see the module's docstring)."""
    values = list(codes.values())
    if 0 in values:
        return 0
    for code in (EXIT_PREEMPTED, EXIT_USER_ERROR):
        if code in values:
            return code
    return None


def attempt(argv: "list[str]", nproc: int, python: str, restart: int, rejoins: int) -> "dict[int, int]":
    """One start of the store and NPROC ranks; each rank's exit code (a signal: minus its number). A rank that
    fails while others run is started again, up to ``rejoins`` times in all, and joins the running job."""
    store, address = start_store(python)
    ranks: "dict[int, subprocess.Popen]" = {}

    def start(r: int, join: bool) -> None:
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR=address.rpartition(":")[0], HVD_PARTIALFC_GEN_STORE=address,
                   HVD_PARTIALFC_GEN_JOIN="1" if join else "0",      # a fault fires in the first start only:
                   HVD_PARTIALFC_RESTART_COUNT=str(restart + join))  # (run/watch/faults.py)
        ranks[r] = subprocess.Popen(argv, env=env)
        print(f"[torch_inprocess] rank {r} started{' again, to join the running job' if join else ''}: pid "
              f"{ranks[r].pid}", file=sys.stderr, flush=True)
    try:
        for r in range(nproc):
            start(r, False)

        def forward(sig, _frame):        # a scheduler's stop: every rank checkpoints and exits 75
            for p in ranks.values():
                if p.poll() is None:
                    p.send_signal(sig)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, forward)
        codes: "dict[int, int]" = {}
        done_at = None                   # when the first rank ended the run (exit 0)
        while len(codes) < nproc:
            for r, p in list(ranks.items()):
                if r not in codes and p.poll() is not None:
                    codes[r] = p.returncode
                    if p.returncode not in (0, EXIT_PREEMPTED, EXIT_USER_ERROR) and len(codes) < nproc:
                        again = rejoins > 0
                        print(f"[torch_inprocess] rank {r} (pid {p.pid}) exited {p.returncode} while "
                              f"{nproc - len(codes)} still run{'; starting it again' if again else ''}",
                              file=sys.stderr, flush=True)
                        if again:
                            rejoins -= 1
                            del codes[r]
                            start(r, True)
            if done_at is None and 0 in codes.values():
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > END_GRACE_S:   # a rank left out, hung
                for r, p in ranks.items():
                    if r not in codes:
                        print(f"[torch_inprocess] rank {r} (pid {p.pid}) still runs {END_GRACE_S:.0f} s after the "
                              "run ended (left out of the group, hung?): killed", file=sys.stderr, flush=True)
                        p.kill()
                        codes[r] = p.wait()
            time.sleep(0.1)
        return codes
    finally:
        for p in ranks.values():
            if p.poll() is None:
                p.kill()
        store.terminate()
        store.wait()


def main(args: "list[str]") -> int:
    if len(args) < 3 or not args[2].isdigit():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    shards, run, nproc = args[0], args[1], int(args[2])
    bin_ = os.path.join(os.environ.get("VENV", os.path.join(ROOT, ".venv")), "bin")
    python = os.path.join(bin_, "python")
    argv = [os.path.join(bin_, "hvd-partialfc"), "train", "--config",
            os.environ.get("CONFIG", os.path.join(ROOT, "configs", "example.yaml")), "--shards", shards, "--out", run,
            "--resume", "auto", "--set", f"checkpoint.memory_every={os.environ.get('MEMORY_EVERY', '20')}", *args[3:]]
    restarts = int(os.environ.get("MAX_RESTARTS", "3"))
    for restart in range(restarts + 1):
        codes = attempt(argv, nproc, python, restart, int(os.environ.get("REJOIN", "0")))
        end = job_exit(codes)
        said = ", ".join(f"{r}: {c}" for r, c in sorted(codes.items()))
        if end is not None:
            return end
        print(f"[torch_inprocess] every rank failed ({said}); "
              f"{'starting the job again from its newest state' if restart < restarts else 'no restarts left'}",
              file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
