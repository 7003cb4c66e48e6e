"""The bench's jobs under each engine: how one job is launched, and the torch / Horovod ratio of a run.

* ``horovod`` jobs run under ``horovodrun -np N --gloo``, ``torch`` jobs under ``torchrun --nproc-per-node N
  --standalone`` (both launchers beside ``sys.executable``); each worker is told its engine and starts it
  with ``engine.select.start_engine``, which refuses an engine its launcher does not imply.
* The *limit* job runs no engine (``NO_ENGINE``): ``--limit-procs`` plain processes, rank r doing slice r.
* Every job gets one OpenMP thread per rank (torchrun would set it too); ``--cycle-time-ms`` sets
  ``HOROVOD_CYCLE_TIME`` for the Horovod jobs only.
* ``engine_ratios``: for every (mode, classes, dim, rate) that ran under both engines in the same run,
  torch's samples/s over Horovod's.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Dict, List

ENGINES = ("horovod", "torch")
NO_ENGINE = "none"
WORKER = "hvd_partialfc.tools.bench"     # the module whose ``--worker`` runs one rank


def worker_args(a, mode: str, engine: str, classes: int, dim: int, job: str, rate: float) -> List[str]:
    """The worker's command-line arguments (after ``-m WORKER``) for one job of the bench ``a``. Only the
    limit is told ``--np``: an engine's rank knows its world, and torchrun's own parser takes ``--np`` for an
    ambiguous abbreviation of its ``--nproc-per-node``."""
    args = ["--worker", mode, "--engine", engine, "--classes", str(classes), "--dim", str(dim),
            "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--in-dim", str(a.in_dim), "--job", job, "--negatives-every", str(a.negatives_every),
            "--negatives-share", str(a.negatives_share)] + (["--np", str(a.np)] if engine == NO_ENGINE else [])
    if a.in_shape:
        args += ["--in-shape", ",".join(str(s) for s in a.in_shape)]
    if a.config:
        args += ["--config", os.path.abspath(a.config)]
    for s in [*(a.set or []), f"head.sample_rate={rate}"]:
        args += ["--set", s]
    return args


HOROVODRUN_ENV = "HVD_PARTIALFC_HOROVODRUN"


def launcher_command(engine: str, np: int) -> List[str]:
    """The command that starts ``np`` ranks of ``python -m WORKER ...`` under ``engine``'s launcher: for Horovod,
    the ``horovodrun`` beside this Python, or the command in ``HVD_PARTIALFC_HOROVODRUN`` (a site's wrapper;
    the tests' tests/mr/horovodrun.py)."""
    bin_dir = os.path.dirname(sys.executable)
    if engine == "horovod":
        hvdrun = shlex.split(os.environ.get(HOROVODRUN_ENV, "")) or [os.path.join(bin_dir, "horovodrun")]
        return [*hvdrun, "-np", str(np), "--gloo", sys.executable, "-m", WORKER]
    if engine == "torch":
        return [os.path.join(bin_dir, "torchrun"), "--nproc-per-node", str(np), "--standalone", "-m", WORKER]
    raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")


def job_env(engine: str, cycle_time_ms: float) -> Dict[str, str]:
    """A job's environment: this checkout first on the paths, one OpenMP thread, Open MPI as root allowed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if engine == "horovod" and cycle_time_ms > 0:  # its background thread wakes every cycle; on a full CPU it competes
        env["HOROVOD_CYCLE_TIME"] = str(cycle_time_ms)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmds: List[List[str]], env: Dict[str, str], timeout: int) -> tuple:
    """Run the commands at once, each in its own session (on a timeout its whole group goes: the launcher
    *and* its ranks); the largest return code and the stderr of all."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              start_new_session=True) for c in cmds]
    rcs, errs = [], []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=timeout)[1])
            rcs.append(p.returncode)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            errs.append(p.communicate()[1] + f"\n[timed out after {timeout} s]")
            rcs.append(124)
    return max(rcs), "".join(errs)


def launch(a, mode: str, engine: str, classes: int, dim: int, out: str, timeout: int,
           rate: float = 1.0) -> List[Dict[str, Any]]:
    """Run one job (N ranks under ``engine``'s launcher, or the limit's plain processes); its per-rank
    records. ``rate``: ``head.sample_rate`` of the job (after the ``--set`` ones, so it wins)."""
    tag = mode if engine == NO_ENGINE else f"{mode}-{engine}"
    job = os.path.join(out, "jobs", f"{tag}-C{classes}-D{dim}" + (f"-r{rate:g}" if rate < 1.0 else ""))
    os.makedirs(job, exist_ok=True)
    args = worker_args(a, mode, engine, classes, dim, job, rate)
    if engine == NO_ENGINE:
        cmds = [[sys.executable, "-m", WORKER, *args, "--rank", str(r)] for r in range(a.limit_procs)]
    else:
        cmds = [launcher_command(engine, a.np) + args]
    rc, err = _run(cmds, job_env(engine, a.cycle_time_ms), timeout)
    files = sorted(f for f in os.listdir(job) if f.startswith("rank-"))
    if rc != 0 or not files:
        raise RuntimeError(f"bench job {tag} C={classes} D={dim} failed ({rc}):\n{err[-3000:]}")
    return [json.load(open(os.path.join(job, f))) for f in files]


def engine_ratios(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """torch / horovod samples/s for every (mode, classes, dim, rate) both engines ran, in run order."""
    by = {(p["mode"], p["classes"], p["dim"], p.get("sample_rate", 1.0), p.get("engine")): p
          for p in points if "skipped" not in p}
    out = []
    for (mode, classes, dim, rate, engine), p in by.items():
        hvd = by.get((mode, classes, dim, rate, "horovod"))
        if engine != "torch" or hvd is None:
            continue
        out.append({"mode": mode, "classes": classes, "dim": dim, "sample_rate": rate,
                    "horovod": hvd["samples_per_s"], "torch": p["samples_per_s"],
                    "torch_vs_horovod": p["samples_per_s"] / hvd["samples_per_s"]})
    return out


def ratios_markdown(ratios: List[Dict[str, Any]]) -> str:
    """The table of ``engine_ratios`` (empty string when there is none)."""
    if not ratios:
        return ""
    rows = ["| D | classes | mode | rate | horovod samples/s/rank | torch samples/s/rank | torch / horovod |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {r['dim']} | {r['classes']:,} | {r['mode']} | {r['sample_rate']:g} | {r['horovod']:.1f} | "
             f"{r['torch']:.1f} | {r['torch_vs_horovod']:.2f} |" for r in ratios]
    return "\n".join(rows)
