"""The elastic launchers themselves, run as a user runs them: ``bash launch/torchrun.sh`` (one node, 2 ranks,
stopped by a signal to one of them) and ``bash launch/slurm_torchrun.sbatch`` under a fake ``srun`` and
``scontrol`` (small scripts first on PATH: ``srun`` starts its command once per node, each in a session of its
own with SLURM_NODEID / SLURM_PROCID / SLURMD_NODENAME set, and returns the first non-zero status; ``scontrol
show hostnames`` prints ``localhost`` once per node; every call is recorded). Two "nodes" of one rank on this
host, each with its own memory-snapshot root (``MEMORY_DIR`` with ``%n``), the job run to its end, and stopped
by Slurm's time-limit signal (requeued). The small MLP job of conftest.py; the rendezvous on a free port; the
ranks' exit folder in the submit directory (the test's folder)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from conftest import BIN, ROOT, SMALL_RUN, free_port, launch_env, signal_rank_1_once_checkpointing

pytestmark = pytest.mark.multirank
TORCHRUN_SH = os.path.join(ROOT, "launch", "torchrun.sh")
SBATCH = os.path.join(ROOT, "launch", "slurm_torchrun.sbatch")

FAKE_SRUN = r"""#!/usr/bin/env bash
# fake srun: its command once per node, each in a session of its own (as slurmstepd starts a task)
echo "$*" >> "$FAKE_LOG/srun.calls"
while [ $# -gt 0 ]; do
  case "$1" in
    --*=*) shift ;;
    --ntasks-per-node|--cpus-per-task|--nodes|--ntasks|-N|-n) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_ID=0 SLURMD_NODENAME=localhost setsid "$@" &
  pids+=($!)
  echo "$!" >> "$FAKE_LOG/tasks"
done
status=0
for p in "${pids[@]}"; do
  rc=0; wait "$p" || rc=$?
  [ "$status" -ne 0 ] || status=$rc
done
exit "$status"
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG/scontrol.calls"
if [ "$1 $2" = "show hostnames" ]; then
  for ((i = 0; i < ${FAKE_NODES:-2}; i++)); do echo localhost; done
fi
"""


def train_args(steps, sets=()):
    """The extra arguments after the scripts' own: the small job, ``steps`` steps (its --resume auto the scripts')."""
    out = ["--steps", str(steps)]
    for s in [s for s in SMALL_RUN if not s.startswith("checkpoint.resume=")] + list(sets):
        out += ["--set", s]
    return out


def script_env(tmp_path, **more):
    """The job's environment: this venv (VENV), this checkout first on the path, the temporary files in tmp_path.
    The rendezvous keeps the scripts' settings (torch's): the suite's short last call (3 s, tests/test_elastic.py)
    let an agent that started 3 s after the other on the loaded 2 cores miss the first round (a round of one)."""
    return dict(launch_env(), VENV=os.path.dirname(BIN), TMPDIR=str(tmp_path), **{k: str(v) for k, v in more.items()})


def kill_tree(proc):
    """The process and everything it started (the fake srun's tasks are in sessions of their own)."""
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def run_script(cmd, env, cwd, timeout=150):
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate()
    return proc.returncode, out.replace("\r", "\n")


def latest(run):
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((ckpt / "meta.json").read_text())


def checkpoints(run):
    from hvd_partialfc.run_files import list_checkpoints
    return list_checkpoints(str(run))


def metrics(run):
    return [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]


def trained_by_two(run):
    """A step logged by 2 ranks (the job formed, every agent past its start-up) in the run's metrics so far."""
    try:
        with open(run / "metrics.jsonl") as f:
            return any('"world_size": 2' in line and '"loss"' in line for line in f)
    except FileNotFoundError:
        return False


def fake_slurm(tmp_path, job_id, shards, nodes=2):
    """A fake srun and scontrol first on PATH; the environment of a job of ``nodes`` nodes of one rank."""
    fake, log = tmp_path / "bin", tmp_path / "slurm"
    fake.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    for i in range(nodes):
        (tmp_path / f"mem{i}").mkdir()
    env = script_env(tmp_path, SLURM_JOB_ID=job_id, SLURM_NNODES=nodes, SLURM_JOB_NODELIST="localhost",
                     SLURM_SUBMIT_DIR=ROOT, FAKE_LOG=log, FAKE_NODES=nodes, NPROC=1, RDZV_PORT=free_port(),
                     MEMORY_DIR=tmp_path / "mem%n", MEMORY_EVERY=5, SHARDS=shards, RUN=tmp_path / "run")
    env["PATH"] = str(fake) + os.pathsep + env["PATH"]
    return env, log


def calls(log, name):
    path = log / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


def test_torchrun_sh_one_node_of_two_ranks_a_signal_to_one_rank_checkpoints_every_rank(small_run_shards, tmp_path,
                                                                                         capfd):
    """``bash launch/torchrun.sh`` on one node of two ranks, and a stop signal (SIGTERM) to ONE rank of it: every
    rank agrees (the torch engine's vote), checkpoints and exits 75; torchrun says 1 and the script exits 75, the
    ranks' status read from its own exit folder (removed after); time-based checkpoints appear meanwhile (each
    written once); the stop's checkpoint resumes (under ``simulate --ranks 2`` in this process: the files, not
    the engine, are under test there). MAX_RESTARTS=0: with restarts left the agent would restart its workers
    after their 75 (a stop meant for the whole job reaches the agents: the requeue test below). Horovod's case,
    under launch/horovod_restarts.py: tests/test_checkpoints.py::test_signal_to_one_rank_checkpoints_every_rank.
    This was two launches of two ranks (the torchrun case there, and this script trained to its end here; the
    end through this script: test_slurm_sbatch_trains_two_nodes_through_torchrun_sh)."""
    from hvd_partialfc.config_io import load_config
    from conftest import simulate_here
    run = tmp_path / "run"
    (tmp_path / "mem").mkdir()
    env = script_env(tmp_path, RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID=f"launchers-{os.getpid()}",
                     MEMORY_EVERY=5, MEMORY_DIR=tmp_path / "mem", MAX_RESTARTS=0)
    sets = ["checkpoint.every_minutes=0.01", "checkpoint.keep=1000"]
    proc = subprocess.Popen(["bash", TORCHRUN_SH, small_run_shards, str(run), "2", "1", *train_args(100000, sets)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = signal_rank_1_once_checkpointing(proc, run, signal.SIGTERM, "RANK", 120, kill_tree).replace("\r", "\n")
    assert proc.returncode == 75, out[-4000:]
    assert "[rank 1] stopped by SIGTERM" in out and "[rank 0] stopped by a stop signal on another rank" in out
    assert "the ranks' last exit status: 75; exit 75" in out, out[-4000:]
    assert "memory snapshots every 5 steps" in out, out[-4000:]
    assert not list(tmp_path.glob("hvd_partialfc-exit.*"))                       # its own exit folder, removed
    meta = latest(run)
    assert meta["world_size"] == 2 and 0 < meta["step"] < 100000 and meta["identical"]
    assert {r["world_size"] for r in metrics(run)} == {2}
    # the stop's own checkpoint, at or after the last step logged
    assert meta["step"] >= max(r["step"] for r in metrics(run))
    written = [int(s[5:]) for s in checkpoints(run)]
    assert len(written) >= 3     # time-based (every 0.6 s), then the stop's
    assert all(b - a > 1 for a, b in zip(written[:-2], written[1:-1]))   # a due checkpoint is written once
    capfd.readouterr()
    cfg = load_config(os.path.join(ROOT, "configs", "example.yaml"),
                      [*SMALL_RUN, *sets, f"data.shards={small_run_shards}", f"out={run}",
                       f"train.steps={meta['step'] + 2}"])
    result = simulate_here(cfg, 2)
    assert f"at step {meta['step']}" in "".join(capfd.readouterr())
    assert result.checkpoint.endswith(f"step-{meta['step'] + 2:08d}")


def test_slurm_sbatch_trains_two_nodes_through_torchrun_sh(small_run_shards, tmp_path):
    job = f"{os.getpid()}1"
    env, log = fake_slurm(tmp_path, job, small_run_shards)
    rc, out = run_script(["bash", SBATCH, *train_args(20)], env, tmp_path)     # the submit directory
    assert rc == 0, out[-4000:]
    assert "done:" in out, out[-4000:]
    # a root per node (one folder for both is refused), a copy on the other node
    assert re.search(r"memory snapshots every 5 steps in \S+/mem[01] on 2 node\(s\)", out), out[-4000:]
    meta = latest(tmp_path / "run")
    assert (meta["step"], meta["world_size"]) == (20, 2)
    assert {r["world_size"] for r in metrics(tmp_path / "run")} == {2}
    assert calls(log, "scontrol") == ["show hostnames localhost"]            # the rendezvous host; no requeue
    assert len(calls(log, "srun")) == 1 and "--ntasks-per-node 1" in calls(log, "srun")[0]
    assert "torchrun on 1 to 2 node(s)" in out and f"rendezvous localhost:{env['RDZV_PORT']}, id {job}" in out
    assert not list(tmp_path.glob(".hpfc-exit-*"))                                  # the ranks' exit folder, removed


def test_slurm_sbatch_requeues_a_run_stopped_by_the_time_limit_signal(small_run_shards, tmp_path):
    """Slurm's --signal=USR1@300, as slurmstepd sends it: to each task's process group (launch/torchrun.sh and
    its torchrun agent; the ranks are in sessions of their own: their agent passes it on). Every rank
    checkpoints and exits 75, torchrun says 1, launch/torchrun.sh 75, and the script requeues the job."""
    import torch
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 9):
        pytest.skip("torchrun handles SIGUSR1 from torch 2.9 on")
    job, run = f"{os.getpid()}2", tmp_path / "run"
    env, log = fake_slurm(tmp_path, job, small_run_shards)
    steps = 5000
    logfile = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(["bash", SBATCH, *train_args(steps, ["train.log_every=1"])], env=env, cwd=tmp_path,
                            stdout=logfile, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not trained_by_two(run):
            assert proc.poll() is None and time.time() < deadline, "no step logged by 2 ranks"
            time.sleep(0.2)
        tasks = [int(x) for x in (log / "tasks").read_text().split()]
        assert len(tasks) == 2
        for pid in tasks:                                   # each task's process group, as slurmstepd does
            os.killpg(pid, signal.SIGUSR1)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.wait()
        logfile.close()
        out = (tmp_path / "job.log").read_text().replace("\r", "\n")
    assert proc.returncode == 0, out[-4000:]
    assert f"requeue {job}" in calls(log, "scontrol"), out[-4000:]
    assert f"requeueing job {job}" in out
    stopped = re.findall(r"\[rank \d\] stopped by (.+?) after checkpoint", out)     # each rank, or its neighbour
    assert set(stopped) & {"SIGUSR1", "SIGTERM"}, out[-4000:]
    assert out.count("the ranks' last exit status: 75; exit 75") == 2, out[-4000:]
    meta = latest(run)
    assert meta["world_size"] == 2 and 1 <= meta["step"] < steps
    assert not list(tmp_path.glob(".hpfc-exit-*"))
