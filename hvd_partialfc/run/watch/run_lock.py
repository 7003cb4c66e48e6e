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

A run folder shared by a group (``chmod 2775``, or g+w without the setgid bit): the lock file takes the folder's
group and its group (and other) read and write bits, whatever the umask, so each member can open it read-write
and lock it; a file that an earlier start left without them is fixed by its owner's next start. A member who
still cannot write it is told whether a job holds it now (a shared lock through a read-only open tells, as
``in_use`` does for every user) and, when none does, what to do, never refused for ever without a word. A user
who cannot read it gets "cannot tell" (``CannotTell``), never a wrong "not in use".
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import pwd
import socket
import stat
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


class CannotTell(Exception):
    """This user cannot see whether a job holds the run folder's lock (the folder or the lock file unreadable)."""


def _holder(fd: int) -> str:
    """Who holds (or last held) the lock open as ``fd``, in words, from what it wrote into it."""
    try:
        h = json.loads(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h["since"]))
        return f"host {h['host']}, pid {h['pid']}" + (f", {h['job']}" if h.get("job") else "") + f", since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not say who it is"


def _open(path: str, flags: int, mode: int = 0o644) -> int:
    """``path`` opened without following a link or waiting on a planted FIFO; anything but a plain file refused."""
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file", path)
    return fd


def _share(fd: int, run_dir: str) -> None:
    """Give the lock file this process owns the run folder's group and its read and write bits (group, other):
    in a folder its group shares, every member must open it read-write to lock it, and the umask (022, 077) or
    a folder without the setgid bit would keep them out."""
    st, folder = os.fstat(fd), os.stat(run_dir)
    if st.st_uid != os.geteuid():
        return
    if folder.st_mode & stat.S_IWGRP and st.st_gid != folder.st_gid:
        try:
            os.fchown(fd, -1, folder.st_gid)
        except OSError:        # not a member of the folder's group: its members are then the folder's others
            pass
    want = stat.S_IMODE(st.st_mode) | (folder.st_mode & (stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH))
    if want != stat.S_IMODE(st.st_mode):
        os.fchmod(fd, want)


def _not_writable(path: str, fd: int) -> str:
    """The refusal when this user may read the lock but not write it (a file an earlier version made 0644 in a
    folder its group shares) and no job holds it: whose file it is and how it gets fixed, not a bare EACCES."""
    st = os.fstat(fd)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    return (f"the run folder's lock {path} is {owner}'s, mode {stat.S_IMODE(st.st_mode):04o}, and not writable "
            f"by this user, so this job cannot take it; no job holds it now. Its owner's next start here makes it "
            f"writable by the folder's group (or: chmod g+w {path}), or remove it while no job runs")


def hold(run_dir: str, wait_s: float, say: Callable[[str], None] = print) -> Optional[str]:
    """Take ``run_dir``'s lock for this process (kept until ``release`` or the process's end); the one line
    refusing the start when another process holds it for ``wait_s`` seconds (or when this user may not write
    the lock file: ``_not_writable``), else None."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    key = os.path.realpath(path)
    if key in _HELD:
        return None
    try:
        fd, writable = _open(path, os.O_RDWR | os.O_CREAT), True
        _share(fd, run_dir)
    except PermissionError as e:   # another member's file, made before locks were shared: is it held?
        try:
            fd, writable = _open(path, os.O_RDONLY), False
        except OSError:
            return f"cannot open the run folder's lock {path}: {e.strerror}"
    except OSError as e:
        return f"cannot open the run folder's lock {path}: {e.strerror}"
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.lockf(fd, (fcntl.LOCK_EX if writable else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            if writable:
                break
            line = _not_writable(path, fd)
            os.close(fd)
            return line
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                return f"cannot lock the run folder {run_dir} ({path}: {e.strerror})"
        if time.monotonic() >= deadline:
            line = (f"the run folder {run_dir} is in use by another job ({_holder(fd)}): two jobs would write "
                    "each other's checkpoints; wait for it to end (or stop it), or train into another --out")
            os.close(fd)
            return line
        if not said:
            say(f"waiting up to {wait_s:.0f} s for the run folder {run_dir}: another job holds it ({_holder(fd)})")
            said = True
        time.sleep(1.0)
    who = {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(os.environ), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(who) + "\n").encode(), 0)
    _HELD[key] = fd
    return None


def in_use(run_dir: str) -> Optional[str]:
    """Who trains into ``run_dir`` now (``_holder``'s words), or None when no process holds its lock (doctor);
    ``CannotTell`` when this user cannot see. The probe is a shared lock through a read-only open, which every
    user who may read the file can take (a job's exclusive lock refuses it), dropped at once."""
    path = os.path.join(run_dir, LOCK)
    if os.path.realpath(path) in _HELD:
        return "this process"      # a probe from here would drop its own lock (POSIX locks go with any close)
    try:
        fd = _open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CannotTell(f"{path}: {e.strerror}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return _holder(fd)
        raise CannotTell(f"{path}: {e.strerror}") from None
    finally:
        os.close(fd)


def release() -> None:
    """Drop every run folder lock this process holds (the end of ``train``, of a simulation)."""
    while _HELD:
        _, fd = _HELD.popitem()
        os.close(fd)
