"""One node's memory snapshots: a folder of the run's own in the node's shared memory, private to its owner.

Layout (``ROOT`` is ``checkpoint.memory_dir``, default ``/dev/shm``; ``$HVD_PARTIALFC_MEMORY_DIR`` overrides it)::

    ROOT/hvd_partialfc-<name>/                      0700; <name>: a hash of the run's token and its run folder
        owner.json                                  the run folder and its token: whose snapshots these are
        step-00000120.<segment>/                    a committed snapshot (every copy of every slice landed)
            classifier-00002-of-00004.pt            a rank of this node, or a rank whose buddy is on this node
            backbone.pt, meta.json                  written by the node's first rank (every rank holds the backbone)
        step-00000140.<segment>.partial/            a snapshot still landing: never used alone

Every file is 0600. ``/dev/shm`` is every user's: the name cannot be predicted without the run's token
(``RUN/run_id``, 0600), and two run folders never share one (a copy of a run folder resumed beside it has
the same token). A folder that is there already is used only if it is this user's own, a folder and not a
link, private (no access for group or others) and its owner.json names this run: anything else is refused
with one line (``StoreError``) and left as it is, so a planted folder is never restored from and a planted
link never makes a clean-up delete what it points to. The root must not let other users rename what is in
it (a group- or world-writable root needs the sticky bit, as /dev/shm and /tmp have it).

``<segment>`` is the start that took the snapshot (8 hex digits drawn at each start): a node that rejoins
holds an old start's snapshots, which may have the same step as this start's; memory_recover.py never
combines files of two segments. The files are a checkpoint's own (run/ckpt/checkpoint.py), so a snapshot restores
through ``checkpoint.load`` and re-shards through the same row-cutting. Not a collective; no Horovod.
"""
from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import socket
import stat
import threading
import time
from typing import Dict, List, Optional, Tuple

from ... import atomic
from ...run_files import step_dir_name
from ...sizes import human

ENV_DIR = "HVD_PARTIALFC_MEMORY_DIR"
PREFIX = "hvd_partialfc-"
PARTIAL = ".partial"


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


def _mark(key: str) -> str:
    return "node-" + hashlib.sha256(key.encode()).hexdigest()[:16]


Key = Tuple[str, int]                  # a snapshot: (the segment that took it, its step)
_STEP = re.compile(r"^step-(\d{8,})\.([0-9a-f]{8})(\.partial)?$")


class StoreError(RuntimeError):
    """A snapshot folder or root that is not safely this run's: the one line that refuses it."""


def store_name(token: str, run_dir: str) -> str:
    """The folder's name in the root: unpredictable without the token, distinct for two run folders."""
    digest = hashlib.sha256(f"{token}\0{os.path.realpath(run_dir)}".encode()).hexdigest()
    return PREFIX + digest[:32]


def _whose(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def foreign(path: str, private: bool = True) -> Optional[str]:
    """Why ``path`` is not a folder of this user (a link, not a folder, another owner) or, if ``private``, is
    open to group or others, else None. ``lstat``: a link is judged, never what it points to."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a folder"
    if st.st_uid != os.geteuid():
        return f"owned by {_whose(st.st_uid)}"
    if private and st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    return None


def root_error(root: str) -> Optional[str]:
    """Why ``root`` cannot hold snapshots safely, else None: missing, not a folder, or writable by others
    without the sticky bit (anyone could then rename this user's folder and put another in its place)."""
    try:
        st = os.stat(root)
    except OSError as e:
        return f"checkpoint.memory_every: the snapshot folder {root} cannot be used: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"checkpoint.memory_every: the snapshot folder {root} is not a folder"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"checkpoint.memory_every: the snapshot folder {root} (mode {stat.S_IMODE(st.st_mode):04o}) lets "
                "other users rename what is in it: give it the sticky bit (chmod +t, as /dev/shm has), or point "
                f"{ENV_DIR} (or checkpoint.memory_dir) at a folder of your own")
    return None


class NodeStore:
    """The snapshot folder of one run on this node (see the module's docstring). ``segment``: this start's."""

    def __init__(self, root: str, token: str, run_dir: str, segment: str = "00000000"):
        self.root, self.token, self.segment = root, token, segment
        self.run_dir = os.path.realpath(run_dir)
        self.path = os.path.join(root, store_name(token, run_dir))
        self.opened = False         # open() made it or took it as this run's own (only then may it be removed)
        self._lock = threading.Lock()

    def open(self) -> None:
        """Make the folder (0700), or take the one there if it is this run's own; StoreError otherwise."""
        error = root_error(self.root)
        if error:
            raise StoreError(error)
        owner = os.path.join(self.path, "owner.json")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            why = foreign(self.path)
            if why is None:
                try:
                    with open(owner) as f:
                        mine = json.load(f) == {"run_dir": self.run_dir, "token": self.token}
                except (OSError, ValueError):
                    mine = False
                why = None if mine else "its owner.json does not name this run"
            if why:
                raise StoreError(f"checkpoint.memory_every: {self.path} is there already and is not this run's "
                                 f"snapshot folder: {why}. It was neither used nor changed; remove it if it is "
                                 f"yours, or point {ENV_DIR} (or checkpoint.memory_dir) at a folder of your own")
            self.opened = True
            return
        self.opened = True
        os.chmod(self.path, 0o700)         # whatever the umask
        atomic.write_text(owner, json.dumps({"run_dir": self.run_dir, "token": self.token}), mode=0o600)

    def step_path(self, step: int, committed: bool, segment: Optional[str] = None) -> str:
        name = f"{step_dir_name(step)}.{segment or self.segment}"
        return os.path.join(self.path, name + ("" if committed else PARTIAL))

    def write(self, step: int, name: str, fill) -> str:
        """File ``name`` of this segment's snapshot of ``step`` (still landing), whole or not at all, 0600:
        ``fill(f)`` writes it into an open binary file (bytes: written as they are)."""
        folder = self.step_path(step, committed=False)
        try:        # not makedirs: a store removed at the run's end is not made again by a late copy
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        path = os.path.join(folder, name)
        with atomic.atomic_path(path, mode=0o600) as tmp, open(tmp, "wb") as f:   # ".tmp-" in its name: unlisted
            f.write(fill) if isinstance(fill, bytes) else fill(f)
        return path

    def find(self, key: Key, name: str) -> Optional[str]:
        """The file ``name`` of the snapshot ``key`` on this node, committed or landing, else None."""
        for committed in (True, False):
            path = os.path.join(self.step_path(key[1], committed, key[0]), name)
            if os.path.isfile(path):
                return path
        return None

    def _folders(self) -> List[Tuple[str, Key, bool]]:
        """Every snapshot folder here: (its name, its key, committed)."""
        try:
            entries = os.listdir(self.path)
        except OSError:
            return []
        out = []
        for d in entries:
            m = _STEP.match(d)
            if m:
                out.append((d, (m.group(2), int(m.group(1))), m.group(3) is None))
        return out

    def listing(self) -> Dict[Key, Tuple[bool, List[str]]]:
        """Every snapshot on this node: (segment, step) -> (committed, the files in it)."""
        out: Dict[Key, Tuple[bool, List[str]]] = {}
        for d, key, committed in self._folders():
            try:
                files = sorted(f for f in os.listdir(os.path.join(self.path, d)) if ".tmp-" not in f)
            except OSError:
                continue
            if committed or key not in out:
                out[key] = (committed or out.get(key, (False,))[0], files)
        return out

    def commit(self, step: int) -> None:
        """This segment's snapshot of ``step`` is complete everywhere: its folder takes its final name, and the
        older snapshots of this node go (a newer one may be landing already). Idempotent, and safe from two
        threads (the loop's vote and rank 0's message may both commit it)."""
        if not self.opened:
            return
        with self._lock:
            partial, final = self.step_path(step, False), self.step_path(step, True)
            if os.path.isdir(partial):
                if os.path.isdir(final):
                    shutil.rmtree(final)
                os.rename(partial, final)
            for d, (_, s), _ in self._folders():
                if s < step:
                    shutil.rmtree(os.path.join(self.path, d), ignore_errors=True)

    def keep_only(self, key: Optional[Key]) -> None:
        """Remove every folder in the store (snapshots, views) but the snapshot ``key`` (None: all of them);
        that one is committed here if it was landing. Only in a folder ``open`` took as this run's own."""
        if not self.opened:
            return
        keep = None
        if key is not None:
            partial, keep = self.step_path(key[1], False, key[0]), self.step_path(key[1], True, key[0])
            if os.path.isdir(partial) and not os.path.isdir(keep):
                os.rename(partial, keep)
        for d in os.listdir(self.path) if os.path.isdir(self.path) else ():
            full = os.path.join(self.path, d)
            if full != keep and os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)

    def mark_node(self, key: str) -> None:
        """Leave this node's mark in the folder (``other_nodes`` finds a folder that several nodes share)."""
        atomic.write_text(os.path.join(self.path, _mark(key)), key + "\n", mode=0o600)

    def other_nodes(self, key: str, keys) -> Optional[str]:
        """The other nodes of this job that marked this folder (a shared file system given as every node's
        memory), in words, else None. Marks of nodes outside the job are another job's, and ignored."""
        others = [k for k in sorted(keys) if k != key and os.path.exists(os.path.join(self.path, _mark(k)))]
        return ", ".join(k.split("|")[0] for k in [key] + others) if others else None

    def remove(self) -> None:
        """Remove the folder (never through a link); a copy that a buddy's late request was writing may come
        back once: twice. Only a folder ``open`` took as this run's own."""
        if not self.opened:
            return
        for _ in range(2):
            if os.path.islink(self.path):
                return
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.exists(self.path):
                return
            time.sleep(0.2)

    def sweep_stale(self) -> List[str]:
        """Remove this user's snapshot folders of this run folder other than this one (an earlier run in the
        same folder that crashed, or that the run folder was deleted under; a version that kept them open to
        others); other runs' folders, links and other users' folders stay. Returns what went."""
        gone = []
        try:
            entries = os.listdir(self.root)
        except OSError:
            return gone
        for d in entries:
            full = os.path.join(self.root, d)
            try:
                if not d.startswith(PREFIX) or full == self.path or foreign(full, private=False):
                    continue
                with open(os.path.join(full, "owner.json")) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(owner, dict) and owner.get("run_dir") == self.run_dir:
                shutil.rmtree(full, ignore_errors=True)
                gone.append(full)
        return gone
