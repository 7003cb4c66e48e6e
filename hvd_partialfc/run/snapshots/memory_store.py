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
it (snapshot_root.py: owned by root or this user, and a group- or world-writable root needs the sticky bit, as
/dev/shm and /tmp have it). Every operation goes through descriptors of the root and of the folder, opened once
and never through a link, so a folder renamed away after ``open`` (by root) and a link put in its place redirect
no write and no removal. A start that cannot write owner.json (a full tmpfs) removes what it made; a folder a
killed start left without owner.json is taken by the next start of the run, or swept once stale.

``<segment>`` is the start that took the snapshot (8 hex digits drawn at each start): a node that rejoins
holds an old start's snapshots, which may have the same step as this start's; memory_recover.py never
combines files of two segments. The files are a checkpoint's own (run/ckpt/checkpoint.py), so a snapshot restores
through ``checkpoint.load`` and re-shards through the same row-cutting. Not a collective; no Horovod.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from typing import Dict, List, Optional, Tuple

from ... import atomic
from ...run_files import step_dir_name
from .snapshot_root import ENV_DIR, foreign, not_mine, root_error

PREFIX = "hvd_partialfc-"
PARTIAL = ".partial"


def _mark(key: str) -> str:
    return "node-" + hashlib.sha256(key.encode()).hexdigest()[:16]


Key = Tuple[str, int]                  # a snapshot: (the segment that took it, its step)
SEGMENT = re.compile(r"[0-9a-f]{8}")   # a start's segment, as node_memory.py draws it (secrets.token_hex(4))
_STEP = re.compile(r"^step-(\d{8,})\.([0-9a-f]{8})(\.partial)?$")
OWNER = "owner.json"
STALE_S = 60.0          # a folder without owner.json older than this is no start's between its mkdir and owner.json


class StoreError(RuntimeError):
    """A snapshot folder or root that is not safely this run's: the one line that refuses it."""


def store_name(token: str, run_dir: str) -> str:
    """The folder's name in the root: unpredictable without the token, distinct for two run folders."""
    digest = hashlib.sha256(f"{token}\0{os.path.realpath(run_dir)}".encode()).hexdigest()
    return PREFIX + digest[:32]


def _is_dir_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read_owner(fd: int):
    """The folder ``fd``'s owner.json (never through a link), None when it has none; OSError, ValueError."""
    try:
        ofd = os.open(OWNER, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        return None
    with open(ofd) as f:
        return json.load(f)


def _kept(fd: int) -> List[str]:
    """What the folder ``fd`` holds but temporaries (a write that did not finish)."""
    return [e for e in os.listdir(fd) if ".tmp-" not in e]


class NodeStore:
    """The snapshot folder of one run on this node (see the module's docstring). ``segment``: this start's.
    Every operation goes through descriptors of the root and of the folder, opened once (held for the process's
    life: a link server's thread may still use them), never following a link: renaming the folder and putting a
    link in its place redirects nothing."""

    def __init__(self, root: str, token: str, run_dir: str, segment: str = "00000000"):
        self.root, self.token, self.segment = root, token, segment
        self.run_dir = os.path.realpath(run_dir)
        self.name = store_name(token, run_dir)
        self.path = os.path.join(root, self.name)
        self.opened = False         # open() made it or took it as this run's own (only then may it be removed)
        self._root_fd: Optional[int] = None
        self._fd: Optional[int] = None
        self._lock = threading.Lock()
        self._fd_lock = threading.Lock()

    def _refusal(self, why: str) -> StoreError:
        return StoreError(f"checkpoint.memory_every: {self.path} is there already and is not this run's snapshot "
                          f"folder: {why}. It was neither used nor changed; remove it if it is yours, or point "
                          f"{ENV_DIR} (or checkpoint.memory_dir) at a folder of your own")

    def _root(self) -> int:
        """The root's descriptor, checked (``root_error``); StoreError when it cannot hold snapshots safely."""
        with self._fd_lock:
            if self._root_fd is None:
                try:
                    fd = atomic.open_dir(self.root)
                except OSError as e:
                    raise StoreError(root_error(self.root) or f"checkpoint.memory_every: the snapshot folder "
                                     f"{self.root} cannot be used: {e.strerror}") from None
                error = root_error(self.root, os.fstat(fd))
                if error:
                    os.close(fd)
                    raise StoreError(error)
                self._root_fd = fd
            return self._root_fd

    def _dir(self) -> int:
        """The folder's descriptor: the one ``open`` took, or (a rank of the node other than its first, which uses
        the folder its first rank opened) this user's private folder of that name, never a link; OSError
        (FileNotFoundError: no folder) or StoreError otherwise."""
        root = self._root()
        with self._fd_lock:
            if self._fd is None:
                fd = atomic.open_dir(self.name, root, follow=False)
                why = not_mine(os.fstat(fd))
                if why:
                    os.close(fd)
                    raise self._refusal(why)
                self._fd = fd
            return self._fd

    def open(self) -> None:
        """Make the folder (0700) with its owner.json, or take the one there if it is this run's own (or a start's
        of it that failed before its owner.json: nothing but temporaries in it); StoreError otherwise. A failure
        to write owner.json removes what it made."""
        root = self._root()
        try:
            os.mkdir(self.name, 0o700, dir_fd=root)
            made = True
        except FileExistsError:
            made = False
        try:
            fd = atomic.open_dir(self.name, root, follow=False)
        except OSError:
            raise self._refusal(foreign(self.name, root) or "not a folder") from None
        if made:
            os.fchmod(fd, 0o700)           # whatever the umask
        why = not_mine(os.fstat(fd))
        if why is None and not made:
            try:
                owner = _read_owner(fd)
            except (OSError, ValueError):
                owner = False
            made = owner is None and not _kept(fd)
            if not made and owner != {"run_dir": self.run_dir, "token": self.token}:
                why = "its owner.json does not name this run"
        if why:
            os.close(fd)
            raise self._refusal(why)
        if made:
            try:
                with atomic.atomic_file(OWNER, mode=0o600, text=True, dir_fd=fd) as f:
                    f.write(json.dumps({"run_dir": self.run_dir, "token": self.token}))
            except BaseException:          # a full tmpfs: nothing left that would refuse the next start
                self._remove_open(root, self.name, fd)
                os.close(fd)
                raise
        self._fd, self.opened = fd, True

    @staticmethod
    def _remove_open(dir_fd: int, name: str, fd: int) -> bool:
        """Empty the open folder ``fd`` and remove it as ``name`` of ``dir_fd`` if that still is it; whether it
        went (False: something landed meanwhile, or the name holds another folder now)."""
        atomic.clear_dir(fd)
        try:
            if atomic.same_entry(dir_fd, name, fd):
                os.rmdir(name, dir_fd=dir_fd)
                return True
        except OSError:
            pass
        return not atomic.same_entry(dir_fd, name, fd)

    def _step_name(self, step: int, committed: bool, segment: Optional[str] = None) -> str:
        return f"{step_dir_name(step)}.{segment or self.segment}" + ("" if committed else PARTIAL)

    def step_path(self, step: int, committed: bool, segment: Optional[str] = None) -> str:
        return os.path.join(self.path, self._step_name(step, committed, segment))

    def write(self, step: int, name: str, fill) -> str:
        """File ``name`` of this segment's snapshot of ``step`` (still landing), whole or not at all, 0600:
        ``fill(f)`` writes it into an open binary file (bytes: written as they are)."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is no snapshot file's name")
        folder, fd = self._step_name(step, committed=False), self._dir()
        try:        # a store removed at the run's end is not made again by a late copy (its descriptor: gone)
            os.mkdir(folder, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        sfd = atomic.open_dir(folder, fd, follow=False)
        try:      # ".tmp-" in its temporary's name: unlisted
            with atomic.atomic_file(name, mode=0o600, dir_fd=sfd) as f:
                f.write(fill) if isinstance(fill, bytes) else fill(f)
        finally:
            os.close(sfd)
        return os.path.join(self.path, folder, name)

    def _open_snapshot_file(self, key: Key, name: str) -> Optional[Tuple[str, int]]:
        """(its path, an open read descriptor) of file ``name`` of the snapshot ``key``, committed or landing, a
        plain file reached without following a link; None if there is none (or ``key`` has not a segment's form)."""
        if not (isinstance(key[0], str) and SEGMENT.fullmatch(key[0])) or "/" in name or name.startswith("."):
            return None
        try:
            fd = self._dir()
        except (OSError, StoreError):
            return None
        for committed in (True, False):
            folder = self._step_name(key[1], committed, key[0])
            try:
                sfd = atomic.open_dir(folder, fd, follow=False)
                try:
                    ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=sfd)
                finally:
                    os.close(sfd)
            except OSError:
                continue
            if stat.S_ISREG(os.fstat(ffd).st_mode):
                return os.path.join(self.path, folder, name), ffd
            os.close(ffd)
        return None

    def find(self, key: Key, name: str) -> Optional[str]:
        """The path of file ``name`` of the snapshot ``key`` on this node, committed or landing, else None."""
        found = self._open_snapshot_file(key, name)
        if found is None:
            return None
        os.close(found[1])
        return found[0]

    def open_file(self, key: Key, name: str):
        """File ``name`` of the snapshot ``key``, open for reading (binary), else None."""
        found = self._open_snapshot_file(key, name)
        return None if found is None else open(found[1], "rb")

    def _folders(self) -> List[Tuple[str, Key, bool]]:
        """Every snapshot folder here: (its name, its key, committed)."""
        try:
            entries = os.listdir(self._dir())
        except (OSError, StoreError):
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
                sfd = atomic.open_dir(d, self._dir(), follow=False)
                try:
                    files = sorted(_kept(sfd))
                finally:
                    os.close(sfd)
            except (OSError, StoreError):
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
            fd, partial, final = self._fd, self._step_name(step, False), self._step_name(step, True)
            if _is_dir_at(fd, partial):
                atomic.remove_tree_at(fd, final)
                os.rename(partial, final, src_dir_fd=fd, dst_dir_fd=fd)
            for d, (_, s), _ in self._folders():
                if s < step:
                    atomic.remove_tree_at(fd, d)

    def keep_only(self, key: Optional[Key]) -> None:
        """Remove every folder in the store (snapshots, views) but the snapshot ``key`` (None: all of them);
        that one is committed here if it was landing. Only in a folder ``open`` took as this run's own."""
        if not self.opened:
            return
        fd, keep = self._fd, None
        if key is not None:
            partial, keep = self._step_name(key[1], False, key[0]), self._step_name(key[1], True, key[0])
            if _is_dir_at(fd, partial) and not _is_dir_at(fd, keep):
                os.rename(partial, keep, src_dir_fd=fd, dst_dir_fd=fd)
        for d in os.listdir(fd):
            if d != keep:
                atomic.remove_tree_at(fd, d)       # a folder only: owner.json and the marks stay

    def remove_folder(self, name: str) -> None:
        """Remove the folder ``name`` of the store (a rank's view of a snapshot: memory_recover.py), never through
        a link; nothing when there is no store."""
        try:
            atomic.remove_tree_at(self._dir(), name)
        except (OSError, StoreError):
            pass

    def mark_node(self, key: str) -> None:
        """Leave this node's mark in the folder (``other_nodes`` finds a folder that several nodes share)."""
        with atomic.atomic_file(_mark(key), mode=0o600, text=True, dir_fd=self._dir()) as f:
            f.write(key + "\n")

    def other_nodes(self, key: str, keys) -> Optional[str]:
        """The other nodes of this job that marked this folder (a shared file system given as every node's
        memory), in words, else None. Marks of nodes outside the job are another job's, and ignored."""
        fd = self._dir()
        others = [k for k in sorted(keys) if k != key and _exists_at(fd, _mark(k))]
        return ", ".join(k.split("|")[0] for k in [key] + others) if others else None

    def remove(self) -> None:
        """Remove the folder (what its descriptor holds, whatever its name points to now); a copy that a buddy's
        late request was writing may come back once: twice. Only a folder ``open`` took as this run's own."""
        if not self.opened:
            return
        for _ in range(2):
            if self._remove_open(self._root_fd, self.name, self._fd):
                return
            time.sleep(0.2)

    def sweep_stale(self) -> List[str]:
        """Remove this user's snapshot folders of this run folder other than this one (an earlier run in the
        same folder that crashed, or that the run folder was deleted under; a version that kept them open to
        others), and this user's folders that a start left without owner.json (it failed or was killed before,
        nothing but temporaries in them, older than ``STALE_S``); other runs' folders, links and other users'
        folders stay. Returns what went. StoreError: a root that cannot hold snapshots safely."""
        gone, root = [], self._root()
        for d in os.listdir(root):
            if not d.startswith(PREFIX) or d == self.name:
                continue
            try:
                fd = atomic.open_dir(d, root, follow=False)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not_mine(st, private=False):
                    continue
                try:
                    owner = _read_owner(fd)
                except (OSError, ValueError):
                    continue
                stale = (isinstance(owner, dict) and owner.get("run_dir") == self.run_dir) or (
                    owner is None and not _kept(fd) and time.time() - st.st_mtime > STALE_S)
                if stale and self._remove_open(root, d, fd):
                    gone.append(os.path.join(self.root, d))
            finally:
                os.close(fd)
        return gone


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False
