#!/usr/bin/env python
"""A job that resumes from node memory while another user of the node floods its ports, against the same resume
unflooded (docs/evidence/reliability.md, "On a shared node"). Run from the repository root, as root (the flood runs as
``nobody``):

    python -m scripts.studies.flood [--trials 2] [--seconds 10] [--json flood.json]

Once: a small job of 2 torchrun agents on this host (a node of one rank each, its own snapshot root), snapshots
every 4 steps, rank 1 SIGKILLed in its snapshot of step 24: node memory holds step 20. Then ``--trials`` times,
alternated, the same two agents restart a copy of that state, quiet or flooded: the flood (scripts/faults/flooder.py
as nobody, ``--seconds`` from the launch) reaches every port the ranks listen on with the job's own listener (the
heartbeat ring's while it forms, the memory links' all along), found as they open (the ranks advertise 127.0.0.2,
so that Gloo's and the rendezvous' ports, which are not this project's, are left alone). Figures: each restart's
wall time from the launch to its end and to its first step after the resume (metrics.jsonl), whether it resumed
from memory, whether every snapshot after it landed, and the flood's connections.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from scripts.faults import flooder  # noqa: E402

BIN = os.path.dirname(sys.executable)
ADDR = "127.0.0.2"
RUN = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
       "train.log_every=1", "train.threads=1", "data.workers=0", "checkpoint.resume=auto", "checkpoint.keep=3",
       "train.heartbeat_timeout=5", "head.negatives_every=0", "checkpoint.every=15", "checkpoint.memory_every=4"]
STEPS = 30


def shards(folder: str) -> str:
    import numpy as np
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(24), 30)
    x = (rng.normal(size=(24, 16))[y] + 0.5 * rng.normal(size=(len(y), 16))).astype(np.float32)
    np.savez(os.path.join(folder, "f.npz"), features=x, labels=y)
    build_shard_set(get_importer("npz")(os.path.join(folder, "f.npz")), os.path.join(folder, "shards"), 4)
    return os.path.join(folder, "shards")


def launch(roots, data, out, fault=None):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i, root in enumerate(roots):
        env = dict(os.environ, PYTHONPATH=ROOT, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
                   HVD_PARTIALFC_MEMORY_DIR=root, HVD_PARTIALFC_HEARTBEAT_ADDR=ADDR)
        env.pop("HVD_PARTIALFC_FAULT", None)
        if fault:
            env["HVD_PARTIALFC_FAULT"] = fault
        cmd = [os.path.join(BIN, "torchrun"), "--nnodes", str(len(roots)), "--node-rank", str(i),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "hvd_partialfc.cli", "train", "--shards", data, "--out", out, "--steps", str(STEPS)]
        for s in RUN:
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=ROOT, start_new_session=True))
    return procs


def wait(procs, timeout=150):
    try:
        return [(p.communicate(timeout=timeout)[0], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


def watch_ports(procs, path: str, stop: threading.Event) -> None:
    """Every port on ``ADDR`` that the agents' ranks listen on, appended to ``path`` as it opens."""
    import psutil
    seen = set()
    while not stop.is_set():
        for p in procs:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    for c in child.net_connections("tcp"):
                        if c.status == psutil.CONN_LISTEN and c.laddr.ip == ADDR and c.laddr not in seen:
                            seen.add(c.laddr)
                            with open(path, "a") as f:
                                f.write(f"{c.laddr.ip}:{c.laddr.port}\n")
            except psutil.Error:
                pass
        stop.wait(0.02)


def restart(base: str, data: str, flood_s: float) -> dict:
    run, roots = os.path.join(base, "run"), [os.path.join(base, f"node{i}") for i in range(2)]
    for d in [run] + roots:
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(d + ".crashed", d, symlinks=True)
    ports = os.path.join(base, "ports")         # read by nobody: the folder searchable, the file readable
    open(ports, "w").close()
    os.chmod(ports, 0o644)
    stranger = flooder.start_as("nobody", [], flood_s, start_file=ports, watch=True, inflight=300) if flood_s \
        else None
    t0 = time.time()
    procs = launch(roots, data, run)
    stop = threading.Event()
    watcher = threading.Thread(target=watch_ports, args=(procs, ports, stop), daemon=True)
    if stranger:
        watcher.start()
    results = wait(procs)
    ended = time.time()
    stop.set()
    text = "\n".join(out for out, _ in results)
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
    first = min((r["time"] for r in records if r.get("time", 0) > t0), default=None)    # the crash's records before
    return {"flooded": bool(flood_s), "exit": [code for _, code in results], "wall_s": round(ended - t0, 2),
            "first_step_s": round(first - t0, 2) if first else None,
            "from_memory": "resuming from the snapshot of step 20 in node memory" in text,
            "snapshots_landed": "had not landed" not in text and "dropped" not in text,
            "flood": flooder.finish(stranger) if stranger else None,
            "ports": len(open(ports).read().split()) if stranger else 0,
            **({"tail": text.splitlines()[-15:]} if any(code for _, code in results) else {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not flooder.can_flood_as("nobody"):
        sys.exit("needs root, runuser and a Python that nobody may run")
    base = tempfile.mkdtemp(prefix="flood-study-")
    os.chmod(base, 0o711)
    try:
        data = shards(base)
        run, roots = os.path.join(base, "run"), [os.path.join(base, f"node{i}") for i in range(2)]
        for r in roots:
            os.makedirs(r)
        crash = wait(launch(roots, data, run, fault="kill-in-memory@24:1"))
        assert any("injected kill-in-memory at step 24" in out for out, _ in crash), crash
        for d in [run] + roots:
            shutil.copytree(d, d + ".crashed", symlinks=True)
        rows = []
        for i in range(a.trials):
            for flood_s in ((0, a.seconds) if i % 2 == 0 else (a.seconds, 0)):
                rows.append(restart(base, data, flood_s))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def mean(key, flooded):
        xs = [r[key] for r in rows if r["flooded"] == flooded and r[key] is not None]
        return sum(xs) / len(xs) if xs else float("nan")
    summary = {k: {"quiet": round(mean(k, False), 2), "flooded": round(mean(k, True), 2),
                   "ratio": round(mean(k, True) / mean(k, False), 3)} for k in ("wall_s", "first_step_s")}
    summary["every_start_ok"] = all(r["exit"] == [0, 0] and r["from_memory"] and r["snapshots_landed"] for r in rows)
    print(json.dumps(summary), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
