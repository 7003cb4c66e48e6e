"""Who may change a streaming build's work folder (`data_tools/stream.py`), and a clear refusal otherwise.

Two locks, ``flock``s on small files in the training set's work folder (``.tmp-NAME-resumable``):

* ``.lock-part-K-of-M``, exclusive, held by the process of part K/M for its whole run: a second copy of
  the same part (a re-queued array task while the first still runs) is refused before it removes the
  first's temporary shard files. A part of another split (other M) that is running is refused too: its
  shards overlap this split's.
* ``.lock-build``: shared by every running part, exclusive for `data_tools.assemble`: assemble never
  moves the folder away under a part still writing, and two assembles never interleave.

Each holder writes its pid, host, start time and command line into its lock file, and the refusal names
them. **Stale locks:** ``flock`` belongs to the open file, so the kernel drops it when its process dies,
``kill -9`` included: a crashed build never leaves a lock that blocks its re-run, and the files left
behind are only names (the next holder overwrites them; assemble removes them). On NFS (v4, or v3 with
``lockd``) ``flock`` is a POSIX lock held by the server, which drops it when the client's lease expires
(about 90 s after a node dies). On a file system without locks (Lustre mounted without ``-o flock``)
``flock`` fails and the build stops with that error: mount it with locks or build elsewhere; an
unlocked build could not tell a running copy from a dead one. Forked decode workers inherit the open
file (they are the build's own processes and end with it).
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Iterator, List

from hvd_partialfc.data.shards import ShardError

BUILD_LOCK = ".lock-build"
LOCK_PREFIX = ".lock-"


def part_lock_name(k: int, m: int) -> str:
    return f"{LOCK_PREFIX}part-{k}-of-{m}"


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "a process that has not written its name yet"
    except OSError:
        return "an unknown process"


def _try_lock(fd: int, path: str, shared: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise OSError(e.errno, f"cannot lock {path} ({e.strerror}): a streaming build needs a file system "
                               f"with flock (Lustre: mount with -o flock)") from None


@contextmanager
def hold(folder: str, name: str, what: str, shared: bool = False, make_folder: bool = True) -> Iterator[int]:
    """Hold lock ``name`` in ``folder`` for the block, or raise a ShardError naming its holder and ``what``
    (the action refused). An exclusive holder writes its pid, host, time and command line. Without
    ``make_folder``, a missing folder raises FileNotFoundError (it was moved into place meanwhile)."""
    if make_folder:
        os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd, path, shared):
            raise ShardError(f"{what}: {_holder(path)} holds {path}; wait for it to end (a dead process "
                             f"holds no lock: its kernel released it)")
        if not shared:
            os.ftruncate(fd, 0)
            os.write(fd, (f"pid {os.getpid()} on host {socket.gethostname()} since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)})").encode())
        yield fd
    finally:
        os.close(fd)          # releases the lock


def running_parts(folder: str) -> List[str]:
    """The part locks in ``folder`` that a live process holds: their holders' lines."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith(f"{LOCK_PREFIX}part-"):
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                if not _try_lock(fd, path, shared=True):
                    out.append(f"{name[len(LOCK_PREFIX):]}: {_holder(path)}")
            finally:
                os.close(fd)
    return out
