"""A job its launcher may restart resumes its latest checkpoint (``checkpoint.resume: auto``), or it does not
start: a torchrun restart with ``checkpoint.resume`` unset started again from step 0 and set every newer
checkpoint aside (run/ckpt/resume.py, ``check_restarts_resume``)."""
from __future__ import annotations

import os

import pytest

from conftest import TORCHRUN, launch_env, run_job, small_run_argv
from hvd_partialfc.config import ConfigError
from hvd_partialfc.run.ckpt.resume import check_restarts_resume


@pytest.mark.parametrize("environ, launcher", [
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}, "torchrun --max-restarts 3"),
    ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "1"}, "this worker is restart 1"),
    ({"HVD_PARTIALFC_RESTART_COUNT": "0"}, "launch/horovod_restarts.py"),
])
def test_a_restartable_job_must_resume_auto(environ, launcher):
    for value in ("", "/some/run/checkpoints/step-00000010"):
        with pytest.raises(ConfigError, match=launcher):
            check_restarts_resume(value, environ)
    check_restarts_resume("auto", environ)


def test_a_job_without_restarts_may_start_anywhere():
    for environ in ({}, {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}):
        check_restarts_resume("", environ)
        check_restarts_resume("/some/checkpoint", environ)


@pytest.mark.multirank
def test_torchrun_with_restarts_and_no_resume_is_refused_before_training(small_run_shards, tmp_path):
    """Under real torchrun (--max-restarts 1): the worker exits 2 with the one line, before any step, and the
    restarted worker again; no checkpoint is written. One worker: the check reads what the agent sets in every
    worker's environment, alike for each (its cases: the tests above), so a second one would only cost its start."""
    run = tmp_path / "run"
    cmd = [TORCHRUN, "--nproc-per-node", "1", "--standalone", "--max-restarts", "1", "--monitor-interval", "0.5",
           *small_run_argv(small_run_shards, run, 10, ["checkpoint.resume="])]
    p = run_job(cmd, launch_env(), 120)
    assert p.returncode != 0
    assert p.stderr.count("checkpoint.resume unset under torchrun --max-restarts 1: a restart would start again") == 2
    assert not os.path.exists(run / "checkpoints")
