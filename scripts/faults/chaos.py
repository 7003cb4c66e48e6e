#!/usr/bin/env python
"""The chaos run: many faults at random steps of one training run, on network-namespace nodes
(scripts/faults/twonode.py), recovered by the project's own launch paths, with a table of what each fault cost.
Run from the repository root:

    python -m scripts.faults.chaos --seed 1            # both runs, the figures in docs/evidence/reliability.md
    python -m scripts.faults.chaos --seed 1 --short    # the suite's version: 3 faults, under a minute
    python -m scripts.faults.chaos --seed 2 --only torchrun --steps 1500 --faults 12 --json chaos.json

Needs root (network namespaces, a tmpfs); exit 0 when every check holds, 1 otherwise, 2 when it cannot run.

Two runs, each seeded (fault steps, kinds, nodes, the damaged sample all come from ``--seed``):

* **torchrun** (elastic, ``--nnodes 2:3``, one rank a node, restarts allowed, ``train.stragglers=evict``):
  every kind of fault.
  - ``kill-rank``: a rank SIGKILLed; ``node-lost``: every process of a node killed; ``node-joins``: a
    lost node's agent starts again; ``link-cut``: a node's link goes down, the others go on without it,
    the link comes back and the node with it; ``sigterm-requeue``: the scheduler's SIGTERM to every agent,
    then the job started again (``--resume auto``); ``disk-full``: the run folder's tmpfs filled just after
    a checkpoint, so the next one fails (training goes on: docs/reliability.md, "A full disk"), then emptied; ``bad-sample``: a sample of a shard truncated (found
    when its rank next opens the shard, skipped and named: ``data.on_bad_sample: skip``); ``slow``: a node's
    ranks made twice as slow by work on their step's path (run/watch/faults.py, through the node's fault file), named
    as a straggler and evicted (run/watch/stragglers.py): the others go on without it; the node, repaired, may join
    again.
  - Checked: the run ends with its budget of samples consumed to within one global batch (run/progress.py),
    every checkpoint left is complete and loads, ``latest`` was valid after every fault, the damaged sample
    was named, no rank was named a straggler but the slow node's while it was slow (checkpoints, evaluations,
    restarts and the other faults name none), and with memory snapshots a fault that restarts the job costs at
    most 2 K steps (``--memory-every K``: docs/reliability.md, "Memory snapshots").
* **horovod** (launch/horovod_restarts.py on 2 nodes): the faults that keep the world size (kill-rank,
  link-cut, sigterm-requeue, disk-full). Checked: the final backbone (BatchNorm statistics included),
  classifiers and optimizer states equal a fault-free run of the same seed (``simulate --ranks 2``, the
  same numbers as horovodrun: tests/test_simulate.py), bitwise; ``latest`` valid after every fault; the
  wrapper's exit on preemption is 75.

Each fault row: its kind, the step it hit, the seconds until training went on (the first step logged after
the resume), the steps lost (done, then done again), the world size before and after.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

from hvd_partialfc.run.watch.stragglers import read_events
from scripts.faults import twonode
from scripts.faults.chaos_parts import (ROOT, ChaosError, TorchrunJob, Watch, WrapperJob, checkpoint_ok, digests,
                                        fill_disk, kill, make_undecodable, tiny_faces)
from scripts.faults.chaos_report import found_damaged, row_line, table, tails, unexplained_stragglers

TORCH_KINDS = ("kill-rank", "node-lost", "link-cut", "sigterm-requeue", "disk-full", "bad-sample", "node-joins",
               "slow")
HOROVOD_KINDS = ("kill-rank", "link-cut", "sigterm-requeue", "disk-full")
SHORT_KINDS = ("node-lost", "node-joins", "bad-sample")     # --short: torchrun, 3 faults
# --short's train.steps: after the last fault (a join, planned by step 180) the two ranks left go on while the
# joining agent starts (~150 steps at 2 ranks, loaded or not), and the three must log a step before the end
SHORT_STEPS = 320
RESTARTING = ("kill-rank", "node-lost", "link-cut", "slow")   # the job restarts from memory or disk
DOWN, ALL_UP = {"node-lost": -1, "slow": -1, "node-joins": 1}, ("node-lost", "link-cut", "slow")
EVERY = 20          # checkpoint.every
TAIL = 500          # steps after the last fault
TRAIN = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 32}", "data.batch_size=8",
         "train.log_every=1", "train.threads=1", "data.workers=0", "checkpoint.resume=auto",
         f"checkpoint.every={EVERY}", "checkpoint.keep=4", "train.heartbeat_timeout=3", "head.negatives_every=0",
         "train.seed=7", "data.max_bad_samples=10"]
# torchrun's: the slow node evicted, never below --nnodes' minimum; a second slow fault after a node joined back
STRAGGLERS = ["train.stragglers=evict", "train.straggler_min_nodes=2", "train.straggler_cooldown=100"]


# --- the plan ---------------------------------------------------------------------------------------------

def plan(seed: int, kinds: Sequence[str], count: int, steps: int, nodes: int) -> List[Tuple[int, str]]:
    """``count`` (step, kind) pairs: every kind once, then the kinds again as evenly as they go (no kind more
    than ceil(count / kinds) times), in a random order where each fault is possible when it comes (a node is
    lost, cut or slowed while all are up; one joins while one is down) and the damaged sample is not last (its
    rank finds it when it next opens the shard: a later fault's restart). Steps at least ``gap`` apart, the
    last ``TAIL`` steps before the end (a fault's effect, a restart, takes seconds: at ~40 steps/s a shorter
    tail could end the run first).

    The order is built a fault at a time (a depth-first search, the kinds tried in a random order at each
    place), so every seed plans. Before, the kinds were drawn once and then only shuffled: a draw with more
    node losses than joins could fit has no possible order, and 50 of the seeds 11-199 had none."""
    rng = np.random.default_rng(seed)
    lo, hi = 3 * EVERY, max(3 * EVERY + 2 * EVERY * count, steps - TAIL)
    gap = max(EVERY, (hi - lo) // (2 * count))
    # count steps of [lo, hi) at least gap apart, uniformly among all such sets: drawn from a range shortened by
    # the gaps, each then moved up by the gaps before it
    picked = np.sort(rng.choice(hi - lo - (count - 1) * (gap - 1), size=count, replace=False))
    at = [lo + int(x) + i * (gap - 1) for i, x in enumerate(picked)]
    cap = -(-count // len(kinds))

    def extend(order: List[str], up: int) -> bool:
        if sum(1 for k in kinds if k not in order) > count - len(order):   # every kind once
            return False
        if len(order) == count:
            return order[-1] != "bad-sample"
        for kind in (str(k) for k in rng.permutation(list(kinds))):
            if order.count(kind) >= cap or (kind in ALL_UP and up < nodes) or (kind == "node-joins" and up == nodes):
                continue
            order.append(kind)
            if extend(order, up + DOWN.get(kind, 0)):
                return True
            order.pop()
        return False
    order: List[str] = []
    if not extend(order, nodes):
        raise ChaosError(f"no order of {count} faults of {', '.join(kinds)} is possible on {nodes} nodes")
    return list(zip(at, order))


# --- the faults ---------------------------------------------------------------------------------------------

class Run:
    """One run under chaos: its nodes, job, watch and what the faults did."""

    def __init__(self, name, nodes, job, watch: Watch, run_dir: str, mount: str, shards: str, seed: int):
        self.name, self.nodes, self.job, self.watch = name, nodes, job, watch
        self.run_dir, self.mount, self.shards = run_dir, mount, shards
        self.rng = np.random.default_rng(seed + 1000)
        self.up = set(nodes.node_ids)
        self.rows: List[Dict] = []
        self.damaged: List[str] = []
        self.preempt_codes: List[int] = []

    def _recovered(self, t0: float, world: int, timeout: float = 150.0) -> Tuple[int, int, float, int]:
        """Wait for a resume after ``t0`` and a step logged after it at ``world`` ranks (0: any). (resumed step,
        world size, seconds from t0 until training went on, steps lost)."""
        w = self.watch
        box = {}

        def done():
            for t, step, _ in w.resumes(t0):
                rec = w.went_on(step, t)
                if rec and (not world or rec.get("world_size") == world):
                    box.update(step=step, rec=rec, t=t)
                    return True
            return False
        w.wait(done, timeout, f"{self.name}: training going on after the fault" + (f" at {world} ranks" if world else ""))
        # rank 0 appends a record a step: the one before the first of the resumed run is the last step the
        # old run did (after the fault too, until it noticed it)
        i = next(i for i, r in enumerate(w.records) if r is box["rec"])
        before = w.records[i - 1]["step"] if i else 0
        return box["step"], box["rec"].get("world_size", 0), box["rec"]["time"] - t0, max(0, before - box["step"])

    def inject(self, kind: str) -> Dict:
        w = self.watch
        w.poll()
        row = {"kind": kind, "step": w.step, "world_before": w.world, "detail": ""}
        t0 = time.time()
        getattr(self, "_" + kind.replace("-", "_"))(row, t0)
        ok, step, why = checkpoint_ok(self.run_dir)
        row.update(latest_ok=ok, latest=step, latest_why=why)
        self.rows.append(row)
        return row

    def _went_on(self, row, t0, world=0):
        step, after, seconds, lost = self._recovered(t0, world)
        row.update(resumed=step, world_after=after, seconds=round(seconds, 1), lost=lost,
                   source="memory" if self.watch.resumed_from_memory(step, t0) else "disk")

    def _kill_rank(self, row, t0):
        node = int(self.rng.choice(sorted(self.up)))
        pids = self.job.workers(node)
        if not pids:
            raise ChaosError(f"no rank found on node {node}")
        kill(pids[0])
        row["detail"] = f"node {node}"
        self._went_on(row, t0, len(self.up))

    def _node_lost(self, row, t0):
        node = int(self.rng.choice(sorted(self.up - {1})))
        self.nodes.kill_node(node)
        self.job.lose_memory(node)
        self.up.discard(node)
        self.job.forget(node)
        row["detail"] = f"node {node}"
        self._went_on(row, t0, len(self.up))

    def _node_joins(self, row, t0):
        node = int(self.rng.choice(sorted(set(self.nodes.node_ids) - self.up)))
        self.nodes.kill_node(node)                     # whatever a lost node left behind
        self.job.start(node)
        self.up.add(node)
        row["detail"] = f"node {node}"
        self._went_on(row, t0, len(self.up))

    def _link_cut(self, row, t0):
        node = int(self.rng.choice(sorted(self.up - {1})))
        self.nodes.cut(node=node)
        row["detail"] = f"node {node}"
        if isinstance(self.job, WrapperJob):           # the ranks end (heartbeat), then the link comes back
            self.watch.wait(lambda: not any(self.job.workers(n) for n in self.nodes.node_ids), 60,
                            "the ranks ending after the cut")
            self.nodes.restore()
            self._went_on(row, t0, len(self.up))
            return
        self._went_on(row, t0, len(self.up) - 1)       # the others go on without it
        during = row["world_after"]
        self.nodes.restore()
        t1 = time.time()
        try:                                           # its agent comes back into the job by itself ...
            self._recovered(t1, len(self.up), timeout=10)
        except ChaosError:                             # ... or it gave up: the node is started again
            self.nodes.kill_node(node)
            self.job.start(node)
            self._recovered(time.time(), len(self.up))
            row["detail"] += ", its agent restarted"
        row["world_after"] = f"{during} -> {len(self.up)}"

    def _sigterm_requeue(self, row, t0):
        if isinstance(self.job, WrapperJob):           # one rank gets it; every rank checkpoints; exit 75
            node = int(self.rng.choice(sorted(self.up)))
            kill(self.job.workers(node)[0], signal.SIGTERM)
            codes = self.job.wait(90)
            row["detail"] = f"a rank on node {node}; the wrapper exited {codes[1]}"
        else:                                          # the scheduler's SIGTERM to every agent
            self.job.signal_all(signal.SIGTERM)
            codes = self.job.wait(90)
            row["detail"] = f"every agent; they exited {sorted(set(codes.values()))}"
        self.preempt_codes += list(codes.values())
        self.watch.poll()
        stopped = self.watch.said("stopped by", t0)
        row["detail"] += f"; {len(stopped)} ranks said 'stopped by'"
        self.job.requeue(self.up)
        self._went_on(row, t0, len(self.up))

    def _disk_full(self, row, t0):
        w = self.watch
        ok, last, _ = checkpoint_ok(self.run_dir)
        w.wait(lambda: w.step >= last + 1, 60, "a step after the last checkpoint")
        # room for half the last checkpoint: the next one fails at once (a fixed 256 KB let a 2-rank run's
        # small checkpoints through for 780 steps, its pruning freeing room for each next one)
        from hvd_partialfc.run_files import folder_bytes, resolve_checkpoint
        fill = fill_disk(self.mount, leave_bytes=folder_bytes(resolve_checkpoint(self.run_dir)) // 2)
        t0 = time.time()
        w.poll()
        row["step"] = w.step
        w.wait(lambda: bool(w.said("not written", t0)), 120, "the checkpoint failing on the full disk",
               alive=self.job.alive)
        os.remove(fill)
        line = w.said("not written", t0)[0]
        failed = re.search(r"step (\d+): checkpoint not written", line) or re.search(r"checkpoint of step (\d+)", line)
        at = int(failed.group(1)) if failed else w.step
        row["detail"] = f"the checkpoint of step {at} failed"
        if "training goes on" not in line:     # checkpoint.on_write_error=stop: every rank exits 2, the job requeued
            if isinstance(self.job, WrapperJob):
                codes = self.job.wait(90)
                row["detail"] += f"; the wrapper exited {codes[1]}, requeued"
                self.job.requeue()
            self._went_on(row, t0, len(self.up))
            return
        # training goes on in the same processes (docs/reliability.md, "A full disk"): the step after the failed
        # checkpoint, logged after the failure, is where it went on; nothing is done twice
        w.wait(lambda: w.went_on(at, t0) is not None, 120, f"step {at + 1} after the failed checkpoint",
               alive=self.job.alive)
        row.update(resumed=at, world_after=w.world, seconds=round(w.went_on(at, t0)["time"] - t0, 1), lost=0,
                   source="went on")
        row["detail"] += ", training went on (no restart)"

    def _slow(self, row, t0):
        """A node's ranks made twice as slow from now (its fault file): named, evicted, the job on without it; then
        the node is repaired (the file removed) and down, for a node-joins to bring back."""
        node = int(self.rng.choice(sorted(self.up - {1})))
        host = self.nodes.hostname(node)
        self.job.make_slow(node, True)
        row.update(detail=f"node {node}", slow_host=host, slow_from=t0)

        def events(kind):
            return [e for e in read_events(self.run_dir) if e.get("event") == kind and e.get("node") == host
                    and e["time"] >= t0]
        self.watch.wait(lambda: bool(events("evicted")), 180, f"node {node} evicted as a straggler", alive=self.job.alive)
        named, evicted = events("named")[0], events("evicted")[0]
        row.update(named=named["step"], since=named["since"], evicted=evicted["step"], slow_until=evicted["time"])
        self.up.discard(node)
        self.job.forget(node)                          # its agent leaves the job by itself
        self._went_on(row, t0, len(self.up))
        self.job.make_slow(node, False)
        row["detail"] += (f", named at step {named['step']} (slow since step {named['since']}), evicted at step "
                          f"{evicted['step']}")

    def _bad_sample(self, row, t0):
        where = make_undecodable(self.shards, self.rng)
        self.damaged.append(where)
        row.update(detail=where, seconds=0.0, lost=0, world_after=self.watch.world, resumed=None)


# --- the runs -----------------------------------------------------------------------------------------------

def _mount_tmpfs(path: str, size_mb: int) -> None:
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path], capture_output=True, text=True)
    if p.returncode != 0:
        raise twonode.Unavailable(f"cannot mount a tmpfs: {p.stderr.strip()}")


def run_one(name: str, seed: int, steps: int, kinds: Sequence[str], count: int, work: str,
            quiet: bool = False, memory_every: int = 0) -> Dict:
    """One run under chaos (``count`` faults of ``kinds``); its report (rows, checks, passed). ``memory_every``:
    memory snapshots (torchrun only: each node its own root, emptied when the node is lost)."""
    nodes = twonode.Nodes(3 if name == "torchrun" else 2, suffix=twonode.owner_suffix(), prefix=f"hpfc{name[0]}")
    base = os.path.join(work, name)
    shards, mount, logs = (os.path.join(base, d) for d in ("shards", "mnt", "logs"))
    os.makedirs(logs, exist_ok=True)
    tiny_faces(shards)
    run_dir = os.path.join(mount, "run")
    memory_every = memory_every if name == "torchrun" else 0
    sets = TRAIN + (STRAGGLERS if name == "torchrun" else []) + [
                    f"data.on_bad_sample={'skip' if name == 'torchrun' else 'stop'}",
                    f"checkpoint.memory_every={memory_every}"]
    argv = ["-m", "hvd_partialfc.cli", "train", "--shards", shards, "--out", run_dir, "--steps", str(steps)]
    for s in sets:
        argv += ["--set", s]
    schedule = plan(seed, kinds, max(count, len(kinds)), steps, nodes.count)
    report = {"run": name, "seed": seed, "steps": steps, "plan": schedule, "rows": [], "checks": {},
              "memory_every": memory_every}
    # what the faults' checks import, before the job starts: imported at the first fault (torch: seconds under
    # load) it held the driver while the ranks trained, and every later fault came ~100 steps after its plan
    for module in ("h5py", "torch"):
        importlib.import_module(module)
    _mount_tmpfs(mount, 24)
    t_start, job = time.time(), None
    try:
        nodes.setup()
        watch = Watch(run_dir, logs)
        if name == "torchrun":
            job = TorchrunJob(nodes, argv, 29600 + seed % 100, logs, min_nodes=2,   # the nodes' memory: a tmpfs
                              memory=tempfile.mkdtemp(prefix="hpfc-chaos-", dir="/dev/shm") if memory_every else None)
            for n in nodes.node_ids:
                job.start(n)
                time.sleep(0.3)
        else:
            job = WrapperJob(nodes, [sys.executable, *argv], logs, base)
            job.start()
        run = Run(name, nodes, job, watch, run_dir, mount, shards, seed)
        settle = 0
        for at, kind in schedule:
            # the planned step, and a checkpoint written by the world the last fault left (a fault that came
            # back to back would only ever see the previous one's first step)
            watch.wait(lambda: watch.step >= max(at, settle), 300, f"step {max(at, settle)}", alive=job.alive)
            row = run.inject(kind)
            watch.poll()
            settle = watch.step + EVERY + 1
            report["rows"].append(row)
            if not quiet:
                print(row_line(row), flush=True)
        codes = job.wait(600)
        report["checks"] = final_checks(run, codes, argv, work)
        if memory_every:   # the steps since the last snapshot (< K), and up to K more while it lands (memory.py)
            lost = [r["lost"] for r in report["rows"] if r["kind"] in RESTARTING]
            report["checks"].update(most_lost=max(lost, default=0), ok_steps_lost_at_most_2K=all(
                x <= 2 * memory_every for x in lost))
    except (ChaosError, twonode.Unavailable) as e:
        report["checks"]["error"] = str(e)
    finally:
        nodes.teardown()
        report["log_tail"] = tails(logs)
        keep = os.path.join(base, "run")
        if os.path.isdir(run_dir):
            shutil.copytree(run_dir, keep, dirs_exist_ok=True)
        subprocess.run(["umount", "-l", mount], check=False)
        if getattr(job, "memory", None):
            shutil.rmtree(job.memory, ignore_errors=True)
    report["seconds"] = round(time.time() - t_start, 1)
    report["passed"] = not report["checks"].get("error") and all(
        v is True for k, v in report["checks"].items() if k.startswith("ok_"))
    return report


def final_checks(run: Run, codes: Dict[int, int], argv: List[str], work: str) -> Dict:
    from hvd_partialfc.run_files import list_checkpoints, read_meta
    checks: Dict = {"exit_codes": codes, "ok_job_ended_well": all(c == 0 for c in codes.values())}
    ok, step, why = checkpoint_ok(run.run_dir)
    checks.update(final_step=step, ok_latest_valid=ok, ok_latest_after_every_fault=all(r["latest_ok"] for r in run.rows))
    bad = []
    for name in list_checkpoints(run.run_dir):
        path = os.path.join(run.run_dir, "checkpoints", name)
        try:
            read_meta(path)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{name}: {e}")
    checks.update(checkpoints_kept=len(list_checkpoints(run.run_dir)), ok_every_checkpoint_loads=not bad, bad=bad)
    meta = read_meta(os.path.join(run.run_dir, "checkpoints", list_checkpoints(run.run_dir)[-1]))
    length = meta["length"]
    g = length["segments"][-1]["global_batch"]
    checks.update(samples=length["samples"], budget=length["budget_samples"], last_global_batch=g,
                  worlds=[s["world_size"] for s in length["segments"]],
                  ok_budget_consumed=abs(length["samples"] - length["budget_samples"]) <= g)
    named = [e for e in read_events(run.run_dir) if e.get("event") == "named"]
    false = unexplained_stragglers(named, run.rows)
    checks.update(stragglers_named=len(named), false_stragglers=false, ok_no_false_stragglers=not false)
    if run.name == "torchrun":
        found = found_damaged(run)
        checks.update(damaged=run.damaged, named=found, ok_damaged_sample_named=len(found) == len(run.damaged))
    else:
        checks["ok_preemption_exit_75"] = bool(run.preempt_codes) and all(c == 75 for c in run.preempt_codes)
        ref = os.path.join(work, "horovod", "reference")
        cmd = [sys.executable, "-m", "hvd_partialfc.cli", "simulate", "--ranks", "2"] + \
            [a if a != run.run_dir else ref for a in argv[3:]]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            checks["reference_error"] = p.stderr[-2000:]
        mine, theirs = digests(run.run_dir), (digests(ref) if p.returncode == 0 else {})
        checks.update(digests=mine, reference=theirs, ok_bitwise_fault_free=bool(theirs) and mine == theirs)
    return checks


def without_machine_paths(text: str, work: str) -> str:
    """The report as it may be committed (docs/results/): the work folder, the environment and the repository named
    by what they are (WORK, VENV, .), not by where they lay on this machine (the logs' tails hold tracebacks)."""
    places = [(os.path.realpath(work), "WORK"), (work, "WORK")]
    if not os.path.realpath(sys.prefix).startswith(os.path.realpath(ROOT) + os.sep):
        places.append((sys.prefix, "VENV"))
    for path, name in places + [(os.path.realpath(ROOT), "."), (ROOT, ".")]:
        text = text.replace(path, name)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1500, help="train.steps (at the run's first world size)")
    ap.add_argument("--faults", type=int, default=12, help="faults in the torchrun run (the Horovod one: 6)")
    ap.add_argument("--only", choices=["torchrun", "horovod"])
    ap.add_argument("--short", action="store_true",
                    help=f"the suite's version: {SHORT_STEPS} steps, 3 faults, torchrun")
    ap.add_argument("--memory-every", type=int, default=0, metavar="K",
                    help="checkpoint.memory_every in the torchrun run (0: off); a fault that restarts the job then "
                         "costs at most 2 K steps (K since the last snapshot, up to K more while it lands)")
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--work", help="keep the shard sets, logs and runs here (default: a temporary folder)")
    ap.add_argument("--show", metavar="JSON", help="print the tables of a --json report again, and run nothing")
    a = ap.parse_args(argv)
    if a.show:
        with open(a.show) as f:
            print("\n".join(table(r) for r in json.load(f)))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the nodes and the tmpfs go on the way out
    reason = twonode.unavailable_reason()
    if reason:
        print(f"chaos: cannot run: {reason}", file=sys.stderr)
        return 2
    work = a.work or tempfile.mkdtemp(prefix="hpfc-chaos-")
    runs = [a.only] if a.only else ["torchrun", "horovod"]
    if a.short:
        runs, a.steps = ["torchrun"], SHORT_STEPS
    reports = []
    for name in runs:
        if a.short:
            kinds, count = SHORT_KINDS, len(SHORT_KINDS)
        elif name == "torchrun":
            kinds, count = TORCH_KINDS, a.faults
        else:
            kinds, count = HOROVOD_KINDS, min(a.faults, 6)
        report = run_one(name, a.seed, a.steps, kinds, count, work, memory_every=a.memory_every)
        print(table(report), flush=True)
        reports.append(report)
    if a.json:
        with open(a.json, "w") as f:
            f.write(without_machine_paths(json.dumps(reports, indent=1, default=str), work))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["passed"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
