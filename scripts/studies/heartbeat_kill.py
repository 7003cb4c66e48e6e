#!/usr/bin/env python
"""How long until every rank has exited after one rank is SIGKILLed: N training processes of the torch engine
on this machine, each with a DataLoader worker (``data.workers=1``), one killed mid-training.

    python -m scripts.studies.heartbeat_kill --ranks 8 16 --timeout 5 --json heartbeat_kill.json
    python -m scripts.studies.heartbeat_kill --ranks 8 16 --code OLD_CHECKOUT     # the same, another checkout's code

The ranks are started by hand (torch.distributed's variables, rank 0 hosting the store), not by a launcher:
horovodrun or torchrun would end the others themselves, and this measures what the ranks do on their own
(a lost node on a cluster, whose launcher cannot reach them). Rank N/2 is killed once rank 0 has logged two
lines; the figure is the time from the kill until the last other rank has exited. The ring heartbeat
(engine/heartbeat.py) is the only way out: the killed rank's Gloo connections stay open while its worker lives.

Goal (docs/evidence/engines.md, "Failures"): under the heartbeat timeout plus 5 s, at any N. Before the fix, the killed rank's
worker held its heartbeat connection open until it noticed its parent's death, and so did each next
neighbour's after it ended: about N x 5 s round the ring.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
SETS = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
        "train.log_every=5", "train.threads=1", "data.workers=1", "head.negatives_every=0", "train.engine=torch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shards(folder: str, ranks: int) -> str:
    import numpy as np
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    rng = np.random.default_rng(0)
    classes = 4 * ranks
    y = np.repeat(np.arange(classes), 24)
    x = (rng.normal(size=(classes, 16))[y] + 0.5 * rng.normal(size=(len(y), 16))).astype(np.float32)
    np.savez(os.path.join(folder, "f.npz"), features=x, labels=y)
    build_shard_set(get_importer("npz")(os.path.join(folder, "f.npz")), os.path.join(folder, "shards"), ranks)
    return os.path.join(folder, "shards")


def measure(ranks: int, timeout: float, code: str, work: str) -> Dict:
    shards = _shards(tempfile.mkdtemp(dir=work), ranks)
    run = os.path.join(work, f"run-{ranks}")
    port, procs = _free_port(), []
    argv = [sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", shards, "--out", run, "--steps", "100000"]
    for s in SETS + [f"train.heartbeat_timeout={timeout}"]:
        argv += ["--set", s]
    logs = []
    for r in range(ranks):
        env = dict(os.environ, PYTHONPATH=code, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        logs.append(open(os.path.join(work, f"rank-{ranks}-{r}.log"), "w"))
        procs.append(subprocess.Popen(argv, env=env, cwd=code, stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
    try:
        metrics, deadline = os.path.join(run, "metrics.jsonl"), time.time() + 600
        while not (os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 2):
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{ranks} ranks: training did not start (logs in {work})")
            time.sleep(0.2)
        victim = ranks // 2
        os.kill(procs[victim].pid, signal.SIGKILL)
        t0, ended = time.time(), {}
        while len(ended) < ranks - 1 and time.time() - t0 < 300:
            for r, p in enumerate(procs):
                if r != victim and r not in ended and p.poll() is not None:
                    ended[r] = time.time() - t0
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            try:
                os.killpg(p.pid, signal.SIGKILL)      # its DataLoader worker too
            except ProcessLookupError:
                pass
        for f in logs:
            f.close()
    times = sorted(ended.values())
    return {"ranks": ranks, "heartbeat_timeout_s": timeout, "killed_rank": victim, "ended": len(times),
            "first_out_s": round(times[0], 2) if times else None, "all_out_s": round(times[-1], 2) if times else None,
            "goal_s": timeout + 5, "met": len(times) == ranks - 1 and times[-1] < timeout + 5}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--timeout", type=float, default=5.0, help="train.heartbeat_timeout (s)")
    ap.add_argument("--code", default=ROOT, help="the checkout whose code the ranks run (default: this one)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="hpfc-hbkill-")
    rows: List[Dict] = []
    try:
        print(f"{'ranks':>5} {'timeout s':>9} {'first out s':>11} {'all out s':>9} {'goal s':>6}  met", flush=True)
        for n in a.ranks:
            row = measure(n, a.timeout, os.path.abspath(a.code), work)
            rows.append(row)
            print(f"{n:>5} {a.timeout:>9g} {row['first_out_s']!s:>11} {row['all_out_s']!s:>9} {row['goal_s']:>6g}  "
                  f"{'yes' if row['met'] else 'NO'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m scripts.studies.heartbeat_kill " + " ".join(argv or sys.argv[1:]), "rows": rows},
                      f, indent=1)
    return 0 if all(r["met"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
