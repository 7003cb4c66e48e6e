"""Going on in the same processes (docs/reliability.md, "Going on in the same processes"): under horovodrun's
elastic mode (launch/horovodrun_elastic.sh, the script itself), a rank killed at step 6 of 3 leaves 2 survivors
that keep their processes: horovodrun starts no worker after the first three, each survivor says it went on in
its own process (its pid), well inside one Gloo timeout (30 s: the time a survivor would wait in a receive from
a rank that left the collective without cutting its connections, engine/horovod.py ``abort``), and the run ends
bitwise where the relaunch path ends: a new process that resumes the same step-6 checkpoint at 2 ranks (``simulate``
in this process, bitwise a real 2-rank run's: tests/test_simulate.py).
"""
from __future__ import annotations

import os
import re
import shutil
import socket

import psutil
import pytest

from conftest import ROOT, SMALL_RUN, BIN, launch_env, require_horovod, run_job, simulate_here
import pins

pytestmark = pytest.mark.multirank
SETS = ["checkpoint.every=2", "checkpoint.keep=20", "train.log_every=1"]
STEPS, KILLED_AT = 16, 6


def local_names():
    """Three names of this machine that horovodrun runs locally (it compares their addresses with the
    interfaces'): 127.0.0.1, localhost and another interface's IPv4 address; None where there is none."""
    other = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127."))
    return ["127.0.0.1", "localhost", other[0]] if other else None


def relaunch_path(shards, run, out):
    """The relaunch path from the same checkpoint, in this process: the step-6 checkpoint that the 3 ranks wrote
    (copied alone into a new run folder), resumed by 2 ranks. (The first 6 steps are the same launch's: at 3 ranks
    Gloo's ring sums in an order of its own, and the simulator is bitwise a real run at 2 ranks only.)"""
    from hvd_partialfc.config_io import load_config
    step = f"step-{KILLED_AT:08d}"
    shutil.copytree(os.path.join(run, "checkpoints", step), os.path.join(out, "checkpoints", step))
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write(step)
    sets = [*SMALL_RUN, *SETS, f"data.shards={shards}", f"out={out}", f"train.steps={STEPS}", "checkpoint.resume=auto"]
    return simulate_here(load_config(os.path.join(ROOT, "configs", "example.yaml"), sets), 2).checkpoint


def test_a_killed_rank_survivors_go_on_in_their_processes_bitwise(small_run_shards, tmp_path):
    require_horovod()
    names = local_names()
    if names is None:
        pytest.skip("this machine has no IPv4 address besides the loopback's: horovodrun needs three local names")
    discovery = tmp_path / "hosts.sh"
    discovery.write_text("#!/bin/sh\n" + "".join(f"echo {n}:1\n" for n in names))
    discovery.chmod(0o755)
    run = tmp_path / "run"
    sets = [a for s in SETS for a in ("--set", s)]
    cmd = [os.path.join(ROOT, "launch", "horovodrun_elastic.sh"), str(small_run_shards), str(run), str(discovery),
           "2", "3", "3", "--steps", str(STEPS), *[a for s in SMALL_RUN for a in ("--set", s)], *sets]
    env = dict(launch_env(f"kill@{KILLED_AT}:2"), VENV=os.path.dirname(BIN), MEMORY_EVERY="0", NIC="lo",
               HOROVODRUN_ARGS="--log-level INFO")
    p = run_job(cmd, env, 180)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert text.count("start worker process:") == 3, text[-4000:]            # no process replaced or added
    went_on = re.findall(r"\[rank (\d)\] went on in this process \(pid (\d+)\): the group re-formed at 2 ranks "
                         r"\(was rank (\d) of 3\) in ([\d.]+) s", text)
    assert sorted(int(w[0]) for w in went_on) == [0, 1], text[-4000:]
    assert len({w[1] for w in went_on}) == 2 and all(float(w[3]) < 10 for w in went_on), went_on
    assert f"resumed from {run}/checkpoints/step-{KILLED_AT:08d} at step {KILLED_AT} (written by 3 ranks)" in text
    ckpt = os.path.join(run, "checkpoints", open(os.path.join(run, "checkpoints", "latest")).read().strip())
    ref = relaunch_path(small_run_shards, run, tmp_path / "relaunch")
    assert os.path.basename(ckpt) == os.path.basename(ref) == f"step-{KILLED_AT + (STEPS - KILLED_AT) * 3 // 2:08d}"
    assert pins.checkpoint_digests(ckpt) == pins.checkpoint_digests(ref)
