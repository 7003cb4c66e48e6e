"""A straggler under real elastic torchrun (run/watch/stragglers.py): two agents on this host (``--nnodes 1:2``, a node
each, each its own memory-snapshot root), the first serving the rendezvous store with one rank, the second with
two ranks, one of them made three times as slow by the ``slow`` fault. It is named (its rank and node, since which
step), its node evicted (``train.stragglers=evict``, ``straggler_min_nodes=1``): an agreed memory snapshot, both
of the node's ranks ignore SIGTERM before their agent is stopped and exit 76, the other exits 75 and its agent
restarts it alone, from that snapshot, re-sharded. No step is lost, the budget of samples is consumed exactly, the
lr goes on from the samples consumed, every class is in the one classifier left, and ``info`` lists the events.
The store's node is found (said at start). The detector's logic and the eviction's order are
tests/test_stragglers.py; the network-namespace version is the chaos run's ``slow`` fault (scripts/faults/chaos.py)
and scripts/studies/stragglers.py."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess

import pytest

from conftest import ROOT, TORCHRUN, free_port, launch_env, small_run_argv

pytestmark = pytest.mark.multirank
# 3x, not the fault's default 2x: at 2x against the 1.5x bound, a noisy counted step (the fast rank's CPU time up,
# the suite's other half beside it on the 2 cores) broke the slow run of 5 steps, and the node was named 6 steps
# late (since step 15; once in 4 fresh-clone make tests, 2026-12-06)
STEPS, SLOW_FROM, SLOW_FACTOR = 30, 8, 3
PER_NODE = (1, 2)         # ranks of the kept node (the store's), of the slow one: rank 1 is on the slow one either way


def test_a_slow_node_is_named_evicted_and_the_job_goes_on_without_it(small_run_shards, tmp_path, capsys):
    run, port = tmp_path / "run", free_port()
    sets = ["train.log_every=1", "checkpoint.every=20", "checkpoint.memory_every=5", "train.stragglers=evict",
            "train.straggler_steps=5", "train.straggler_min_nodes=1"]
    procs = []
    for i in (0, 1):
        (tmp_path / f"mem{i}").mkdir()
        env = dict(launch_env("slow@%d:1" % SLOW_FROM if i else None), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   HVD_PARTIALFC_MEMORY_DIR=str(tmp_path / f"mem{i}"), HVD_PARTIALFC_SLOW_FACTOR=str(SLOW_FACTOR))
        cmd = [TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", str(PER_NODE[i]), "--max-restarts", "2",
               "--monitor-interval",
               "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slow",
               "--rdzv-conf", f"is_host={1 - i},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
               *small_run_argv(small_run_shards, run, STEPS, sets)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    kept, slow = (o.replace("\r", "\n") for o in outs)
    assert procs[0].returncode == 0, kept[-3000:]
    evicted = re.findall(r"\[rank (\d)\] evicted: (\S+) is a straggler; .* snapshot of step (\d+) \(in node "
                         r"memory\); exit 76", slow)
    assert len(evicted) == 2 and len({e[1:] for e in evicted}) == 1, slow[-3000:]   # both ranks, one node, one step
    ranks, node, step = sorted(int(e[0]) for e in evicted), evicted[0][1], int(evicted[0][2])
    (store,) = set(re.findall(r"evict: (\S+) serves torchrun's rendezvous store: never evicted", kept + slow))
    assert store != node and store.startswith(socket.gethostname() + "/agent")      # the first agent's (is_host)
    events = [json.loads(line) for line in open(run / "stragglers.jsonl")]
    assert [e["event"] for e in events] == ["named", "evicted"]
    named, rank = events[0], 1
    assert (named["rank"], named["node"]) == (rank, node) and named["own_s"] > 1.5 * named["median_s"]
    assert events[1]["ranks"] == ranks and rank in ranks
    # slow from step 9 (the fault's step + 1), named after 5 counted steps (the step after a snapshot is not)
    assert SLOW_FROM < named["since"] <= SLOW_FROM + 4 and named["since"] + 4 <= named["step"] <= named["since"] + 6
    assert step == named["step"] + 2 and events[1]["step"] == step
    assert f"resumed from the memory snapshot of step {step} at step {step} (written by 3 ranks)" in kept
    records = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))          # no step done twice
    assert {r["world_size"] for r in records if r["step"] <= step} == {3}
    assert {r["world_size"] for r in records if r["step"] > step} == {1}
    meta = json.load(open(run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "meta.json"))
    budget = STEPS * 8 * sum(PER_NODE)
    assert meta["length"]["samples"] == meta["length"]["budget_samples"] == budget
    assert meta["slices"] == [[0, 24]]                                               # every class, once
    seen = 0
    for r in records:                 # the lr is the cosine of the samples consumed before the step, throughout
        assert r["lr"] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * seen / budget)), rel=1e-9), r["step"]
        seen += 8 * r["world_size"]
    from hvd_partialfc.cli import main
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"straggler step {named['step']}: rank {rank} on {node} named" in out
    assert f"straggler step {step}: {node} evicted (ranks {ranks})" in out
