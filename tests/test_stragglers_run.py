"""A straggler under real elastic torchrun (run/watch/stragglers.py): two agents on this host (``--nnodes 1:2``, a node
each, each its own memory-snapshot root, two ranks each), the first serving the rendezvous store. From outside
while it trains: the store's node's second rank is put under a 20% CPU quota (a cgroup, scripts/faults/cpu_quota.py;
where none can be set, this part is left out and said), and once it is named, the other node's second rank is made
three times as slow by the ``slow`` fault (its node's fault file). The starved rank is named, its node not evicted
(it serves the store); the slow one is named (its rank and node, since which step), its node evicted
(``train.stragglers=evict``, ``straggler_min_nodes=1``): an agreed memory snapshot, both of the node's ranks
ignore SIGTERM before their agent is stopped and exit 76, the others exit 75 and their agent restarts them alone,
from that snapshot, re-sharded. No step is lost, the budget of samples is consumed exactly, the lr goes on from
the samples consumed, every class is in the classifier left, and ``info`` lists the events. The store's node is
found (said at start). The detector's logic and the eviction's order are tests/test_stragglers.py; the
network-namespace version is the chaos run's ``slow`` fault (scripts/faults/chaos.py) and
scripts/studies/stragglers.py."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import time

import pytest

from conftest import ROOT, TORCHRUN, free_port, launch_env, small_run_argv
from scripts.faults import cpu_quota

pytestmark = [pytest.mark.multirank, pytest.mark.serial]     # a time bound: run alone (setup.cfg)
# 3x, not the fault's default 2x: at 2x against the 1.5x bound, a noisy counted step (the fast rank's CPU time up,
# the suite's other half beside it on the 2 cores) broke the slow run of 5 steps, and the node was named 6 steps
# late (since step 15; once in 4 fresh-clone make tests, 2026-12-06)
SLOW_FROM, SLOW_FACTOR, STARVED_SHARE = 8, 3, 0.2
PER_NODE = (2, 2)         # ranks of the kept node (the store's), of the slow one


def _trainer(agent, local_rank):
    """(pid, global rank) of the training process of torchrun agent ``agent`` (a pid) at ``local_rank``; None until
    it runs. Which node gets ranks 0-1 is the rendezvous's choice."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent and env.get(b"LOCAL_RANK") == str(local_rank).encode() and b"RANK" in env:
            return int(pid), int(env[b"RANK"])
    return None


def _lines(path):
    try:
        return [json.loads(line) for line in open(path).read().splitlines()[:-1]]   # whole lines only
    except OSError:
        return []


def _starve_then_slow(procs, run, faults, quota):
    """From outside while it trains: the store's node's second rank moved under the quota once the first step is
    logged; once it is named (or at step SLOW_FROM without a quota), the other node's second rank made slow (its
    node's fault file). The last step logged then, the starved rank, the slow one."""
    starved = None
    while all(p.poll() is None for p in procs):
        done = [r["step"] for r in _lines(run / "metrics.jsonl") if "loss" in r]
        if quota and starved is None and done and _trainer(procs[0].pid, 1):
            pid, starved = _trainer(procs[0].pid, 1)
            quota.add(pid)
        named = [e for e in _lines(run / "stragglers.jsonl") if e["event"] == "named"]
        if (quota is None and done and done[-1] >= SLOW_FROM) or (starved is not None and named):
            slow = _trainer(procs[1].pid, 1)[1]
            faults.write_text(f"slow@0:{slow}\n")
            return done[-1], starved, slow
        time.sleep(0.05)
    return None, None, None


def test_a_starved_rank_and_a_slow_node_are_named_and_the_slow_node_is_evicted(small_run_shards, tmp_path, capsys):
    """The starved rank's node serves the rendezvous store: named, not evicted. Without a writable cgroup cpu
    controller (not root, none mounted), the slow node alone."""
    try:
        quota = cpu_quota.Quota(STARVED_SHARE, f"hpfc-starved-{os.getpid()}")
    except cpu_quota.Unavailable as e:
        quota = None
        print(f"no CPU-starved rank: {e}")
    steps = 120 if quota else 30     # starved: named after its first second (45 to 70 steps at 20% of a core)
    run, port, faults = tmp_path / "run", free_port(), tmp_path / "faults-node1"
    sets = ["train.log_every=1", "checkpoint.every=20", "checkpoint.memory_every=5", "train.stragglers=evict",
            "train.straggler_steps=5", "train.straggler_min_nodes=1"]
    procs, logs = [], [tmp_path / "node0.log", tmp_path / "node1.log"]
    for i in (0, 1):
        (tmp_path / f"mem{i}").mkdir()
        env = dict(launch_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   HVD_PARTIALFC_MEMORY_DIR=str(tmp_path / f"mem{i}"), HVD_PARTIALFC_SLOW_FACTOR=str(SLOW_FACTOR),
                   **({"HVD_PARTIALFC_FAULT_FILE": str(faults)} if i else {}))
        cmd = [TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", str(PER_NODE[i]), "--max-restarts", "2",
               "--monitor-interval",
               "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slow",
               "--rdzv-conf", f"is_host={1 - i},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
               *small_run_argv(small_run_shards, run, steps, sets)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        slow_at, starved_rank, slow_rank = _starve_then_slow(procs, run, faults, quota)
        for p in procs:
            p.wait(timeout=150)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        if quota:
            quota.close()
    outs = [log.read_text() for log in logs]
    kept, slow = (o.replace("\r", "\n") for o in outs)
    assert procs[0].returncode == 0, kept[-3000:]
    evicted = re.findall(r"\[rank (\d)\] evicted: (\S+) is a straggler; .* snapshot of step (\d+) \(in node "
                         r"memory\); exit 76", slow)
    assert len(evicted) == 2 and len({e[1:] for e in evicted}) == 1, slow[-3000:]   # both ranks, one node, one step
    ranks, node, step = sorted(int(e[0]) for e in evicted), evicted[0][1], int(evicted[0][2])
    (store,) = set(re.findall(r"evict: (\S+) serves torchrun's rendezvous store: never evicted", kept + slow))
    assert store != node and store.startswith(socket.gethostname() + "/agent")      # the first agent's (is_host)
    # once the slow rank is slower, the starved one waits for it and its quota lasts: it may be cleared meanwhile (rightly)
    events = [e for e in map(json.loads, open(run / "stragglers.jsonl"))
              if (e["event"], e.get("rank")) != ("cleared", starved_rank)]
    if quota:                         # named at 20% of a core, its CPU time a step unchanged; not evicted
        starved, kept_line = events[:2]
        assert (starved["event"], starved["rank"], starved["node"]) == ("named", starved_rank, store), events
        assert starved["own_s"] > 1.5 * starved["median_s"] and starved["step"] <= slow_at
        assert kept_line["event"] == "not evicted" and "serves torchrun's rendezvous store" in kept_line["line"]
        events = events[2:]
    assert [e["event"] for e in events] == ["named", "evicted"], events
    named, rank = events[0], slow_rank
    assert (named["rank"], named["node"]) == (rank, node) and named["own_s"] > 1.5 * named["median_s"]
    assert events[1]["ranks"] == ranks and rank in ranks
    # slow from the step after the fault file's, named after 5 counted steps (the step after a snapshot is not);
    # the ranks may be a step or two ahead of rank 0's log
    assert slow_at < named["since"] <= slow_at + 6 and named["since"] + 4 <= named["step"] <= named["since"] + 6
    assert step == named["step"] + 2 and events[1]["step"] == step
    assert f"resumed from the memory snapshot of step {step} at step {step} (written by 4 ranks)" in kept
    records = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))          # no step done twice
    assert {r["world_size"] for r in records if r["step"] <= step} == {4}
    assert {r["world_size"] for r in records if r["step"] > step} == {2}
    meta = json.load(open(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "meta.json"))
    budget = steps * 8 * sum(PER_NODE)
    assert meta["length"]["samples"] == meta["length"]["budget_samples"] == budget
    assert len(meta["slices"]) == 2 and [c for a, b in meta["slices"] for c in range(a, b)] == list(range(24))
    seen = 0
    for r in records:                 # the lr is the cosine of the samples consumed before the step, throughout
        assert r["lr"] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * seen / budget)), rel=1e-9), r["step"]
        seen += 8 * r["world_size"]
    from hvd_partialfc.cli import main
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"straggler step {named['step']}: rank {rank} on {node} named" in out
    assert f"straggler step {step}: {node} evicted (ranks {ranks})" in out
