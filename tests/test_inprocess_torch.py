"""Going on in the same processes under the torch engine (launch/torch_inprocess.py, the launcher itself, and
engine/generation.py; docs/evidence/reliability.md, "Going on in the same processes").

A rank killed at step 4 of 3 leaves 2 survivors that keep their processes: the launcher starts no rank after the
first three, each survivor says it went on in its own process (one of the first three pids) within seconds, and
the run ends bitwise where the relaunch path ends: a new process that resumes the same step-4 checkpoint at 2 ranks
(``simulate`` in this process, bitwise a real 2-rank run's: tests/test_simulate.py).

Started again (REJOIN), the killed rank joins while the survivors train: it builds and warms up before it asks, and
they pause only to checkpoint and re-form at their next step (3 -> 2 -> 3), in their processes throughout.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, ROOT, SMALL_RUN, launch_env, run_job
from test_inprocess import survivors_went_on_bitwise, went_on

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
    assert survivors_went_on_bitwise(text, run, small_run_shards, tmp_path, STEPS, KILLED_AT, SETS) == set(started[:2])


def _rows(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip().endswith("}")]
    except OSError:
        return []


@pytest.mark.serial            # the survivors' pauses are compared: run alone (setup.cfg)
def test_a_killed_rank_started_again_joins_while_the_others_train(small_run_shards, tmp_path):
    """REJOIN=1: the killed rank's process is started again and joins at the others' next step after it asked,
    while they train at 2 ranks: 3 -> 2 -> 3, the two first ranks in their processes throughout. The job is
    stopped (SIGTERM: every rank checkpoints, exit 75) after 3 steps of the re-joined group."""
    run, log = tmp_path / "run", tmp_path / "log"
    cmd = [sys.executable, os.path.join(ROOT, "launch", "torch_inprocess.py"), str(small_run_shards), str(run), "3",
           "--steps", "5000", *[a for s in SMALL_RUN + ["checkpoint.every=4", "train.log_every=1"]
                                for a in ("--set", s)]]
    env = dict(launch_env(f"kill@{KILLED_AT}:2"), VENV=os.path.dirname(BIN), MEMORY_EVERY="0", MAX_RESTARTS="0",
               REJOIN="1")
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 150
        while p.poll() is None and time.time() < deadline:
            sizes = [r["world_size"] for r in _rows(run / "metrics.jsonl")]
            if 2 in sizes and sizes[sizes.index(2):].count(3) >= 3:
                os.kill(p.pid, signal.SIGTERM)
                break
            time.sleep(0.3)
        p.wait(timeout=max(1, deadline - time.time()))
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    assert p.returncode == 75, text[-4000:]
    started = re.findall(r"\[torch_inprocess\] rank \d started: pid (\d+)", text)
    assert len(started) == 3 and len(re.findall(r"rank 2 started again, to join the running job", text)) == 1, \
        text[-4000:]
    to2, to3 = went_on(text, 2), went_on(text, 3)
    assert {w[1] for w in to2} == {w[1] for w in to3} == set(started[:2]), (to2, to3, started)
    assert "[rank 2] joined the running job as rank 2 of 3" in text, text[-4000:]
    regroup = int(re.search(r"step (\d+): the launcher changed the hosts; checkpoint", text).group(1))
    assert f"step-{regroup:08d} at step {regroup} (written by 2 ranks)" in text
    rows = _rows(run / "metrics.jsonl")
    join, loss = _pause(rows, regroup, 3), _pause(rows, KILLED_AT, 2)
    warm = re.search(r"\[rank 2\] before asking to join: imported the trainer in [\d.]+ s, warmed the backbone up in "
                     r"([\d.]+) s", text)
    print(f"the survivors' pause at the join (step {regroup} to {regroup + 1}): {join:.2f} s; at the loss: "
          f"{loss:.2f} s; the newcomer's warm-up before it asked: {warm and warm.group(1)} s")
    assert warm and text.index(warm.group(0)) < text.index("the launcher changed the hosts"), text[-4000:]
    # The newcomer built and warmed up before asking: the survivors then pause for the re-form and their own
    # rebuild, as at the loss (both scale with the load); its cold start (seconds) is not in the pause.
    assert join < 2 * loss + 1.0, (join, loss)
    with open(run / "checkpoints" / open(run / "checkpoints" / "latest").read().strip() / "meta.json") as f:
        meta = json.load(f)
    assert meta["world_size"] == 3 and [s["world_size"] for s in meta["length"]["segments"]] == [3, 2, 3]


def _pause(rows, step, size):
    """Seconds from the last row of ``step`` to the first row of ``step + 1`` at ``size`` ranks."""
    return min(r["time"] for r in rows if r["step"] == step + 1 and r["world_size"] == size) - \
        max(r["time"] for r in rows if r["step"] == step)


def _together(fns):
    """Each of ``fns`` in a thread of its own, all joined (30 s each at most)."""
    import threading
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_members_agree_through_the_store_the_dead_at_once_a_late_one_fenced_a_joiner_last():
    """The membership protocol alone (engine/generation.py ``Generations``), three members in this process's
    threads and the store process's code in another: member 2's death-watch connection closes without a goodbye
    (a killed process), so 0 and 1 agree on [0, 1] at once, not at the 10 s deadline; member 2 coming late after
    all is fenced; a process that asks to join is last in the next generation, which every member takes alike."""
    import queue
    import threading
    from hvd_partialfc.engine import gen_store, generation
    got = queue.Queue()
    threading.Thread(target=gen_store.serve, args=("127.0.0.1", 0, got.put), daemon=True).start()
    address = got.get(timeout=30)
    gens = [generation.Generations(address, m, [(m_, "") for m_ in range(3)], 30) for m in range(3)]
    gens[2].watch.close()                                  # killed: its connection closes without a goodbye
    t0, out = time.monotonic(), {}
    _together([lambda g=g: out.__setitem__(g.member, g.agree()) for g in gens[:2]])
    host = gens[0].members[0][1]
    assert out == {0: [(0, host), (1, host)], 1: [(0, host), (1, host)]}
    assert time.monotonic() - t0 < generation.JOIN_DEADLINE_S / 2      # the death watch, not the deadline
    assert gens[2].agree() is None                                      # late: fenced
    newcomer = generation.Generations(address, 2, [], 30)       # the killed rank, started again

    def members_see_it_then_agree(g):
        deadline = time.monotonic() + 30
        while g.joiners() == g.seen and time.monotonic() < deadline:      # rank 0's check, once a step
            time.sleep(0.01)
        out[g.member] = g.agree()
    _together([lambda: newcomer.join(30)] + [lambda g=g: members_see_it_then_agree(g) for g in gens[:2]])
    assert out[0] == out[1] == newcomer.members == [(0, host), (1, host), (2, host)]
    assert (gens[0].g, newcomer.g) == (2, 2)
