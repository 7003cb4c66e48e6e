"""Memory snapshots (``checkpoint.memory_every``, hvd_partialfc/run/memory*.py) under real torchrun agents.

Each "node" is a torchrun agent on this host with a snapshot root of its own (``HVD_PARTIALFC_MEMORY_DIR``):
ranks with another root are on another node (memory_store.node_key), and a node's memory is its root, so a
node lost is its agent gone and its root removed. The network-namespace nodes of scripts/faults/chaos.py run the
same code with a network between them (its --memory-every run, docs/evidence/reliability.md).

One crash serves the torchrun tests: 3 nodes of one rank, a snapshot every 4 steps, disk checkpoints every 15;
rank 1 is SIGKILLed in the middle of the snapshot of step 24 (its own copy written, its buddy's not sent), after
the disk checkpoint of step 15 and the snapshot of step 20. Each test restarts a copy of that state. The
horovodrun test: a crash and a restart on one host, bitwise against the uninterrupted run. The start-up
refusal of snapshots that do not fit: test_memory_plan.py (one process).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import psutil
import pytest

import pins
from conftest import (ROOT, SMALL_RUN, TORCHRUN, free_port, launch_env, require_horovod, run_hvd,
                      simulate_here, small_run_argv)

pytestmark = pytest.mark.multirank

K, EVERY, STEPS = 4, 15, 30
SETS = [f"checkpoint.every={EVERY}", f"checkpoint.memory_every={K}"]
KILLED = "kill-in-memory@24:1"


def agents(roots, shards, out, sets=(), fault=None, timeout=150):
    """One torchrun agent a root (a node of one rank), all of one static job; [(exit status, output)]."""
    return wait(start(roots, shards, out, sets, fault), timeout)


def start(roots, shards, out, sets=(), fault=None, env=None, nproc=1):
    """One torchrun agent a root (a node of ``nproc`` ranks), started; the agents' processes."""
    port, procs, extra = free_port(), [], env or {}
    for i, root in enumerate(roots):
        env = dict(launch_env(fault), HVD_PARTIALFC_MEMORY_DIR=str(root), **extra)
        cmd = [TORCHRUN, "--nnodes", str(len(roots)), "--node-rank", str(i), "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "hvd_partialfc.cli", "train",
               "--shards", str(shards), "--out", str(out), "--steps", str(STEPS)]
        for s in SMALL_RUN + SETS + list(sets):
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=ROOT, start_new_session=True))
    return procs


def wait(procs, timeout=150):
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)


class Flood:
    """A stranger on the node: every port that the agents' workers listen on and that greets with the memory
    link's nonce (the link; Gloo's ports say nothing and are left alone) gets 200 connections, every other one
    saying garbage, held open until ``stop``. The ports are probed side by side, and flooded once every rank's
    is found. ``ports``: the link ports flooded."""

    def __init__(self, procs, each=200):
        self.procs, self.each, self.ports, self.socks = procs, each, set(), []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _listening(self):
        out = set()
        for p in self.procs:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    out |= {c.laddr for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        return out

    def _probe(self, addr):
        try:
            with socket.create_connection(addr, timeout=0.3) as s:
                if len(s.recv(64).strip()) == 32:
                    self.ports.add(addr)
        except OSError:
            pass

    def _flood(self, addr):
        for i in range(self.each):
            try:
                s = socket.create_connection(addr, timeout=2)
                if i % 2:
                    s.sendall([b"[]\n", b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n"][i % 3])
                self.socks.append(s)
            except OSError:
                pass

    def _side_by_side(self, fn, addrs):
        threads = [threading.Thread(target=fn, args=(a,), daemon=True) for a in addrs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)

    def _run(self):
        probed = set()
        while not self._stop.is_set() and len(self.ports) < len(self.procs):
            fresh = self._listening() - probed
            probed |= fresh
            self._side_by_side(self._probe, fresh)
            time.sleep(0.05)
        self._side_by_side(self._flood, list(self.ports))

    def stop(self):
        self._stop.set()
        self.thread.join(30)
        for s in self.socks:
            s.close()


def said(results):
    return "\n".join(out for _, out in results)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, small_run_shards):
    """The crash (see the module's docstring), and the reference: the same job without snapshots, stopped by a
    SIGTERM so that it writes the disk checkpoint of step 20 (unscheduled, as the snapshot is: the run goes on
    with its own BatchNorm statistics). The reference's 3 ranks are under one agent (no snapshots: the nodes
    play no part; the same 3 ranks, the same numbers), not one each: two torchrun agents fewer to start."""
    base = tmp_path_factory.mktemp("memory")
    roots = [base / f"node{i}" for i in range(3)]
    for r in roots:
        r.mkdir()
    (base / "ref0").mkdir()
    off = ["checkpoint.memory_every=0", "checkpoint.keep=5"]
    crash = start(roots, small_run_shards, base / "run", fault=KILLED)      # the two side by side: they wait
    ref = wait(start([base / "ref0"], small_run_shards, base / "ref", sets=off, fault="sigterm@18",  # on each
                     nproc=3))                                                                      # other
    results = wait(crash)
    shutil.copytree(base / "run", base / "run.crashed")
    assert any("injected kill-in-memory at step 24" in out for _, out in results), said(results)
    assert all(code != 0 for code, _ in results)
    assert said(ref).count("exit 75") == 3 and (base / "ref" / "checkpoints" / "step-00000020").is_dir(), said(ref)
    return base


def branch(crashed, tmp_path, nodes):
    """The crashed run folder put back at its own path, as the crash left it (a node's snapshot folder is keyed
    by the run folder: a copy elsewhere is another run), and copies of the roots of ``nodes`` (the nodes that
    survived). Returns (the run folder, the roots)."""
    run = crashed / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(crashed / "run.crashed", run)
    for i in nodes:
        shutil.copytree(crashed / f"node{i}", tmp_path / f"node{i}", symlinks=True)
    return run, [tmp_path / f"node{i}" for i in nodes]


def snapshots_left(roots):
    return [os.path.join(r, d) for r in roots for d in os.listdir(r) if d.startswith("hvd_partialfc-")]


def test_the_crash_left_a_committed_snapshot_and_a_partial_one(crashed):
    """Before any restart: every node committed step 20; step 24 is partial where anything of it landed: on
    node 1 always (rank 1 wrote its own copy, then was killed); on the others only if their landing thread (at
    low priority) wrote before the heartbeat ended their rank (it did not, once in a make test beside the other
    half of the suite: the test asked for step 24 on every node then)."""
    segments = set()
    for i in range(3):
        [store] = snapshots_left([crashed / f"node{i}"])
        names = [n for n in os.listdir(store) if n.startswith("step-")]
        steps = {n.split(".")[0] for n in names}
        assert len(names) == len(steps) and steps in ({"step-00000020", "step-00000024"},
                                                      *([{"step-00000020"}] if i != 1 else [])), names
        assert [n for n in names if n.endswith(".partial")] == [n for n in names if n.startswith("step-00000024")]
        segments |= {n.split(".")[1] for n in names}
    assert len(segments) == 1                       # one start: one segment on every node
    # node 0 holds rank 0's own file and rank 2's buddy copy (rank r's buddy: the rank of the next node)
    [store] = snapshots_left([crashed / "node0"])
    assert sorted(os.listdir(os.path.join(store, f"step-00000020.{segments.pop()}"))) == [
        "backbone.pt", "classifier-00000-of-00003.pt", "classifier-00002-of-00003.pt", "meta.json"]


def test_a_lost_node_resumes_from_memory_at_another_size_bitwise(crashed, tmp_path, small_run_shards):
    """Node 1 lost: nodes 0 and 2 resume from the snapshot of step 20 (newer than the disk's 15; the partial 24
    unused), rank 1's slice from its buddy's copy on node 2, at 2 ranks; the run equals a resume of the
    uninterrupted run's disk checkpoint of step 20 at 2 ranks, bitwise. The snapshots go when the run ends. A
    stranger's flood of 200 idle or garbage connections to each rank's link port costs no snapshot (before: a
    garbage header's traceback, and an accept loop that a flood's EMFILE ended)."""
    run, roots = branch(crashed, tmp_path, [0, 2])
    procs = start(roots, small_run_shards, run, fault="stall@20:0", env={"HVD_PARTIALFC_STALL_SECONDS": "4"})
    flood = Flood(procs)           # a stranger floods both link ports while rank 0 stalls before step 21
    results = wait(procs)
    flood.stop()
    text = said(results)
    assert all(code == 0 for code, _ in results), text
    assert len(flood.ports) == 2 and len(flood.socks) > 300, (flood.ports, len(flood.socks))
    # the snapshots of steps 24, 28 and 32 landed in time beside the flood: none waited for, none dropped. The
    # agents' own log lines are left out: under load the agent that hosts torchrun's store may leave before the
    # others pass its exit barrier, and they log that traceback (every rank and agent exited 0, checked above)
    ours = "\n".join(line for line in text.splitlines() if "torch/distributed/elastic/" not in line)
    assert "had not landed" not in ours and "dropped" not in ours and "Traceback" not in ours, text
    assert "memory: resuming from the snapshot of step 20 in node memory (disk checkpoint: step 15;" in text, text
    assert snapshots_left(roots) == []
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, [*SMALL_RUN, *SETS, f"data.shards={small_run_shards}", f"out={tmp_path / 'disk'}",
                             f"train.steps={STEPS}",
                             f"checkpoint.resume={crashed / 'ref' / 'checkpoints' / 'step-00000020'}"])
    simulate_here(cfg, 2)
    final = json.load(open(run / "checkpoints" / "step-00000035" / "meta.json"))
    assert final["world_size"] == 2
    want = pins.checkpoint_digests(str(tmp_path / "disk" / "checkpoints" / "step-00000035"))
    assert pins.checkpoint_digests(str(run / "checkpoints" / "step-00000035")) == want


def test_a_node_and_its_buddy_lost_fall_back_to_disk(crashed, tmp_path, small_run_shards):
    """Nodes 1 and 2 lost: rank 1's slice was on node 1 and its copy on node 2; the run says so in one line
    and resumes from the disk checkpoint of step 15."""
    run, roots = branch(crashed, tmp_path, [0])
    results = agents(roots, small_run_shards, run)
    text = said(results)
    assert results[0][0] == 0, text
    line = [l for l in text.splitlines() if "cannot be restored" in l]
    assert line == ["memory snapshot of step 20 cannot be restored: rank 1's slice survived on no node (its node "
                    f"and its buddy's both lost); resuming from the disk checkpoint "
                    f"{run / 'checkpoints' / 'step-00000015'} (step 15)"], text
    assert f"resumed from {run / 'checkpoints' / 'step-00000015'} at step 15" in text


def test_under_horovodrun_a_crashed_rank_resumes_bitwise_from_its_nodes_memory(tmp_path, small_run_shards):
    """The same snapshots under Horovod (horovodrun -np 2, Gloo, one host: one node, no buddies): rank 1 SIGKILLed
    after step 13, the job started again resumes from the node's own snapshot of step 12, newer than the disk
    checkpoint of step 10, and ends bitwise where the uninterrupted run ends; its snapshots go when it ends, a
    stale segment of this run folder (another token) is removed and said, another run's stays.

    Snapshot 12 lands while the ranks stall after step 12; the kill comes before the loop's vote could commit it
    (its flag, taken as the snapshot started, is read after step 13): it is committed only because rank 0 heard
    every landing and told the node at once. Without that, 8 (settled at 12) would be the newest, older than
    the disk's 10 (checked: with the note to rank 0 disabled, this resumes from disk)."""
    require_horovod()
    root = tmp_path / "shm"
    root.mkdir()
    sets = ["checkpoint.every=10", "checkpoint.memory_every=4"]
    argv = small_run_argv(small_run_shards, tmp_path / "run", 20, sets)
    env = {"HVD_PARTIALFC_MEMORY_DIR": str(root), "HVD_PARTIALFC_FAULT": "stall@12,kill@13:1",
           "HVD_PARTIALFC_STALL_SECONDS": "1"}
    p = run_hvd(2, argv, env=env, check=False)
    assert p.returncode != 0 and "injected kill before step 14" in p.stdout + p.stderr, p.stderr[-3000:]
    assert snapshots_left([root]), "the failure keeps the snapshots"
    stale, other = root / "hvd_partialfc-0000stale0000", root / "hvd_partialfc-0000other0000"
    for path, owner in ((stale, os.path.realpath(tmp_path / "run")), (other, "/elsewhere/run")):
        (path / "step-00000016").mkdir(parents=True)     # newer than anything: taken, it would be resumed
        (path / "owner.json").write_text(json.dumps({"run_dir": owner, "token": path.name[14:]}))
    env.pop("HVD_PARTIALFC_FAULT")
    p = run_hvd(2, argv, env=env)
    out = p.stdout + p.stderr
    assert "memory: resuming from the snapshot of step 12 in node memory (disk checkpoint: step 10;" in out, out[-3000:]
    assert f"removed {stale}: another snapshot folder of this run folder (an earlier run's, or an earlier " \
           "version's)" in out
    assert snapshots_left([root]) == [str(other)]           # this run's went at its end; another run's stays
    # the same size: bitwise the run that was never interrupted (simulate --ranks 2: horovodrun's numbers)
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, [*SMALL_RUN, *sets, f"data.shards={small_run_shards}", f"out={tmp_path / 'straight'}",
                             "train.steps=20"])
    simulate_here(cfg, 2)
    last = "checkpoints/step-00000020"
    assert pins.checkpoint_digests(str(tmp_path / "run" / last)) == pins.checkpoint_digests(str(tmp_path / "straight" / last))
