"""The torch engine's timeout and bucket order (engine/torchdist.py), on 2 ranks started as torchrun starts them.

* ``train.collective_timeout``: a rank that waits in a collective longer than it fails, one that waits less
  does not (torch's default was 30 minutes: ranks waiting while rank 0 evaluated alone died there);
* buckets start in one order on every rank: a model with a branch one rank skips is averaged exactly as the
  offline average of each rank's gradients (a missing one as zeros), bitwise; before, the k-th all-reduces
  paired different buckets and the averages were wrong.
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import MR, ROOT, free_port, launch_env

pytestmark = [pytest.mark.multirank, pytest.mark.serial]     # a time bound: run alone (setup.cfg)


def _two_ranks(*args, timeout=120):
    """torch_engine_job.py as two ranks started with the variables torchrun gives its workers (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), as tests/test_heartbeat.py starts its jobs: what is under test is
    the engine, which reads that environment, not torchrun's agent (a third process, ~3 CPU-s, that it ran under
    before). A CompletedProcess: rank 0's output then rank 1's, the first non-zero exit status (else 0)."""
    port, procs = free_port(), []
    for r in range(2):
        env = dict(launch_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(MR, "torch_engine_job.py"), *map(str, args)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(procs[0].args, code, "".join(o for o, _ in outs), "".join(e for _, e in outs))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """ONE launch of two ranks for both tests below (torch_engine_job.py branch-then-wait): the engine started
    with a 2 s collective timeout, the buckets' averages written to OUT, then rank 1 arrives 0.5 s late
    (fine), then 5 s late (not). (The process, OUT)."""
    out = tmp_path_factory.mktemp("torch_engine")
    return _two_ranks("branch-then-wait", out, 2, 0.5, 5), out


def test_a_collective_waits_as_long_as_the_timeout_says(job):
    p, _ = job
    lines = [x for x in p.stdout.splitlines() if x.startswith("[rank 0]")]
    assert len(lines) == 2 and lines[0].startswith("[rank 0] ok after"), p.stdout + p.stderr[-2000:]
    assert lines[1].startswith("[rank 0] failed after"), p.stdout + p.stderr[-2000:]
    took = float(lines[1].split("failed after ")[1].split()[0])
    assert 1.5 <= took < 5, took


def test_the_config_key_reaches_the_engine():
    from hvd_partialfc.config import ConfigError
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.run.ckpt.resume import RESUME_FREE_KEYS
    cfg = load_config(None, ["train.collective_timeout=90"], {"data": {"shards": "x"}})
    assert cfg.train.collective_timeout == 90.0 and "train.collective_timeout" in RESUME_FREE_KEYS
    with pytest.raises(ConfigError, match="collective_timeout"):
        load_config(None, ["train.collective_timeout=0"], {"data": {"shards": "x"}})


def test_buckets_pair_alike_when_one_rank_skips_a_branch(job):
    p, out = job
    assert p.returncode == 0, p.stderr[-3000:]
    for r in (0, 1):
        got = torch.load(out / f"rank-{r}.pt", weights_only=True)
        assert got["buckets"] == 3
        for name, want in got["offline"].items():
            assert torch.equal(got["averaged"][name], want), (r, name, (got["averaged"][name] - want).abs().max())
