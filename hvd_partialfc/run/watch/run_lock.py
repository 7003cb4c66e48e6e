"""One job a run folder: while a job trains, its rank 0 holds ``RUN/lock``, and a second job is refused.

Why: two jobs training into one run folder at once (two torchrun agents given different ``--rdzv-id`` form
two jobs; a requeued job beside the one still running) write each other's checkpoints, ``latest`` and
snapshots, and nothing said so. How: rank 0 takes an exclusive ``fcntl`` record lock (``lockf``) on
``RUN/lock`` before the run folder is written, and writes who holds it (host, process, launcher's job id,
since when) into the file. The kernel drops the lock when the process ends, however it ends (a SIGKILL,
a lost node's processes), so a restart never finds a stale lock on a local file system. POSIX record locks
are what NFS (v3 with lockd, v4 natively) carries between hosts, unlike ``flock`` on older kernels, and a
forked DataLoader worker never holds one. On NFS a lost node's lock lasts until its lease ends (about 90 s
by default): a start waits up to ``WAIT_S`` for the lock, saying once whom it waits for, then refuses with
one line that names the holder (``checkpoint.lock_wait``). Not a collective; no Horovod.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Callable, Dict, Optional

LOCK = "lock"
_HELD: Dict[str, int] = {}           # this process's locks: the lock file's real path -> its descriptor


def _job_id(environ) -> str:
    for var, what in (("SLURM_JOB_ID", "Slurm job"), ("TORCHELASTIC_RUN_ID", "torchrun rdzv id"),
                      ("OMPI_MCA_orte_hnp_uri", "mpirun")):
        if environ.get(var):
            return f"{what} {environ[var].split(';')[0]}"
    return ""


def holder(path: str) -> str:
    """Who holds (or last held) the lock ``path``, in words, from what it wrote into it."""
    try:
        with open(path) as f:
            h = json.load(f)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h["since"]))
        return f"host {h['host']}, pid {h['pid']}" + (f", {h['job']}" if h.get("job") else "") + f", since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not say who it is"


def hold(run_dir: str, wait_s: float, say: Callable[[str], None] = print) -> Optional[str]:
    """Take ``run_dir``'s lock for this process (kept until ``release`` or the process's end); the one line
    refusing the start when another process holds it for ``wait_s`` seconds, else None."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    key = os.path.realpath(path)
    if key in _HELD:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        return f"cannot open the run folder's lock {path}: {e.strerror}"
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                return f"cannot lock the run folder {run_dir} ({path}: {e.strerror})"
        if time.monotonic() >= deadline:
            os.close(fd)
            return (f"the run folder {run_dir} is in use by another job ({holder(path)}): two jobs would write "
                    "each other's checkpoints; wait for it to end (or stop it), or train into another --out")
        if not said:
            say(f"waiting up to {wait_s:.0f} s for the run folder {run_dir}: another job holds it ({holder(path)})")
            said = True
        time.sleep(1.0)
    who = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(os.environ), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(who) + "\n").encode(), 0)
    _HELD[key] = fd
    return None


def in_use(run_dir: str) -> Optional[str]:
    """Who trains into ``run_dir`` now (``holder``'s words), or None when no process holds its lock (doctor).
    The probe takes the lock and drops it at once when it is free."""
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except OSError:
        return holder(path)
    finally:
        os.close(fd)


def release() -> None:
    """Drop every run folder lock this process holds (the end of ``train``, of a simulation)."""
    while _HELD:
        _, fd = _HELD.popitem()
        os.close(fd)
