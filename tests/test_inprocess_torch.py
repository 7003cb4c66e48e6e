"""Going on in the same processes under the torch engine (launch/torch_inprocess.py, the launcher itself, and
engine/generation.py; docs/evidence/reliability.md, "Going on in the same processes").

A rank killed at step 4 of 3 leaves 2 survivors that keep their processes: the launcher starts no rank after the
first three, each survivor says it went on in its own process (one of the first three pids) within seconds, and
the run ends bitwise where the relaunch path ends: a new process that resumes the same step-4 checkpoint at 2 ranks
(``simulate`` in this process, bitwise a real 2-rank run's: tests/test_simulate.py).
"""
from __future__ import annotations

import os
import re
import sys

import pytest

from conftest import BIN, ROOT, SMALL_RUN, launch_env, run_job
from test_inprocess import resumed_at, went_on
import pins

pytestmark = pytest.mark.multirank
SETS = ["checkpoint.every=2", "checkpoint.keep=20", "train.log_every=1"]
STEPS, KILLED_AT = 8, 4


def test_a_killed_rank_survivors_go_on_in_their_processes_bitwise(small_run_shards, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "torch_inprocess.py"), str(small_run_shards), str(run), "3",
           "--steps", str(STEPS), *[a for s in SMALL_RUN + SETS for a in ("--set", s)]]
    env = dict(launch_env(f"kill@{KILLED_AT}:2"), VENV=os.path.dirname(BIN), MEMORY_EVERY="0", MAX_RESTARTS="0")
    p = run_job(cmd, env, 150)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    started = re.findall(r"\[torch_inprocess\] rank \d started: pid (\d+)", text)
    assert len(started) == 3, text[-4000:]                   # no rank replaced or added
    survivors = went_on(text, 2)
    assert sorted(int(w[0]) for w in survivors) == [0, 1], text[-4000:]
    assert {w[1] for w in survivors} == set(started[:2]) and all(float(w[3]) < 10 for w in survivors), survivors
    assert f"resumed from {run}/checkpoints/step-{KILLED_AT:08d} at step {KILLED_AT} (written by 3 ranks)" in text
    last = f"step-{KILLED_AT + (STEPS - KILLED_AT) * 3 // 2:08d}"
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == last
    ref = resumed_at(run, KILLED_AT, 2, small_run_shards, tmp_path / "relaunch", STEPS, SETS)
    assert pins.checkpoint_digests(os.path.join(run, "checkpoints", last)) == \
        pins.checkpoint_digests(os.path.join(ref, last))
