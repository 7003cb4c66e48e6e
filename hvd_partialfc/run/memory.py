"""Memory snapshots (``checkpoint.memory_every: K``): a lost node costs at most 2 K steps (K since the last
snapshot, up to K more while it lands: ``settle``), not the steps since the last disk checkpoint.
memory_recover.py restores them; docs/reliability.md "Memory snapshots" is the user's page.

What is unique to a rank is its classifier slice (rows, their optimizer state), its counters, its random
streams and its own BatchNorm statistics: its checkpoint file (checkpoint.TrainingState.rank_file). The
backbone is on every rank. Every K steps each rank keeps that file twice:

* in its own node's shared memory (memory_store.NodeStore: ``/dev/shm``), which outlives the worker processes
  that a launcher restarts;
* on its *buddy*, a rank of the next node (the rank of the same place on it): sent over TCP by a thread of
  its own (memory_link.py), so the step does not wait for it. One node alone has no buddies.

The first rank of each node also writes the backbone (its BatchNorm statistics averaged, as a checkpoint's
backbone.pt: the run goes on with its own) and meta.json. The copy to host memory is taken at the step (the
state moves on); writing, serialising and sending run beside the next steps.

Two-phase commit: a rank votes its copies landed (its own file written, its buddy's answer received) in the
loop's per-step vote (trainer.py); once every rank has, each node's folder takes its final name. Until then
the snapshot is ``.partial`` everywhere and never used; the previous committed one stays until the new one
commits. A snapshot that has not landed when the next is due is settled then, blocking: committed if it
landed everywhere, else dropped (said once).

The snapshots are removed when the run ends (its last step, or a stop on a signal, whose disk checkpoint is as
new); any other end (an error, Ctrl-C) keeps them for the restart, or for a ``--resume auto`` once its cause
is fixed (cli.py). A run's token (``RUN/run_id``, 0600) and its run folder name the node's folder; another
folder of the same run folder is stale, ignored and removed. Each start is a *segment* (8 hex digits drawn
by rank 0): its snapshots carry it, and ``RUN/memory_segments`` lists the segments a restart may restore
from: this start's, and the one whose snapshot it restored. A node that rejoins with an older start's
snapshots is never restored from. The link between ranks is keyed by a secret drawn at each start and
passed through the collectives only (memory_link.py).
"""
from __future__ import annotations

import json
import os
import secrets
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from . import faults
from .. import atomic
from ..run_files import classifier_file
from ..sizes import human
from .memory_link import Link, new_secret
from .memory_plan import Plan, put_limit, snapshot_bytes
from .memory_store import NodeStore, StoreError, memory_root, node_key, room_error

RUN_ID = "run_id"
SEGMENTS = "memory_segments"
LATE_S = 1.0            # a snapshot still landing when the next is due, the step waiting longer than this: said
_LIVE: List["MemorySnapshots"] = []


def run_token(run_dir: str, keep: bool) -> str:
    """The run's identity (``RUN/run_id``, readable by its owner only: it names the node's snapshot folder):
    kept while the run resumes (``checkpoint.resume: auto``), new for any other start (a new run in the
    folder: the old one's snapshots are not its own)."""
    path = os.path.join(run_dir, RUN_ID)
    if keep and os.path.isfile(path):
        token = open(path).read().strip()
        if token:
            try:
                os.chmod(path, 0o600)       # a run folder of an earlier version left it 0644
            except OSError:                 # another user's file (a run folder a group shares): left as it is
                pass
            return token
    os.makedirs(run_dir, exist_ok=True)
    token = secrets.token_hex(16)
    atomic.write_text(path, token + "\n", mode=0o600)
    return token


def read_segments(run_dir: str) -> List[str]:
    """The segments whose snapshots a restart may restore (``RUN/memory_segments``); none when missing."""
    try:
        with open(os.path.join(run_dir, SEGMENTS)) as f:
            return [s for s in json.load(f)["segments"] if isinstance(s, str)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory (a copy even of a CPU tensor: the step changes it)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


# meta.json's backbone digests of a snapshot: one value for every rank (checkpoint.load checks they agree). Not a
# sha256 of the state: hashing iresnet50's 170 MB on every snapshot cost CPU time the step needs (8% of a 67 ms
# step at K=10 on 2 shared cores, with serialising), and a resume checks every rank's backbone anyway
# (start-up's identity check after the broadcast).
SNAPSHOT_DIGEST = "memory-snapshot"


def _lower_priority() -> None:
    """The landing thread yields the CPU to the step's threads (Linux: a thread has its own nice value): on a
    node whose cores train (CPU ranks, data workers) a snapshot then takes longer to land, not the step."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class MemorySnapshots:
    """This rank's side of the snapshots (see the module's docstring). ``start`` is a collective."""

    def __init__(self, every: int, comm, store: NodeStore, link: Link, plan: Plan, peers: List[tuple],
                 segments: List[str]):
        self.every, self.comm, self.store, self.link, self.plan = every, comm, store, link, plan
        self.peers = peers                          # every rank's (node key, address, port, sizes)
        self.segments = segments                    # the segments a recovery may restore from (RUN/memory_segments)
        self.is_writer = plan.writer(comm.rank) == comm.rank
        self.buddy = plan.buddy(comm.rank)
        self.pending: Optional[int] = None          # the step of the snapshot landing now
        self.committed: Optional[tuple] = None     # the newest committed snapshot: (segment, step)
        self.restored: Optional[tuple] = None       # the snapshot (segment, step) this start resumed from
        self.start_step, self.taken = 0, None       # where this start began; the step of its last snapshot
        self._thread: Optional[threading.Thread] = None
        self._landed = threading.Event()
        self._error: Optional[str] = None
        self._heard: Dict[int, set] = {}           # rank 0: which ranks told it their copies of a step landed
        self._heard_lock = threading.Lock()
        link.on_note = self._on_note
        link.authorize = self._authorize
        _LIVE.append(self)

    @classmethod
    def start(cls, cfg, comm, parts, log=print) -> Optional["MemorySnapshots"]:
        """Every rank: the run's token, this start's secret and segment (rank 0 draws them), the server, the
        plan; each node's first rank opens the node's folder (refused unless it is this run's own; stale
        folders of the run folder removed) and checks its room against the snapshots' size (one line when
        short)."""
        every = cfg.checkpoint.memory_every
        if every <= 0:
            return None
        error, drawn = None, None
        if comm.is_main:
            try:
                auto = cfg.checkpoint.resume == "auto"
                drawn = (run_token(cfg.out, keep=auto), new_secret(), secrets.token_hex(4),
                         read_segments(cfg.out) if auto else [])
            except OSError as e:
                error = f"checkpoint.memory_every: cannot write {os.path.join(cfg.out, RUN_ID)}: {e.strerror}"
        error, drawn = comm.allgather_object((error, drawn), name="memory.token")[0]   # the secret: collectives only
        comm.agree(error, name="memory.token")
        token, secret, segment, segments = drawn
        root = memory_root(cfg.checkpoint.memory_dir)
        store, link = NodeStore(root, token, cfg.out, segment), None
        try:
            link = Link(store, secret, comm.rank)
        except OSError as e:
            error = f"checkpoint.memory_every: cannot listen for snapshot copies: {e}"
        sizes, key = snapshot_bytes(parts, cfg.optim), node_key(root)
        sizes["limit"] = put_limit(parts, sizes)
        peers = comm.allgather_object((key, *(link.address if link else ("", 0)), sizes), name="memory.peers")
        plan = Plan([p[0] for p in peers])
        node, writer = plan.node_of[comm.rank], plan.writer(comm.rank) == comm.rank
        if error is None and writer:
            try:
                store.open()
                for path in store.sweep_stale():
                    print(f"[rank {comm.rank}] memory snapshots: removed {path}: another snapshot folder of this "
                          "run folder (an earlier run's, or an earlier version's)", flush=True)
                need = 2 * (sum(peers[r][3]["rank"] for r in plan.hosted(node)) + sizes["backbone"])
                error = room_error(root, need, len(plan.nodes[node])) or store.mark_node(key)
            except (StoreError, OSError) as e:
                error = str(e) if isinstance(e, StoreError) else \
                    f"checkpoint.memory_every: the snapshot folder {root} cannot be used: {e}"
        snaps = cls(every, comm, store, link, plan, peers, segments) if link else None  # closed on every exit (cli.py)
        comm.agree(error, name="memory.start")
        shared = store.other_nodes(key, set(plan.keys)) if writer else None
        comm.agree(shared and f"checkpoint.memory_every: {root} is one folder for several nodes ({shared}): each node "
                   "needs its own memory (a tmpfs such as /dev/shm), or a lost node's snapshots would look alive",
                   name="memory.shared")
        if comm.is_main:
            per = human(sum(p[3]["rank"] for p in peers) / len(peers))
            log(f"memory snapshots every {every} steps in {root} on {len(plan.nodes)} node(s): {per} a rank, "
                + ("a copy on a rank of the next node" if len(plan.nodes) > 1
                   else "one node: no buddy copies (a lost node falls back to disk)"))
        return snaps

    def begin(self, start_step: int) -> None:
        """After the resume (start-up): where this start begins; rank 0 records the segments a restart may
        restore from: this one's, and the one whose snapshot it resumed from (an older start's are stale)."""
        self.start_step, error = start_step, None
        if self.comm.is_main:
            keep = ([self.restored[0]] if self.restored else []) + [self.store.segment]
            path = os.path.join(self.store.run_dir, SEGMENTS)
            try:
                atomic.write_text(path, json.dumps({"segments": keep}) + "\n")
            except OSError as e:
                error = f"checkpoint.memory_every: cannot write {path}: {e.strerror}"
        self.comm.agree(error, name="memory.segments")

    def _authorize(self, h: dict) -> Optional[str]:
        """Why an authenticated request (memory_link.py) is refused, else None: a put only from the rank whose
        buddy this one is, for this segment, a step that can be due (after this rank's last snapshot, at most K
        steps on: the sender cannot be further ahead), its own file name and size; a landing only to rank 0; a
        commit only from rank 0."""
        r, size = h["rank"], self.comm.size
        if r >= size:
            return f"rank {r} is not one of the {size} ranks"
        if h["op"] == "put":
            base = self.taken if self.taken is not None else self.start_step
            if self.plan.buddy(r) != self.comm.rank:
                return f"rank {r}'s copies go to rank {self.plan.buddy(r)}, not to rank {self.comm.rank}"
            if h["segment"] != self.store.segment or h["name"] != classifier_file(r, size):
                return f"rank {r} sends {classifier_file(r, size)} of segment {self.store.segment} only"
            if not max(base, self.start_step + 1) <= h["step"] <= base + self.every:   # an eviction's is unscheduled
                return f"step {h['step']} is no snapshot due here (the last: {base}; every {self.every} steps)"
            if h["size"] > self.peers[r][3]["limit"]:
                return f"{h['size']} bytes is more than rank {r}'s slice can take ({self.peers[r][3]['limit']})"
        elif h["op"] == "note" and h["what"] == "commit" and r != 0:
            return "only rank 0 commits a snapshot"
        elif h["op"] == "note" and h["what"] == "landed" and self.comm.rank != 0:
            return "landings are told to rank 0"
        return None

    # --- the loop's side ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def snapshot(self, step: int, state, averaged: bool, meta_of) -> None:
        """Take the snapshot of ``step`` (a collective: the BatchNorm statistics for the backbone file are
        averaged unless ``averaged`` already); ``meta_of(digests)``: its meta.json. The copies land in a thread."""
        self.settle()
        backbone = state.backbone
        own = {k: b.detach().clone() for k, b in backbone.named_buffers()}
        if not averaged:
            self.comm.average_buffers(backbone, name=f"memory.{step}")
        try:
            bb = cpu_copy(state.backbone_file()) if self.is_writer else None
        finally:
            if not averaged:
                with torch.no_grad():
                    for k, b in backbone.named_buffers():
                        b.copy_(own[k])
        mine = cpu_copy(state.rank_file("", own))
        meta = meta_of([SNAPSHOT_DIGEST] * self.comm.size) if self.is_writer else None
        self._landed.clear()
        self._error, self.pending, self.taken = None, step, step
        self._thread = threading.Thread(target=self._land, args=(step, mine, bb, meta), daemon=True,
                                        name="memory-snapshot")
        self._thread.start()

    def _land(self, step: int, mine, bb, meta) -> None:
        _lower_priority()
        try:
            name = classifier_file(self.comm.rank, self.comm.size)
            path = self.store.write(step, name, lambda f: torch.save(mine, f))
            if faults.active("kill-in-memory", step, self.comm.rank):   # the rank's own copy only
                faults.kill_self(f"kill-in-memory at step {step}", self.comm.rank)
            if bb is not None:
                self.store.write(step, "backbone.pt", lambda f: torch.save(bb, f))
                self.store.write(step, "meta.json", json.dumps(meta, indent=1).encode())
            if self.buddy is not None:
                p = self.peers[self.buddy]
                self.link.put((p[1], p[2]), step, name, path)
        except Exception as e:  # noqa: BLE001 (voted: the snapshot is dropped, the run goes on)
            self._error = f"rank {self.comm.rank}: {type(e).__name__}: {e}"
        self._landed.set()
        if self._error is None:
            self._tell(0, what="landed", step=step, rank=self.comm.rank)

    def _tell(self, to: int, **what) -> None:
        """A note to rank ``to`` (this rank's own handler when it is this one); best effort: the loop's vote
        commits the snapshot anyway, a few steps later."""
        try:
            if to == self.comm.rank:
                self._on_note(what)
            else:
                self.link.note((self.peers[to][1], self.peers[to][2]), **what)
        except Exception:  # noqa: BLE001
            pass

    def _on_note(self, h: dict) -> None:
        """Rank 0 hears every rank's landing; once all have, it tells each node's first rank to commit, which
        renames its folder at once: a failure a step after a snapshot finds it committed (the loop's vote
        would commit it two steps later, the vote being read a step after it starts)."""
        step = int(h["step"])
        if h["what"] == "commit":
            if self.is_writer:
                self.store.commit(step)
        elif h["what"] == "landed" and self.comm.rank == 0:
            with self._heard_lock:
                heard = self._heard.setdefault(step, set())
                heard.add(int(h["rank"]))
                complete = len(heard) == self.comm.size
                if complete:
                    self._heard = {s: r for s, r in self._heard.items() if s > step}
            if complete:
                for node in self.plan.nodes:
                    self._tell(node[0], what="commit", step=step)

    @property
    def committed_step(self) -> Optional[int]:
        """The step of the newest committed snapshot (this start's, or the one it resumed from), or None."""
        return self.committed[1] if self.committed else None

    def vote_flag(self) -> float:
        """This rank's part of the loop's vote: 1 while the pending snapshot has not landed here (or failed)."""
        if self.pending is None:
            return 0.0
        return 0.0 if self._landed.is_set() and self._error is None else 1.0

    def all_landed(self) -> None:
        """The loop's vote said no rank waits on the pending snapshot (the same answer on every rank): commit it."""
        if self.pending is not None:
            self._commit(self.pending)

    def settle(self) -> None:
        """Before the next snapshot (a collective when one is pending): wait for it to land, then commit it
        where every rank's copies landed, else drop it and say why."""
        if self.pending is None:
            return
        step, t0 = self.pending, time.monotonic()
        self._landed.wait()
        failed = self.comm.failures(self._error, name=f"memory.settle.{step}")
        waited = time.monotonic() - t0
        if waited > LATE_S and self.comm.is_main:
            print(f"memory snapshot of step {step} had not landed when the next one was due: the step waited "
                  f"{waited:.1f} s for it", flush=True)
        if not failed:
            self._commit(step)
            return
        self.pending = None
        if self.is_writer:
            self.store.keep_only(self.committed)
        if self.comm.is_main:
            print(f"memory snapshot of step {step} dropped (the previous one, of step {self.committed_step}, "
                  "stays): " + "; ".join(e for _, e in failed), flush=True)

    def _commit(self, step: int) -> None:
        if self.is_writer:
            self.store.commit(step)
        self.pending, self.committed = None, (self.store.segment, step)

    def close(self, keep: bool) -> None:
        """Stop serving; unless ``keep`` (any end but a finished run or a stop on a signal: a restart takes the
        snapshots), remove this node's folder; a folder that holds no snapshot goes either way (a start refused
        before the first one). Only a folder this start opened as its own: never one it refused."""
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.link.close()
        if self.is_writer and (not keep or not self.store.listing()):   # remove(): only a folder open() took
            self.store.remove()
        if self in _LIVE:
            _LIVE.remove(self)


def close_snapshots(keep: bool) -> None:
    """Every live ``MemorySnapshots`` of this process closed (cli.py, on every exit path of ``train``)."""
    for snaps in list(_LIVE):
        snaps.close(keep)
