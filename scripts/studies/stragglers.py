#!/usr/bin/env python
"""Stragglers (train.stragglers, run/watch/stragglers.py) measured on network-namespace nodes
(scripts/faults/twonode.py): elastic torchrun, one rank a node, CPU; the figures of docs/evidence/reliability.md
"Stragglers", against the goals in its table. Run from the repository root:

    python -m scripts.studies.stragglers --json stragglers.json [--chaos chaos.json]
    python -m scripts.studies.stragglers --show stragglers.json

Runs (``--steps`` steps at 3 ranks, an MLP on feature shards, memory snapshots every 10 steps):

* **warn**: 3 nodes, node 2's rank made ``--factor`` times slower (the ``slow`` fault: work on its step's path)
  from step ``--slow-from``: the step it is named at and the node named; the job's speed before and after.
* **evict**: the same with ``train.stragglers=evict``: the step of the eviction, the first step at 2 ranks, the
  speed after it (steps from the eviction + 20 to the end) against **clean2**, the same job on 2 nodes from the
  start over the same steps; the samples consumed against the budget, the lr against the cosine of the samples
  consumed (its largest departure, and its largest step-to-step change at the eviction against elsewhere), the
  classes of the final classifier slices; steps lost.
* **starved**: 3 nodes, node 2's rank put under a CPU quota of ``--quota`` of a core (a cgroup, from outside:
  scripts/faults/cpu_quota.py) once step ``--slow-from`` is logged, the watch at ``warn``: the step it is named at,
  the node named, its own time against the median, the job's speed before and after (as a noisy neighbour or a
  container's limit takes a node's CPU; its CPU time a step barely moves).
* **clean with loader workers**: 2 nodes, ``data.workers=2`` (each rank beside its own two workers on the 2
  cores), the watch at ``warn``: counted with the false alarms.
* **cost**: 3 clean nodes with the watch ``off`` and ``warn``, alternated ``--repeats`` times: the mean wall time
  a step after step 20 (the vote carries N more numbers, every rank times its step, rank 0 reads them); and the
  watch's own work a step measured in this process (timing, the vote's part, rank 0's reading) at N = 3 and 512.
* **false alarms**: the stragglers named in every run but the slowed and starved ones, and in a chaos run's JSON (``--chaos``:
  ``python -m scripts.faults.chaos --only torchrun --json FILE``, every other fault kind in 1,500 steps).

Needs root (namespaces; the starved run a writable cgroup cpu controller, else it is reported as not measured).
This machine: 2 cores shared by the 3 nodes. A quota of 25% of a core starves little here when other jobs load
the machine (each rank gets about that anyway); ``--quota 0.1`` was used on 2026-12-07.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from hvd_partialfc.run.watch.stragglers import read_events  # noqa: E402
from scripts.faults import cpu_quota, twonode  # noqa: E402
from scripts.faults.chaos_parts import TorchrunJob, trainers  # noqa: E402
from scripts.studies.memory_recovery import shards  # noqa: E402

BATCH = 32
PORTS = itertools.count(29500 + 10 * (os.getpid() % 40))
SETS = ["model.name=mlp", "model.embedding_dim=128", "model.kwargs={hidden_dim: 512}", f"data.batch_size={BATCH}",
        "train.threads=1", "data.workers=0", "train.log_every=1", "checkpoint.resume=auto", "checkpoint.every=50",
        "checkpoint.memory_every=10", "train.heartbeat_timeout=5", "head.negatives_every=0", "train.engine=torch",
        "train.straggler_min_nodes=2"]


def records(run: str) -> List[Dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def speed(recs: List[Dict], lo: int, hi: int) -> float:
    """Samples a second over the steps (lo, hi] (each record: a step, its world size, its time)."""
    by = {r["step"]: r for r in recs}
    done = sum(BATCH * by[s]["world_size"] for s in range(lo + 1, hi + 1))
    return done / (by[hi]["time"] - by[lo]["time"])


def job(nodes, which: List[int], data: str, run: str, steps: int, sets: List[str], work: str,
        env: Dict[int, Dict[str, str]] = None, during: Callable[[TorchrunJob], None] = None) -> Dict:
    """One elastic torchrun job (``--nnodes 2:3``) on ``which`` nodes, each its own snapshot root (logs in
    WORK/logs/RUN); the agents' exit codes and the seconds it took. ``during(job)``: called every 0.1 s while it
    runs."""
    logs = os.path.join(work, "logs", os.path.basename(run))
    os.makedirs(logs)
    argv = ["-m", "hvd_partialfc.cli", "train", "--shards", data, "--out", run, "--steps", str(steps)]
    for s in SETS + sets:
        argv += ["--set", s]
    memory = tempfile.mkdtemp(prefix="hpfc-stragglers-", dir="/dev/shm")
    j = TorchrunJob(nodes, argv, next(PORTS), logs, min_nodes=2, memory=memory, env=env)
    t0 = time.time()
    try:
        for n in which:
            j.start(n)
            time.sleep(0.3)
        while during and j.alive() and time.time() - t0 < 900:
            during(j)
            time.sleep(0.1)
        codes = j.wait(900)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    return {"codes": codes, "seconds": round(time.time() - t0, 1)}


def starve_at(run: str, node: int, step: int, quota: "cpu_quota.Quota") -> Callable[[TorchrunJob], None]:
    """A ``during`` for ``job``: once step ``step`` is logged, ``node``'s training processes under ``quota``."""
    done = []

    def during(j: TorchrunJob) -> None:
        if done or not os.path.exists(os.path.join(run, "metrics.jsonl")):
            return
        try:
            last = records(run)[-1]["step"]
        except (IndexError, ValueError):
            return
        if last >= step:
            for pid in trainers(j.nodes, node):
                quota.add(pid)
            done.append(last)
    return during


def lr_checks(run: str) -> Dict:
    """The samples consumed against the budget, the lr against the cosine of the samples consumed before each
    step, the final slices' classes."""
    from hvd_partialfc.run_files import read_meta, resolve_checkpoint
    meta = read_meta(resolve_checkpoint(run))
    budget, recs = meta["length"]["budget_samples"], records(run)
    seen, worst, steps = 0, 0.0, []
    for r in recs:
        worst = max(worst, abs(r["lr"] - 0.1 * 0.5 * (1 + math.cos(math.pi * seen / budget))))
        seen += BATCH * r["world_size"]
    slices = meta["slices"]
    changes = [abs(a["lr"] - b["lr"]) for a, b in zip(recs, recs[1:])]
    at = next(i for i, r in enumerate(recs) if r["world_size"] != recs[0]["world_size"])
    return {"samples": meta["length"]["samples"], "budget": budget, "lr_off_cosine": worst,
            "lr_change_at_eviction": changes[at - 1], "lr_change_largest_elsewhere": max(changes[:at - 1] + changes[at:]),
            "slices": slices, "classes_once": [a for s in slices for a in range(*s)] == list(range(meta["num_classes"])),
            "steps_redone": len(recs) - len({r["step"] for r in recs})}


def watch_cost(n: int, steps: int = 3000) -> float:
    """Seconds a step of rank 0's watch (its timing, its part of the vote and that part as a tensor, the reading and
    the detector) at N ranks, in this process."""
    import torch
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.engine.local import LocalComm
    from hvd_partialfc.engine.vote import Agreed, Ballot, StepVote
    from hvd_partialfc.run.watch.stragglers import Stragglers
    cfg = load_config(None, ["data.shards=x", f"out={tempfile.mkdtemp()}"])
    watch = Stragglers(cfg, LocalComm(0, n), 0, lambda line: None, False, [f"n{i}" for i in range(n)], list(range(n)))
    vote = StepVote(watch.comm, [watch])
    times = [0.01 + 1e-5 * i for i in range(n)]
    t0 = time.perf_counter()
    for s in range(steps):
        watch.begin(s)
        watch.end(s, {"data_time": 0.0})
        ballot = Ballot(vote.places, vote.length, 0)
        watch.cast(ballot, s + 1)
        torch.tensor([0.0, 0.0, 0.0] + ballot.values, dtype=torch.float64)   # what the vote sends (its 3 flags: there anyway)
        values = list(ballot.values)
        times_at = vote.places["times"].start
        values[times_at:times_at + n] = times                                 # every rank's times, as the vote's max
        watch.heard(Agreed(vote.places, values), s + 1)
    return (time.perf_counter() - t0) / steps


def study(a, work: str) -> Dict:
    data = shards(work, 600, 24, 64, 6)
    slow = {2: {"HVD_PARTIALFC_FAULT": f"slow@{a.slow_from}", "HVD_PARTIALFC_SLOW_FACTOR": str(a.factor)}}
    out: Dict = {"steps": a.steps, "slow_from": a.slow_from, "factor": a.factor, "evict": [], "clean2": [],
                 "cost": {"off": [], "warn": []}}
    with twonode.Nodes(3, suffix=twonode.owner_suffix(), prefix="hpfcs") as nodes:
        def one(name, sets, which, env=None, during=None):
            run = os.path.join(work, name)
            res = job(nodes, which, data, run, a.steps, sets, work, env, during)
            recs, events = records(run), read_events(run)
            res.update(events=events, worlds=sorted({r["world_size"] for r in recs}), last_step=recs[-1]["step"],
                       named=[e for e in events if e["event"] == "named"])
            print(f"{name}: {res['seconds']} s, exit {res['codes']}", flush=True)
            return res, recs
        res, recs = one("warn", [], [1, 2, 3], slow)
        out["warn"] = dict(res, speed_before=speed(recs, 20, a.slow_from),
                           speed_slow=speed(recs, a.slow_from + 20, recs[-1]["step"]))
        try:
            quota = cpu_quota.Quota(a.quota, f"hpfc-stragglers-{os.getpid()}")
        except cpu_quota.Unavailable as e:
            out["starved"] = {"unavailable": str(e)}
        else:
            try:
                res, recs = one("starved", [], [1, 2, 3], during=starve_at(os.path.join(work, "starved"), 2,
                                                                             a.slow_from, quota))
            finally:
                quota.close()
            out["starved"] = dict(res, quota=a.quota, speed_before=speed(recs, 20, a.slow_from),
                                  speed_starved=speed(recs, a.slow_from + 20, recs[-1]["step"]))
        res, recs = one("clean-workers", ["data.workers=2"], [1, 2])
        out["clean_workers"] = res
        for rep in range(a.repeats):     # alternated: the machine's other load changes over minutes
            res, recs = one(f"evict-{rep}", ["train.stragglers=evict"], [1, 2, 3], slow)
            ev = [e for e in res["events"] if e["event"] == "evicted"]
            res.update(evicted_at=ev[0]["step"] if ev else None,
                       first_step_at_2=next((r["step"] for r in recs if r["world_size"] == 2), None),
                       speed_before=speed(recs, 20, a.slow_from))
            lo = res["first_step_at_2"] + 20
            res["speed_after"] = speed(recs, lo, recs[-1]["step"])
            res.update(lr_checks(os.path.join(work, f"evict-{rep}")))
            out["evict"].append(res)
            res, recs = one(f"clean2-{rep}", [], [1, 2])
            res["speed"] = speed(recs, lo, min(recs[-1]["step"], out["evict"][-1]["last_step"]))
            out["clean2"].append(res)
            for mode in ("off", "warn"):
                res, recs = one(f"cost-{mode}-{rep}", [f"train.stragglers={mode}"], [1, 2, 3])
                out["cost"][mode].append((recs[-1]["time"] - recs[19]["time"]) / (len(recs) - 20))
                out["cost"].setdefault("named", []).extend(res["named"])
    out["cost"]["watch_s"] = {n: watch_cost(n) for n in (3, 512)}
    if a.chaos:
        with open(a.chaos) as f:
            torchrun = [r for r in json.load(f) if r["run"] == "torchrun"][0]
        out["chaos"] = {"seed": torchrun["seed"], "steps": torchrun["steps"], "faults": [r["kind"] for r in torchrun["rows"]],
                        "named": torchrun["checks"].get("stragglers_named"),
                        "false": torchrun["checks"].get("false_stragglers"), "passed": torchrun["passed"]}
    return out


def _median(xs: List[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def starved_row(r: Dict):
    """The starved node's row: named (when, whom, how far above the median) and what it cost the job."""
    st = r.get("starved") or {"unavailable": "not run"}
    goal = "named, node 2"
    what = "3 nodes, node 2 under a CPU quota of %s of a core from step %d: detected" % (st.get("quota", "-"), r["slow_from"])
    if "unavailable" in st:
        return what, goal, f"not measured: {st['unavailable']}"
    named = st["named"][0] if st["named"] else None
    if not named:
        return what, goal, f"not named (speed before {st['speed_before']:.0f}, starved {st['speed_starved']:.0f} samples/s)"
    others = [e for e in st["named"][1:]]
    return what, goal, (f"named at step {named['step']} ({named['step'] - r['slow_from']} steps), rank {named['rank']} on "
                        f"{named['node']}, {named['own_s'] / named['median_s']:.2f}x the median, since step "
                        f"{named['since']}; the job's speed {st['speed_before']:.0f} -> {st['speed_starved']:.0f} "
                        f"samples/s; other names: {len(others)}")


def table(r: Dict) -> str:
    w, ev, c2, cost = r["warn"], r["evict"], r["clean2"], r["cost"]
    named = w["named"][0] if w["named"] else {}
    e = ev[0]
    off, on = (_median(cost[m]) for m in ("off", "warn"))
    after, clean = [x["speed_after"] for x in ev], [x["speed"] for x in c2]
    cw = r.get("clean_workers")
    false = len(cost.get("named", [])) + sum(len(x["named"]) for x in c2) + (len(cw["named"]) if cw else 0)
    evicted = ", ".join(f"{x['evicted_at']} / {x['first_step_at_2']}" for x in ev)
    nodes = sorted({x["named"][0]["node"] for x in ev if x["named"]} | ({named["node"]} if named else set()))
    rows = [
        ("3 nodes, node 2 at 1/%g speed from step %d: detected" % (r["factor"], r["slow_from"]), "within 20 steps, naming node 2",
         f"named at step {named.get('step')} ({named.get('step', 0) - r['slow_from']} steps), rank {named.get('rank')} on "
         f"{named.get('node')}, {named.get('own_s', 0) / max(named.get('median_s', 1), 1e-12):.2f}x the median, since "
         f"step {named.get('since')}; every run named {', '.join(nodes)}, at steps "
         f"{', '.join(str(x['named'][0]['step']) for x in [w] + ev if x['named'])}"),
        starved_row(r),
        ("with evict: the job runs on 2 nodes", "from step <= 140",
         f"evicted at step / first step at 2 ranks: {evicted}"),
        ("its speed after the eviction", ">= 0.9x a clean 2-node job's",
         f"{_median(after):.0f} against {_median(clean):.0f} samples/s: {_median(after) / _median(clean):.2f}x (medians of "
         f"{len(ev)} alternated pairs; each: {', '.join(f'{x:.0f}/{y:.0f}' for x, y in zip(after, clean))}); "
         f"the 3 nodes before: {e['speed_before']:.0f}, with the straggler (warn): {w['speed_slow']:.0f}"),
        ("samples consumed, lr curve, final rows", "exactly the budget; no lr jump; every class once",
         f"{e['samples']:,} of {e['budget']:,} in every run: {all(x['samples'] == x['budget'] for x in ev)}; the lr at "
         f"most {max(x['lr_off_cosine'] for x in ev):.1e} off the cosine of the samples consumed (its change at the "
         f"eviction {e['lr_change_at_eviction']:.2e}, largest elsewhere {e['lr_change_largest_elsewhere']:.2e}); "
         f"slices {e['slices']}, every class once: {all(x['classes_once'] for x in ev)}; steps redone: "
         f"{sum(x['steps_redone'] for x in ev)}"),
        ("no straggler: false alarms", "0", f"{false} in {len(cost['warn']) + len(c2) + bool(cw)} clean runs with the "
         f"watch on ({r['steps']} steps; {'one of them 2 nodes with 2 loader workers a rank' if cw else 'no run with loader workers'})"
         + (f"; chaos seed {r['chaos']['seed']} ({r['chaos']['steps']} steps, {len(r['chaos']['faults'])} faults: "
            f"{', '.join(sorted(set(r['chaos']['faults'])))}): {len(r['chaos']['false'])} named by no slow fault, "
            f"{r['chaos']['named']} named in all" if r.get("chaos") else "")),
        ("detection's cost, every step", "<= 0.5% of the step",
         f"{1e6 * cost['watch_s']['3']:.0f} us a step on rank 0 at N = 3 ({100 * cost['watch_s']['3'] / off:.2f}% of "
         f"{1e3 * off:.1f} ms), {1e6 * cost['watch_s']['512']:.0f} us at N = 512; the wall time a step with the watch "
         f"off / warn: {1e3 * off:.2f} / {1e3 * on:.2f} ms ({100 * (on / off - 1):+.1f}%; medians of {len(cost['off'])} "
         f"alternated runs: {', '.join(f'{1e3 * x:.1f}/{1e3 * y:.1f}' for x, y in zip(cost['off'], cost['warn']))})"),
    ]
    return "| check | goal | measured |\n|---|---|---|\n" + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--slow-from", type=int, default=100)
    ap.add_argument("--factor", type=float, default=2.0, help="the slow node's ranks take this many times their work")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quota", type=float, default=0.25, help="the starved node's share of one core")
    ap.add_argument("--chaos", metavar="JSON", help="a chaos run's report (scripts.faults.chaos --json): its false alarms")
    twonode.study_options(ap)
    a = ap.parse_args(argv)
    done = twonode.study_preamble(a, "stragglers", table)
    if done is not None:
        return done
    work = a.work or tempfile.mkdtemp(prefix="hpfc-stragglers-")
    os.makedirs(work, exist_ok=True)
    report = study(a, work)
    report["command"] = " ".join(["python", "-m", "scripts.studies.stragglers", *(argv or sys.argv[1:])])
    report["date"] = time.strftime("%Y-%m-%d")
    report = json.loads(json.dumps(report, default=str))
    twonode.study_report(a, report, table)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
