"""A rank's node memory at start-up (``NodeMemory``): what the snapshots of the run hold on every node, and the newest
state they can give for this start's layout (``newest``), before anything is trained. memory.py's
``MemorySnapshots`` takes it over once the run knows where it starts.

``open`` (a collective) draws what a start needs (rank 0: the run's token, this start's secret and segment, the
segments a restore may take; the secret travels through the collectives only), starts this rank's link server
(memory_link.py), tells every rank where every other serves (``Peer``), and has each node's first rank open the
node's folder (refused unless it is this run's own; stale folders of the run folder removed) and check its room.

``newest`` (a collective, memory_recover.py's choice) offers a memory snapshot when one is newer than the disk
checkpoint and every slice of it survived on some node: a folder of this rank's (``Offer.path``) that
``checkpoint.load`` restores like a disk checkpoint. Resume chooses between the offer and the disk and calls
nothing back: what the offer leaves on the nodes is tidied when the snapshots take the node over.
"""
from __future__ import annotations

import json
import os
import secrets
from typing import Dict, List, NamedTuple, Optional, Tuple

from ... import atomic
from ...run_files import read_meta
from ...sizes import human
from .memory_link import Link, new_secret
from .memory_plan import Plan, put_limit, snapshot_bytes
from .memory_recover import VIEW, Holding, choose, gather, node_listing
from .memory_store import NodeStore, StoreError
from .snapshot_root import memory_root, node_key, room_error

RUN_ID = "run_id"
SEGMENTS = "memory_segments"
LIVE: List = []           # what close_snapshots (memory.py) closes: a NodeMemory, or the snapshots that took it over


class Peer(NamedTuple):
    """A rank as every other knows it: its node's key, where its link serves, its snapshot sizes (memory_plan.py)."""

    node: str
    address: str
    port: int
    sizes: Dict[str, int]


class Offer(NamedTuple):
    """A memory snapshot offered for this start: this rank's folder of it, and the snapshot (segment, step)."""

    path: str
    snap: Tuple[str, int]

    @property
    def step(self) -> int:
        return self.snap[1]


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


def write_segments(run_dir: str, segment: str, restored: Optional[Tuple[str, int]]) -> None:
    """``RUN/memory_segments``: what a restart may restore from: any snapshot of this start's ``segment`` and, of
    the start it resumed from, only the snapshot ``restored`` (that start's others, on a node that rejoins, are an
    abandoned start's state)."""
    record = {"segments": [segment], **({"restored": list(restored)} if restored else {})}
    atomic.write_text(os.path.join(run_dir, SEGMENTS), json.dumps(record) + "\n")


def read_segments(run_dir: str) -> List:
    """What a restart may restore from (``RUN/memory_segments``): a segment (str), any of its snapshots; a
    (segment, step), that snapshot only. None when missing; a file of an earlier version lists segments only."""
    try:
        with open(os.path.join(run_dir, SEGMENTS)) as f:
            record = json.load(f)
        out: List = [s for s in record["segments"] if isinstance(s, str)]
        seg, step = record.get("restored") or (None, None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return out + ([(seg, step)] if isinstance(seg, str) and isinstance(step, int) else [])


class NodeMemory:
    """This rank's node memory before the run starts (see the module's docstring)."""

    def __init__(self, every: int, comm, store: NodeStore, link: Link, plan: Plan, peers: List[Peer],
                 segments: List[str]):
        self.every, self.comm, self.store, self.link, self.plan = every, comm, store, link, plan
        self.peers = peers                          # every rank's Peer
        self.segments = segments                    # what a restore may take (RUN/memory_segments)
        self.is_writer = plan.writer(comm.rank) == comm.rank
        self.restored: Optional[Tuple[str, int]] = None   # the snapshot this start resumes from (``newest``)
        link.authorize = self._authorize
        LIVE.append(self)

    @classmethod
    def open(cls, cfg, comm, parts, log=print) -> Optional["NodeMemory"]:
        """Every rank (a collective); None when ``checkpoint.memory_every`` is 0. Closed on every way out
        (memory.close_snapshots), also when an agreed error raises here."""
        every = cfg.checkpoint.memory_every
        if every <= 0:
            return None
        token, secret, segment, segments = _drawn(cfg, comm)
        root = memory_root(cfg.checkpoint.memory_dir)
        store, link, error = NodeStore(root, token, cfg.out, segment), None, None
        try:
            link = Link(store, secret, comm.rank)
        except OSError as e:
            error = f"checkpoint.memory_every: cannot listen for snapshot copies: {e}"
        sizes, key = snapshot_bytes(parts, cfg.optim), node_key(root)
        sizes["limit"] = put_limit(parts, sizes)
        peers = [Peer(*p) for p in comm.allgather_object((key, *(link.address if link else ("", 0)), sizes),
                                                         name="memory.peers")]
        plan = Plan([p.node for p in peers])
        node = cls(every, comm, store, link, plan, peers, segments) if link else None
        if error is None and node.is_writer:
            error = node._open_folder(root, key)
        comm.agree(error, name="memory.start")
        shared = store.other_nodes(key, set(plan.keys)) if plan.writer(comm.rank) == comm.rank else None
        comm.agree(shared and f"checkpoint.memory_every: {root} is one folder for several nodes ({shared}): each node "
                   "needs its own memory (a tmpfs such as /dev/shm), or a lost node's snapshots would look alive",
                   name="memory.shared")
        if comm.is_main:
            per = human(sum(p.sizes["rank"] for p in peers) / len(peers))
            log(f"memory snapshots every {every} steps in {root} on {len(plan.nodes)} node(s): {per} a rank, "
                + ("a copy on a rank of the next node" if len(plan.nodes) > 1
                   else "one node: no buddy copies (a lost node falls back to disk)"))
        return node

    def _open_folder(self, root: str, key: str) -> Optional[str]:
        """The node's first rank: stale folders of the run folder removed, the room checked, then its folder
        opened (nothing is made in a root without room: a tmpfs filled by owner.json would refuse the next
        start); why not, else None."""
        try:
            for path in self.store.sweep_stale():
                print(f"[rank {self.comm.rank}] memory snapshots: removed {path}: another snapshot folder of this "
                      "run folder (an earlier run's, or an earlier version's), or an empty one a failed start left",
                      flush=True)
            node = self.plan.node_of[self.comm.rank]
            need = 2 * (sum(self.peers[r].sizes["rank"] for r in self.plan.hosted(node))
                        + self.peers[self.comm.rank].sizes["backbone"])
            return room_error(root, need, len(self.plan.nodes[node])) or self.store.open() or self.store.mark_node(key)
        except (StoreError, OSError) as e:
            return str(e) if isinstance(e, StoreError) else \
                f"checkpoint.memory_every: the snapshot folder {root} cannot be used: {e}"

    def _authorize(self, h: dict) -> Optional[str]:
        """Before the run starts, a rank serves the files of its node's snapshots (``get``) only."""
        if h["op"] != "get":
            return "no snapshot is taken before the run starts"
        return None

    # --- the newest state for this layout ----------------------------------------------------------------

    def newest(self, disk_path: Optional[str], slices: List[Tuple[int, int]], replicated: bool,
               log=print) -> Optional[Offer]:
        """The memory snapshot to resume from, newer than the disk checkpoint ``disk_path`` and whole, gathered
        into this rank's folder for the new ``slices``; None when memory cannot offer one (said once when a newer
        one could not be restored). A collective."""
        comm, store = self.comm, self.store
        disk_step = read_meta(disk_path)["step"] if disk_path else -1
        everyone = [Holding(*h) for h in comm.allgather_object(
            (self.peers[comm.rank].node, *self.link.address, node_listing(store)), name="memory.recover")]
        snap, missed = choose(everyone, disk_step, self.segments)
        fallback = f"the disk checkpoint {disk_path} (step {disk_step})" if disk_path else "step 0 (no disk checkpoint)"
        if missed and comm.is_main:
            log(f"{missed}; resuming from " + (f"the older memory snapshot of step {snap[1]}" if snap is not None
                                               else fallback))
        if snap is None:
            return None
        view = os.path.join(store.path, VIEW.format(comm.rank))
        error, fetched = None, []
        try:
            gather(self, everyone, snap, view, slices, replicated, fetched)
        except Exception as e:  # noqa: BLE001 (agreed: every rank falls back together)
            error = f"{type(e).__name__}: {e}"
        failed = comm.failures(error, name="memory.view")
        if failed:
            if comm.is_main:
                log(f"memory snapshot of step {snap[1]} could not be gathered ("
                    + "; ".join(f"rank {r}: {e}" for r, e in failed) + "); resuming from "
                    + (f"the disk checkpoint {disk_path}" if disk_path else "step 0"))
            store.remove_folder(VIEW.format(comm.rank))
            return None
        if comm.is_main:
            log(f"memory: resuming from the snapshot of step {snap[1]} in node memory (disk checkpoint: "
                + (f"step {disk_step}" if disk_path else "none") + f"; {len(fetched)} file(s) fetched from other "
                "nodes on rank 0)")
        self.restored = snap
        return Offer(view, snap)

    def close(self, keep: bool) -> None:
        """Stop serving; unless ``keep``, remove this node's folder; a folder that holds no snapshot goes either way
        (a start refused before the first one). Only a folder this start opened as its own: never one it refused."""
        self.link.close()
        if self.is_writer and (not keep or not self.store.listing()):   # remove(): only a folder open() took
            self.store.remove()
        if self in LIVE:
            LIVE.remove(self)


def _drawn(cfg, comm) -> Tuple[str, str, str, List[str]]:
    """Rank 0 draws (the run's token, this start's secret and segment, the segments a restore may take); every
    rank receives them through a collective (the secret never touches a disk); an error is agreed."""
    error, drawn = None, None
    if comm.is_main:
        try:
            auto = cfg.checkpoint.resume == "auto"
            drawn = (run_token(cfg.out, keep=auto), new_secret(), secrets.token_hex(4),
                     read_segments(cfg.out) if auto else [])
        except OSError as e:
            error = f"checkpoint.memory_every: cannot write {os.path.join(cfg.out, RUN_ID)}: {e.strerror}"
    error, drawn = comm.allgather_object((error, drawn), name="memory.token")[0]
    comm.agree(error, name="memory.token")
    return drawn
