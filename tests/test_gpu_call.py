"""The one GPU call's shell plumbing (scripts/gpu/gpu_speed_run.sh, gpu_check.sh), with a stand-in for Python that
only records what it was asked to run: whether the call starts, which stages run after a failed one, and how
long the one deadline lets them run. Nothing here imports torch; tests/test_gpu_check.py runs the whole call
at toy sizes."""
from __future__ import annotations

import os
import subprocess
import time

from conftest import ROOT

FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
case "$*" in
  *torch.distributed.run*) exit "${FAKE_TORCH_RC:-3}" ;;
  *gpu_speed_check*) sleep "${FAKE_SPEED_S:-0}" ;;
esac
exit 0
"""


def _fake_python(tmp_path):
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    return py


def _check(tmp_path, **env):
    e = dict(os.environ, OUT=str(tmp_path / "out"), GPU_CHECK_TINY="1", GPU_CHECK_SKIP="build,horovod",
             PYTHON=str(_fake_python(tmp_path)), FAKE_LOG=str(tmp_path / "ran"), **env)
    t0 = time.monotonic()
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    ran = (tmp_path / "ran").read_text().splitlines() if (tmp_path / "ran").exists() else []
    return p, ran, time.monotonic() - t0


def test_the_call_refuses_to_start_without_arcface_torch(tmp_path):
    """A call without arcface_torch would measure ours alone and the headline ratio not at all: it stops
    before anything runs, in one line (it used to print a line and go on)."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "arcface").mkdir()
    env = dict(os.environ, OUT=str(out), ARCFACE_DIR=str(tmp_path / "arcface"), GPU_CHECK_TINY="1",
               PYTHON=str(_fake_python(tmp_path)), FAKE_LOG=str(tmp_path / "ran"))
    p = subprocess.run(["bash", "scripts/gpu/gpu_speed_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "no arcface_torch in" in p.stderr
    assert not (tmp_path / "ran").exists() and list(out.iterdir()) == []


def test_the_speed_stage_runs_after_a_failed_torch_stage(tmp_path):
    """The torch stage failing (here its launcher exits 3) is named, and the speed stage and the report still run
    (set -e used to end the script there); the exit is non-zero, naming the stage."""
    p, ran, _ = _check(tmp_path)
    steps = [next((i for i, line in enumerate(ran) if what in line), None)
             for what in ("torch.distributed.run", "gpu_speed_check", "gpu_face_check report")]
    assert None not in steps and steps == sorted(steps), ran
    assert p.returncode == 1 and "FAILED in stage(s) torch," in p.stderr, p.stderr[-2000:]


def test_every_stage_ends_at_the_one_deadline(tmp_path):
    """With 3 s left to the call's deadline, a speed stage that would take 30 s is cut at it and the report still
    runs: the whole check ends within seconds (the old speed stage had at least 30 + 60 s whatever the budget
    left). The speed stage is handed the deadline, less the report's reserve, for its own cells."""
    deadline = int(time.time()) + 3
    p, ran, took = _check(tmp_path, GPU_CHECK_DEADLINE=str(deadline), FAKE_SPEED_S="30", FAKE_TORCH_RC="0")
    assert took < 12, (took, p.stdout[-2000:])
    speed = next(line.split() for line in ran if "gpu_speed_check" in line)
    assert float(speed[speed.index("--deadline") + 1]) <= deadline - 10
    assert any("gpu_face_check report" in line for line in ran)
    assert "speed: cut at the deadline" in p.stdout and p.returncode == 0, p.stderr[-2000:]
