"""Memory snapshots (``checkpoint.memory_every: K``): a lost node costs at most 2 K steps (K since the last
snapshot, up to K more while it lands: ``settle``), not the steps since the last disk checkpoint.
node_memory.py opens the node's side at start-up and offers the newest snapshot to resume from (memory_recover.py
chooses it); docs/reliability.md "Memory snapshots" is the user's page.

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
loop's per-step vote (engine/vote.py: the slot ``snapshot_pending``); once no rank waits on it, each node's folder
takes its final name. Until then
the snapshot is ``.partial`` everywhere and never used; the previous committed one stays until the new one
commits. A snapshot that has not landed when the next is due is settled then, blocking: committed if it
landed everywhere, else dropped (said once).

The snapshots are removed when the run ends (its last step, or a stop on a signal, whose disk checkpoint is as
new); any other end (an error, Ctrl-C) keeps them for the restart, or for a ``--resume auto`` once its cause
is fixed (cli.py). A run's token (``RUN/run_id``, 0600) and its run folder name the node's folder; another
folder of the same run folder is stale, ignored and removed. Each start is a *segment* (8 hex digits drawn
by rank 0): its snapshots carry it, and ``RUN/memory_segments`` says what a restart may restore from: any
snapshot of this start's segment, and the one snapshot it restored (written when the snapshots take the node
over, ``take_over``, once the run knows where it starts). A node that rejoins with an older start's snapshots
is never restored from, nor with the restored start's other snapshots. The link between ranks is keyed by a
secret drawn at each start and passed through the collectives only (memory_link.py).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, Optional

import torch

from ..watch import faults
from ...run_files import classifier_file
from ...engine.vote import Slot
from .memory_recover import VIEW
from .node_memory import LIVE, SEGMENTS, NodeMemory, write_segments

LATE_S = 1.0            # a snapshot still landing when the next is due, the step waiting longer than this: said


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
    """This rank's side of the snapshots once the run knows where it starts (see the module's docstring): a part of
    the loop (its vote's slot, ``due`` every K steps) over the ``NodeMemory`` it took over."""

    slots = (Slot("snapshot_pending"),)

    def __init__(self, node: NodeMemory, start_step: int):
        self.node, self.start_step = node, start_step
        self.every, self.comm, self.store, self.link, self.plan = node.every, node.comm, node.store, node.link, node.plan
        self.peers = node.peers
        self.is_writer, self.buddy = node.is_writer, node.plan.buddy(node.comm.rank)
        self.pending: Optional[int] = None          # the step of the snapshot landing now
        self.committed: Optional[tuple] = node.restored   # the newest committed snapshot: (segment, step)
        self.taken: Optional[int] = None            # the step of this start's last snapshot
        self._thread: Optional[threading.Thread] = None
        self._landed = threading.Event()
        self._error: Optional[str] = None
        self._heard: Dict[int, set] = {}           # rank 0: which ranks told it their copies of a step landed
        self._heard_lock = threading.Lock()
        self.link.on_note = self._on_note
        self.link.authorize = self._authorize
        LIVE[:] = [self if x is node else x for x in LIVE]   # closed from now on through this object

    @classmethod
    def take_over(cls, node: NodeMemory, start_step: int) -> "MemorySnapshots":
        """Once the run knows where it starts (a collective): each rank's folder of an offer goes, each node keeps
        the snapshot this start restored (committed here too: it was committed on some node, so it landed
        everywhere; a newer one, landing when the run failed, is stale) and nothing else of the run, and rank 0
        records what a restart may restore from: the restored snapshot, and this start's segment."""
        node.store.remove_folder(VIEW.format(node.comm.rank))
        node.comm.agree(None, name="memory.resumed")        # every rank read its folder before a node is tidied
        if node.is_writer:
            node.store.keep_only(node.restored)
        error = None
        if node.comm.is_main:
            try:
                write_segments(node.store.run_dir, node.store.segment, node.restored)
            except OSError as e:
                error = f"checkpoint.memory_every: cannot write {os.path.join(node.store.run_dir, SEGMENTS)}: " \
                        f"{e.strerror}"
        node.comm.agree(error, name="memory.segments")
        return cls(node, start_step)

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
            if h["size"] > self.peers[r].sizes["limit"]:
                return f"{h['size']} bytes is more than rank {r}'s slice can take ({self.peers[r].sizes['limit']})"
        elif h["op"] == "note" and h["what"] == "commit" and r != 0:
            return "only rank 0 commits a snapshot"
        elif h["op"] == "note" and h["what"] == "landed" and self.comm.rank != 0:
            return "landings are told to rank 0"
        return None

    # --- the loop's side ---------------------------------------------------------------------------------

    def due(self, step: int, final: bool = False) -> bool:
        """A snapshot every K steps (none at the last step: the run's end removes them)."""
        return not final and step % self.every == 0

    def cast(self, ballot, done: int) -> None:
        """1 while the pending snapshot has not landed here (or failed)."""
        landed = self.pending is None or (self._landed.is_set() and self._error is None)
        ballot.put("snapshot_pending", not landed)

    def heard(self, agreed, done: int) -> None:
        """No rank waits on the pending snapshot (the same answer on every rank): commit it."""
        if not agreed.flag("snapshot_pending") and self.pending is not None:
            self._commit(self.pending)

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
                self.link.put((p.address, p.port), step, name, path)
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
                self.link.note((self.peers[to].address, self.peers[to].port), **what)
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
        """The landing thread ended, then the node's side closed (node_memory.py: unless ``keep``, the folder goes)."""
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.node.close(keep)
        if self in LIVE:
            LIVE.remove(self)


def close_snapshots(keep: bool) -> None:
    """Every live snapshot side of this process closed (cli_train.py, on every exit path of ``train``): a node
    memory opened at start-up, or the snapshots that took it over."""
    for snaps in list(LIVE):
        snaps.close(keep)
