"""Two nodes on one machine (scripts/faults/twonode.py: each a network namespace with its own hostname): 4 ranks
train across them under torchrun (c10d rendezvous on node 1) and horovodrun (Gloo; ``ssh`` = the launch
agent), and agree; mpirun starts a Horovod job across them (``plm_rsh_agent``); a cut link ends every rank
within the heartbeat's timeout, naming a lost peer. A node lost under elastic torchrun (three nodes; the run
goes on re-sharded on the other two, then takes the node back): tests/test_chaos.py.

Skipped, with the reason, where network namespaces can't be used (not root, no iproute2, a container that
refuses ``ip netns add``). One namespace pair serves the module (set-up ~0.1 s); after each test every
process in both nodes is killed and the link restored, so a failed test leaves nothing running.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, require_horovod, small_run_argv as _train
from scripts.faults import twonode

pytestmark = pytest.mark.multirank

ALLREDUCE_HVD = """
import json, os, socket, sys
import torch, horovod.torch as hvd
hvd.init()
r = hvd.rank()
s = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum)
json.dump({"rank": r, "host": socket.gethostname(), "sum": s.item(), "size": hvd.size()},
          open(os.path.join(sys.argv[1], f"rank-{r}.json"), "w"))
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def pair():
    reason = twonode.tried_reason()
    if reason:
        pytest.skip(reason)
    nodes = twonode.TwoNodes(suffix=twonode.owner_suffix())
    try:
        nodes.setup()
    except twonode.Unavailable as e:
        pytest.skip(str(e))
    try:
        yield nodes
    finally:
        nodes.teardown()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert nodes.ns(1) not in listed and nodes.ns(2) not in listed
        assert not os.path.exists(f"/etc/netns/{nodes.ns(1)}")


@pytest.fixture
def nodes(pair):
    yield pair
    pair.kill_node(1)
    pair.kill_node(2)
    pair.restore()


def _script(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _finish(procs, timeout):
    """communicate() with every process (text output); on a timeout, kill all their groups and fail."""
    deadline, outs = time.monotonic() + timeout, []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                _killpg(q)
            raise AssertionError(f"timed out after {timeout} s: {[q.args[-6:] for q in procs]}")
    return outs


def _killpg(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _check_ranks(out_dir, outs):
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out_dir, "rank-*.json")))]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], outs
    assert all(r["sum"] == 10.0 and r["size"] == 4 for r in ranks), ranks
    hosts = [r["host"] for r in ranks]
    # two per node; a node's ranks are consecutive (all three launchers place local ranks together)
    assert sorted(hosts) == ["node1", "node1", "node2", "node2"] and hosts[0] == hosts[1], hosts


def test_harness_basics(nodes):
    assert nodes.addr(1) == "10.77.0.1" and nodes.addr(2) == "10.77.0.2"
    assert nodes.env_for(2) == {k: "hpfc0" for k in twonode.IFACE_VARS}
    out = nodes.run(2, ["sh", "-c", "hostname; getent hosts node1; ip -o -4 addr show"], timeout=10).stdout
    lines = out.splitlines()
    assert lines[0] == "node2" and lines[1].split() == ["10.77.0.1", "node1"]
    assert "hpfc0" in out and "10.77.0.2/24" in out and "eth" not in out  # only lo and hpfc0
    # the launch agent, called as horovodrun calls ssh (options on both sides of the host)
    ssh = os.path.join(nodes.bin_dir, "ssh")
    argv = [ssh, "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", "10.77.0.1", "-p", "22",
            "-o", "ConnectTimeout=5", "echo $(hostname) $X"]
    r = nodes.run(2, argv, env=dict(os.environ, X="kept"), timeout=10)
    assert r.returncode == 0 and r.stdout.split() == ["node1", "kept"], r.stderr


def test_mpirun_two_nodes(nodes, tmp_path):
    require_horovod()
    script = _script(tmp_path, "job.py", ALLREDUCE_HVD)
    env = nodes.launch_env(1)
    p = nodes.popen(1, nodes.mpirun_argv([sys.executable, script, tmp_path], slots=2, env=env), env=env,
                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = _finish([p], 150)
    assert p.returncode == 0, outs
    _check_ranks(tmp_path, outs)


# --- training across the two nodes: the job, a cut link, a lost node ------------------------------------

def _env(nodes, k, **more):
    return dict(nodes.launch_env(k), PYTHONPATH=ROOT, HVD_PARTIALFC_CHECK_COLLECTIVES="1", **more)


def _torchrun(nodes, tmp_path, argv, port, extra=(), env=None):
    logs = [open(tmp_path / f"node{k}.log", "w") for k in (1, 2)]
    return [nodes.popen(k, nodes.torchrun_argv(k, argv, nproc=2, port=port, extra=extra),
                        env=dict(_env(nodes, k), **(env or {})), cwd=ROOT, stdout=logs[k - 1],
                        stderr=subprocess.STDOUT) for k in (1, 2)]


def _latest(run):
    path = os.path.join(run, "checkpoints", "latest")
    if not os.path.exists(path):
        return None, 0
    name = open(path).read().strip()
    return os.path.join(run, "checkpoints", name), int(name[5:])


def _wait_step(run, step, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while _latest(run)[1] < step:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, f"no checkpoint at {step}"
        time.sleep(0.2)


def _workers(procs):
    """The training processes under the launchers (not torchrun's agents)."""
    import psutil
    out = []
    for p in procs:
        try:
            kids = psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        out += [c for c in kids if "hvd_partialfc.cli" in " ".join(c.cmdline()) and "torchrun" not in " ".join(c.cmdline())]
    return out


def test_horovodrun_trains_across_two_nodes(nodes, np4_run):
    """horovodrun (Gloo, ssh = the launch agent) trains 4 ranks on 2 nodes; the checkpoint's backbones agree
    across ranks and with ``simulate --ranks 4`` of the same run. The run is conftest.np4_run's (test_simulate.py's
    job: a resnet with BatchNorm and dropout, cross-shard negatives, 10 steps), launched once for this test and
    test_simulate.py's N = 4 comparison, which bounds it tighter (2e-5 absolute). (torchrun across nodes:
    test_chaos.py's three nodes; the two engines bitwise on one host: test_engines.py.)"""
    require_horovod()
    if not np4_run["nodes"]:
        pytest.skip("conftest.np4_run ran on one host: the nodes did not come up for it")
    import torch
    run, sim = np4_run["real"], np4_run["sim"]
    ckpt, step = _latest(run)
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert step == 10 and meta["world_size"] == 4 and meta["identical"], np4_run["output"][-3000:]
    got = torch.load(os.path.join(ckpt, "backbone.pt"), map_location="cpu", weights_only=True)["state_dict"]
    sim_ckpt, _ = _latest(sim)
    want = torch.load(os.path.join(sim_ckpt, "backbone.pt"), map_location="cpu", weights_only=True)["state_dict"]
    # At 4 ranks Horovod's ring adds in another order than the simulator's sum. Bound: float32 round-off
    # carried through 10 steps, max |diff| over the backbone's tensors / their max |w| (7.8e-8 here; a tensor's
    # own max |w| would not do: BatchNorm biases and running means of ~1e-9 are all round-off); a wrong scale
    # (1/N missing) moves every update 4x.
    floats = [k for k, a in got.items() if a.is_floating_point()]
    worst = max(float((got[k] - want[k]).abs().max()) for k in floats) / max(float(got[k].abs().max()) for k in floats)
    assert worst < 1e-4


def test_a_cut_link_ends_every_rank_naming_the_lost_peer(nodes, tmp_path, small_run_shards):
    """The link goes down mid-run (no reset arrives): the heartbeat ends all 4 ranks in under 60 s, each
    side naming a peer across the cut; the last checkpoint stays intact and ``latest`` names it."""
    run = tmp_path / "run"
    procs = _torchrun(nodes, tmp_path, _train(small_run_shards, run, 100000, ["checkpoint.every=10",
                                                                    "train.heartbeat_timeout=5"]), 29413)
    try:
        _wait_step(run, 20, procs)
        workers = _workers(procs)
        assert len(workers) == 4
        nodes.cut()
        t0 = time.monotonic()
        while any(w.is_running() and w.status() != "zombie" for w in workers):
            assert time.monotonic() - t0 < 60, "ranks still running 60 s after the cut"
            time.sleep(0.2)
        took = time.monotonic() - t0
    finally:
        nodes.kill_node(1), nodes.kill_node(2)
        _finish(procs, 30)
    logs = [(tmp_path / f"node{k}.log").read_text() for k in (1, 2)]
    for text in logs:
        assert "error: lost peer rank" in text and "no heartbeat for 5 s" in text, text[-3000:]
    ckpt, step = _latest(run)
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert step >= 20 and meta["step"] == step and meta["identical"] and meta["world_size"] == 4
    assert all(os.path.exists(os.path.join(ckpt, f)) for f in meta["classifier_files"] + ["backbone.pt"])
    print(f"link cut: every rank ended {took:.1f} s after the cut (heartbeat timeout 5 s); last checkpoint step {step}")


def test_the_command_line_keeps_its_state_in_a_private_folder(tmp_path):
    """`twonode.py up` puts the ssh wrapper (run as root in every node) in a fresh 0700 folder, not a fixed
    /tmp path another user could prepare; `exec` and `down` find it again."""
    reason = twonode.tried_reason()
    if reason:
        pytest.skip(reason)
    suffix = f"-c{os.getpid()}"
    cli = [sys.executable, "-m", "scripts.faults.twonode", f"--suffix={suffix}"]
    up = subprocess.run(cli + ["--nodes", "3", "up"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    try:
        if up.returncode == 2:
            pytest.skip(up.stderr.strip())
        assert up.returncode == 0, up.stderr
        ssh = up.stdout.split("ssh wrapper: ")[1].strip()
        state = os.path.dirname(os.path.dirname(ssh))
        assert os.stat(state).st_mode & 0o777 == 0o700 and not state.endswith("-cli")
        assert os.stat(ssh).st_mode & 0o077 == 0
        r = subprocess.run(cli + ["exec", "3", "--", "hostname"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == "node3", r.stderr
    finally:
        subprocess.run(cli + ["down"], cwd=ROOT, capture_output=True, timeout=60)
    assert not os.path.exists(state)
    assert f"hpfc-n1{suffix}" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_whether_nodes_work_is_decided_by_trying(tmp_path, monkeypatch):
    """A root container whose ``ip netns add`` is refused: ``tried_reason`` says so (the tools and root alone
    looked fine, and both the chaos test and its one-host fallback skipped)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ip").write_text('#!/bin/sh\n[ "$2" = add ] && { echo "mount --make-shared /run/netns failed: '
                             'Operation not permitted" >&2; exit 1; }\nexit 0\n')
    (fake / "ip").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    twonode.tried_reason.cache_clear()
    try:
        reason = twonode.tried_reason()
    finally:
        twonode.tried_reason.cache_clear()
    assert reason and ("Operation not permitted" in reason or "root" in reason or "Linux" in reason), reason
