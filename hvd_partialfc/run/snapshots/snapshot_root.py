"""A node's snapshot root (``checkpoint.memory_dir``, default ``/dev/shm``; ``$HVD_PARTIALFC_MEMORY_DIR`` overrides
it): where it is, which ranks share it, whether it can hold the snapshots (free space, memory available) and whether
it can hold them safely (its owner and mode; a folder in it that is not this user's own). memory_store.py's folder
lives in it; doctor and the start-up check use the rest. No collective, no Horovod.
"""
from __future__ import annotations

import os
import pwd
import socket
import stat
from typing import Optional

from ...sizes import human

ENV_DIR = "HVD_PARTIALFC_MEMORY_DIR"


def memory_root(configured: str) -> str:
    """The node's snapshot root: ``$HVD_PARTIALFC_MEMORY_DIR`` (a launcher's per-node setting), else the config's."""
    return os.environ.get(ENV_DIR) or configured or "/dev/shm"


def node_key(root: str) -> str:
    """Which ranks share a node's memory: the host name, this boot, and the snapshot root (two network-namespace
    "nodes" of one machine differ by their roots)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}|{os.path.realpath(root)}"


def mem_available() -> Optional[int]:
    """The kernel's estimate of memory available to new allocations (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def room_error(root: str, need: int, ranks: int) -> Optional[str]:
    """Why ``need`` bytes of snapshots (this node's: ``ranks`` ranks' slices, their buddies' copies, the backbone,
    two snapshots at a time) do not fit the node, or None. Both limits count: the root's free space (a tmpfs
    has its own size: Docker's /dev/shm is 64 MB unless ``--shm-size``) and the memory available."""
    try:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        return f"checkpoint.memory_every: the snapshot folder {root} cannot be used: {e.strerror}"
    avail = mem_available()
    limits = [(free, f"{root} has {human(free)} free")]
    if avail is not None:
        limits.append((avail, f"the node has {human(avail)} of memory available"))
    short = [why for have, why in limits if need > have]
    if not short:
        return None
    return (f"checkpoint.memory_every: this node's snapshots need {human(need)} (the classifier slices of its "
            f"{ranks} rank(s) and their buddies' copies, the backbone, two snapshots at a time), but "
            f"{' and '.join(short)}; "
            f"lower the ranks per node, point {ENV_DIR} (or checkpoint.memory_dir) at a larger tmpfs, or set "
            "checkpoint.memory_every=0")


def _whose(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def not_mine(st: os.stat_result, private: bool = True) -> Optional[str]:
    """Why the folder of ``st`` is not one of this user's (not a folder, another owner) or, if ``private``, is open
    to group or others, else None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid():
        return f"owned by {_whose(st.st_uid)}"
    if private and st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    return None


def foreign(name: str, dir_fd: Optional[int] = None, private: bool = True) -> Optional[str]:
    """Why ``name`` (in the open folder ``dir_fd``) is not a folder of this user or is not private, else None.
    A link is judged, never what it points to."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(name, dir_fd=dir_fd)})"
    return not_mine(st, private)


def root_error(root: str, st: Optional[os.stat_result] = None) -> Optional[str]:
    """Why ``root`` (``st``: its stat, of the descriptor the store holds) cannot hold snapshots safely, else None:
    missing, not a folder, owned by a user other than root and this one (a folder's owner may rename what is in
    it, sticky bit or not), or writable by others without the sticky bit (anyone could then rename this user's
    folder and put another in its place)."""
    try:
        st = st or os.stat(root)
    except OSError as e:
        return f"checkpoint.memory_every: the snapshot folder {root} cannot be used: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"checkpoint.memory_every: the snapshot folder {root} is not a folder"
    if st.st_uid not in (0, os.geteuid()):
        return (f"checkpoint.memory_every: the snapshot folder {root} is owned by {_whose(st.st_uid)}, who may rename "
                f"what is in it: point {ENV_DIR} (or checkpoint.memory_dir) at a folder of root's (as /dev/shm) or "
                "your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"checkpoint.memory_every: the snapshot folder {root} (mode {stat.S_IMODE(st.st_mode):04o}) lets "
                "other users rename what is in it: give it the sticky bit (chmod +t, as /dev/shm has), or point "
                f"{ENV_DIR} (or checkpoint.memory_dir) at a folder of your own")
    return None
