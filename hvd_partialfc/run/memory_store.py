"""One node's memory snapshots: a folder in the node's shared memory, keyed by the run's identity.

Layout (``ROOT`` is ``checkpoint.memory_dir``, default ``/dev/shm``; ``$HVD_PARTIALFC_MEMORY_DIR`` overrides it)::

    ROOT/hvd_partialfc-<token>/owner.json           the run folder and its token: whose snapshots these are
    ROOT/hvd_partialfc-<token>/step-00000120/       a committed snapshot (every copy of every slice landed)
        classifier-00002-of-00004.pt              a rank of this node, or a rank whose buddy is on this node
        backbone.pt, meta.json                      written by the node's first rank (every rank holds the backbone)
    ROOT/hvd_partialfc-<token>/step-00000140.partial/   a snapshot still landing: never used alone

The files are a checkpoint's own (run/checkpoint.py), so a snapshot restores through ``checkpoint.load`` and
re-shards through the same row-cutting. ``token`` is the run's identity (``RUN/run_id``): a folder of
another token belongs to another run, however its name or steps look. Not a collective; no Horovod.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

from .. import atomic
from ..run_files import parse_step, step_dir_name
from ..sizes import human

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


class NodeStore:
    """The snapshot folder of one run on this node (see the module's docstring)."""

    def __init__(self, root: str, token: str, run_dir: str):
        self.root, self.token = root, token
        self.run_dir = os.path.realpath(run_dir)
        self.path = os.path.join(root, PREFIX + token)
        self._lock = threading.Lock()

    def open(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        owner = os.path.join(self.path, "owner.json")
        if not os.path.exists(owner):
            atomic.write_text(owner, json.dumps({"run_dir": self.run_dir, "token": self.token}))

    def step_path(self, step: int, committed: bool) -> str:
        return os.path.join(self.path, step_dir_name(step) + ("" if committed else PARTIAL))

    def write(self, step: int, name: str, fill) -> str:
        """File ``name`` of the snapshot of ``step`` (still landing), whole or not at all: ``fill(f)`` writes
        it into an open binary file (bytes: written as they are)."""
        folder = self.step_path(step, committed=False)
        try:        # not makedirs: a store removed at the run's end is not made again by a late copy
            os.mkdir(folder)
        except FileExistsError:
            pass
        path = os.path.join(folder, name)
        with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:     # its temporary holds ".tmp-": unlisted
            f.write(fill) if isinstance(fill, bytes) else fill(f)
        return path

    def find(self, step: int, name: str) -> Optional[str]:
        """The file ``name`` of the snapshot of ``step`` on this node, committed or landing, else None."""
        for committed in (True, False):
            path = os.path.join(self.step_path(step, committed), name)
            if os.path.isfile(path):
                return path
        return None

    def listing(self) -> Dict[int, Tuple[bool, List[str]]]:
        """Every snapshot on this node: step -> (committed, the files in it)."""
        out: Dict[int, Tuple[bool, List[str]]] = {}
        try:
            entries = os.listdir(self.path)
        except OSError:
            return out
        for d in entries:
            committed = not d.endswith(PARTIAL)
            step = parse_step(d if committed else d[:-len(PARTIAL)])
            if step is None:
                continue
            files = sorted(f for f in os.listdir(os.path.join(self.path, d)) if ".tmp-" not in f)
            if committed or step not in out:
                out[step] = (committed or out.get(step, (False,))[0], files)
        return out

    def commit(self, step: int) -> None:
        """The snapshot of ``step`` is complete everywhere: its folder takes its final name, and the older
        snapshots of this node go (a newer one may be landing already). Idempotent, and safe from two threads
        (the loop's vote and rank 0's message may both commit it)."""
        with self._lock:
            partial, final = self.step_path(step, False), self.step_path(step, True)
            if os.path.isdir(partial):
                if os.path.isdir(final):
                    shutil.rmtree(final)
                os.rename(partial, final)
            for d in os.listdir(self.path) if os.path.isdir(self.path) else ():
                s = parse_step(d[:-len(PARTIAL)] if d.endswith(PARTIAL) else d)
                if s is not None and s < step:
                    shutil.rmtree(os.path.join(self.path, d), ignore_errors=True)

    def keep_only(self, step: Optional[int]) -> None:
        """Remove every snapshot folder but the committed one of ``step`` (None: all of them)."""
        keep = step_dir_name(step) if step is not None else None
        for d in os.listdir(self.path) if os.path.isdir(self.path) else ():
            full = os.path.join(self.path, d)
            if d != keep and os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)

    def mark_node(self, key: str) -> None:
        """Leave this node's mark in the folder (``other_nodes`` finds a folder that several nodes share)."""
        atomic.write_text(os.path.join(self.path, _mark(key)), key + "\n")

    def other_nodes(self, key: str, keys) -> Optional[str]:
        """The other nodes of this job that marked this folder (a shared file system given as every node's
        memory), in words, else None. Marks of nodes outside the job are another job's, and ignored."""
        others = [k for k in sorted(keys) if k != key and os.path.exists(os.path.join(self.path, _mark(k)))]
        return ", ".join(k.split("|")[0] for k in [key] + others) if others else None

    def remove(self) -> None:
        """Remove the folder; a copy that a buddy's late request was writing may come back once: twice."""
        for _ in range(2):
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.exists(self.path):
                return
            time.sleep(0.2)

    def sweep_stale(self) -> List[str]:
        """Remove this run folder's snapshot folders of other tokens (an earlier run in the same folder that
        crashed, or that the run folder was deleted under); other runs' folders stay. Returns what went."""
        gone = []
        try:
            entries = os.listdir(self.root)
        except OSError:
            return gone
        for d in entries:
            full = os.path.join(self.root, d)
            if not d.startswith(PREFIX) or full == self.path:
                continue
            try:
                with open(os.path.join(full, "owner.json")) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue
            if owner.get("run_dir") == self.run_dir and owner.get("token") != self.token:
                shutil.rmtree(full, ignore_errors=True)
                gone.append(full)
        return gone

