#!/usr/bin/env python
"""A killed rank under Horovod: the survivors going on in their own processes (horovodrun's elastic mode,
launch/horovodrun_elastic.sh) beside today's relaunch (launch/horovod_restarts.py), the same job, the same kill;
the figures in docs/evidence/reliability.md, "Going on in the same processes". Run from the repository root:

    python -m scripts.studies.inprocess_recovery --repeats 3 --json inprocess.json

Each run: 3 ranks on three local host names (one slot each), a disk checkpoint every 2 steps, rank 2 SIGKILLed
before step ``--kill + 1``; the job goes on at 2 ranks from the step-``--kill`` checkpoint. Figures a run:

* **stall**: from the survivors' last step before the kill to their first step after it (metrics.jsonl, a row a
  step), what the job loses in wall time besides the steps redone;
* **kill -> re-formed**: from the kill to the survivors' new group (the "went on" line; relaunch: none);
* **survivors' PIDs kept**: every rank after the fault runs in a process that ran a rank before it.

``--engine torch``: the torch engine instead, on one node: 3 ranks under launch/torch_inprocess.py (the survivors
re-form the group in their processes, engine/generation.py) beside launch/torchrun.sh with ``--max-restarts 1``
(torchrun's agent ends the two survivors and starts three ranks again, resuming the same checkpoint at 3 ranks).

``--cycles N`` instead: one job whose discovery script drops the third host and lists it again, N re-forms in all
(one flip every ``--flip-s`` seconds; flips that come faster than the job re-forms count once), the two old ranks
sampled from outside (psutil, every 0.3 s): their RSS, threads, open descriptors, sockets and child processes before
the first re-form, before the second, and at the end of training.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from scripts.studies.memory_recovery import shards  # noqa: E402

BIN = os.path.dirname(sys.executable)
SETS = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
        "train.threads=1", "data.workers=0", "train.log_every=1", "checkpoint.every=2", "checkpoint.keep=3",
        "train.heartbeat_timeout=5", "head.negatives_every=0"]


def local_names() -> List[str]:
    import psutil
    other = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127."))
    if not other:
        sys.exit("this machine has no IPv4 address besides the loopback's: horovodrun needs three local names")
    return ["127.0.0.1", "localhost", other[0]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(mode: str, data: str, work: str, steps: int, kill: int, engine: str = "horovod") -> Dict:
    run, names = os.path.join(work, "run"), local_names()
    hosts, calls = os.path.join(work, "hosts.sh"), os.path.join(work, "calls")
    if mode == "inprocess":     # the driver removes the failed host itself
        script = "".join(f"echo {n}:1\n" for n in names)
    else:                       # the wrapper's second attempt runs on the hosts that are left
        script = (f"echo x >> {calls}\nif [ $(wc -l < {calls}) -le 1 ]; then\n"
                  + "".join(f"echo {n}:1\n" for n in names) + "else\n"
                  + "".join(f"echo {n}:1\n" for n in names[:2]) + "fi\n")
    with open(hosts, "w") as f:
        f.write("#!/bin/sh\n" + script)
    os.chmod(hosts, 0o755)
    train = ["--shards", data, "--out", run, "--steps", str(steps)] + [a for s in SETS for a in ("--set", s)]
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
               HVD_PARTIALFC_FAULT=f"kill@{kill}:2", VENV=os.path.dirname(BIN), MEMORY_EVERY="0", NIC="lo",
               HOROVODRUN_ARGS="--log-level INFO")
    if engine == "torch":       # one node, 3 ranks; the relaunch: torchrun restarts all three from the checkpoint
        env.update(MAX_RESTARTS="0" if mode == "inprocess" else "1", RDZV_ENDPOINT=f"localhost:{free_port()}",
                   RDZV_CONF="join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
                   STRAGGLERS="off")
        cmd = ([sys.executable, os.path.join(ROOT, "launch", "torch_inprocess.py"), data, run, "3"]
               if mode == "inprocess" else [os.path.join(ROOT, "launch", "torchrun.sh"), data, run, "3", "1"])
        cmd += train[4:]
    elif mode == "inprocess":
        cmd = [os.path.join(ROOT, "launch", "horovodrun_elastic.sh"), data, run, hosts, "2", "3", "3"] + train[4:]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "launch", "horovod_restarts.py"), "--max-restarts", "2",
               "--discovery", hosts, "--horovodrun", os.path.join(BIN, "horovodrun"),
               "--horovodrun-args=--gloo --network-interface lo --verbose", "--", os.path.join(BIN, "hvd-partialfc"),
               "train"] + train
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    text = p.stdout + p.stderr
    if p.returncode != 0:
        raise SystemExit(f"{mode}: exit {p.returncode}\n{text[-3000:]}")
    killed_at = float(re.search(r"injected kill before step \d+ at ([\d.]+)", text).group(1))
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    resumed = int(re.search(r"resumed from \S+ at step (\d+)", text).group(1))
    before = max(r["time"] for r in rows if r["time"] <= killed_at)
    after = min(r["time"] for r in rows if r["time"] > killed_at and r["step"] > resumed)
    went_on = re.findall(r"went on in this process \(pid (\d+)\).*? in ([\d.]+) s", text)   # two ranks: one line
    started = len(re.findall(r"start worker process:|HOROVOD_RANK=\d|\[torch_inprocess\] rank \d started",
                             text)) or None
    return {"engine": engine, "mode": mode, "stall_s": round(after - before, 2),
            "kill_to_first_step_s": round(after - killed_at, 2),
            "reformed_in_s": max((float(w[1]) for w in went_on), default=None),
            "survivors_kept": len(went_on) == 2, "processes_started": started,
            "steps_redone": max(r["step"] for r in rows if r["time"] <= killed_at) - resumed,
            "wall_s": round(time.time() - t0, 1),
            **({} if len(went_on) == 2 or mode != "inprocess" else {"text": text[-6000:]})}


FLIPS = """#!{python}
import os, time
state = {state!r}
print({first!r}); print({second!r})
flips, since = (open(state).read().split() if os.path.exists(state) else ["0", str(time.time())])
flips, since = int(flips), float(since)
if flips < {cycles} and time.time() - since > {flip_s}:
    flips, since = flips + 1, time.time()
    open(state, "w").write(f"{{flips}} {{since}}")
elif not os.path.exists(state):
    open(state, "w").write(f"0 {{since}}")
if flips % 2 == 0:
    print({third!r})
"""


def sample(procs: Dict[int, List[Dict]], stop) -> None:
    """Every 0.3 s, each training rank's resources (its process found by its command line)."""
    import psutil
    while not stop.is_set():
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if "hvd-partialfc train" not in cmd or "horovodrun" in cmd or cmd.startswith("/bin/sh"):
                    continue
                with p.oneshot():
                    row = {"t": time.time(), "rss_mb": p.memory_info().rss / 2**20, "threads": p.num_threads(),
                           "fds": p.num_fds(), "sockets": len(p.net_connections("inet")),
                           "children": len(p.children(recursive=True))}
                procs.setdefault(p.info["pid"], []).append(row)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        stop.wait(0.3)


def cycles_run(data: str, work: str, steps: int, cycles: int, flip_s: float) -> Dict:
    import threading
    run, names = os.path.join(work, "run"), local_names()
    hosts = os.path.join(work, "hosts.py")
    with open(hosts, "w") as f:
        f.write(FLIPS.format(python=sys.executable, state=os.path.join(work, "state"), cycles=cycles,
                             flip_s=flip_s, first=f"{names[0]}:1", second=f"{names[1]}:1", third=f"{names[2]}:1"))
    os.chmod(hosts, 0o755)
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
               VENV=os.path.dirname(BIN), MEMORY_EVERY="0", NIC="lo", HOROVODRUN_ARGS="--log-level INFO")
    cmd = [os.path.join(ROOT, "launch", "horovodrun_elastic.sh"), data, run, hosts, "2", "3", "3", "--steps",
           str(steps)] + [a for s in SETS + ["checkpoint.every=50"] for a in ("--set", s)]
    procs: Dict[int, List[Dict]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(procs, stop), daemon=True)
    sampler.start()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT)
    stop.set()
    sampler.join()
    text = p.stdout + p.stderr
    if p.returncode != 0:
        raise SystemExit(f"cycles: exit {p.returncode}\n{text[-3000:]}")
    lines = re.findall(r"went on in this process \(pid (\d+)\): the group re-formed at (\d) ranks", text)
    counts = {int(pid): sum(1 for q, _ in lines if q == pid) for pid, _ in lines}
    old = sorted(pid for pid, n in counts.items() if n == max(counts.values()))   # in the job throughout
    out = {"reforms": max(counts.values()), "old_pids": old, "processes_started": text.count("start worker process:"),
           "samples": {str(pid): procs.get(pid, []) for pid in old}}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        times = {r["step"]: r["time"] for r in map(json.loads, filter(str.strip, f)) if "time" in r}
    regroups = sorted({int(x) for x in re.findall(r"step (\d+): the launcher changed the hosts", text)})
    ends = [times[s] for s in regroups] + [max(times.values())]
    out["regroup_steps"] = regroups
    for pid in old:   # the last sample before the first re-form, before the second, and before the run's end
        rows = procs.get(pid, [])
        at = [max((r for r in rows if r["t"] < t), key=lambda r: r["t"]) for t in (ends[0], ends[1], ends[-1])]
        out[str(pid)] = {k: [round(r[k], 1) for r in at] for k in ("rss_mb", "threads", "fds", "sockets", "children")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kill", type=int, default=6)
    ap.add_argument("--json")
    ap.add_argument("--engine", choices=("horovod", "torch"), default="horovod",
                    help="torch: launch/torch_inprocess.py beside launch/torchrun.sh (one node, --max-restarts 1)")
    ap.add_argument("--cycles", type=int, default=0, help="one job with this many host flips instead")
    ap.add_argument("--flip-s", type=float, default=6.0)
    a = ap.parse_args()
    if a.cycles:
        with tempfile.TemporaryDirectory() as tmp:
            data = shards(tmp, classes=24, per_class=30, dim=32, num_shards=6)
            res = cycles_run(data, tempfile.mkdtemp(dir=tmp), a.steps, a.cycles, a.flip_s)
        print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
        print("values: the last sample before the first re-form, before the second, before the end of training")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = shards(tmp, classes=24, per_class=30, dim=32, num_shards=6)
        for i in range(a.repeats):
            for mode in ("inprocess", "relaunch"):     # alternated: the same load for both
                work = tempfile.mkdtemp(dir=tmp)
                rows.append(one_run(mode, data, work, a.steps, a.kill, a.engine))
                print(json.dumps(rows[-1]), flush=True)
    print("\n| mode | stall (s) | kill -> first step (s) | re-formed in (s) | survivors' processes kept | processes "
          "started | steps redone |\n|---|---|---|---|---|---|---|")
    for mode in ("inprocess", "relaunch"):
        rs = [r for r in rows if r["mode"] == mode]
        span = lambda k: f"{min(r[k] for r in rs):.2f}-{max(r[k] for r in rs):.2f}"   # noqa: E731
        print(f"| {mode} | {span('stall_s')} | {span('kill_to_first_step_s')} | "
              f"{span('reformed_in_s') if rs[0]['reformed_in_s'] is not None else '-'} | "
              f"{sum(r['survivors_kept'] for r in rs)}/{len(rs)} | {sorted({r['processes_started'] for r in rs})} | "
              f"{sorted({r['steps_redone'] for r in rs})} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": rows, "engine": a.engine, "repeats": a.repeats, "steps": a.steps, "kill": a.kill}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
