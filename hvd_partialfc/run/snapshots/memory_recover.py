"""Which memory snapshot a start can restore, and its files gathered for this rank (node_memory.py's ``newest``).
Pure choices and file placement: the collectives are node_memory.py's.

1. Every rank says what its node holds (``Holding``: steps, committed or landing, the files of each) and where
   it serves.
2. Every rank computes the same choice (``choose``): the newest snapshot the run may restore from (rank 0
   read ``RUN/memory_segments``: any of the last start's segment, and the one snapshot it restored; a node
   that rejoins with an older start's snapshots, or the restored start's others, is ignored) that some node
   committed (so every copy of it had landed everywhere: a landing copy of it elsewhere is then complete too),
   whose meta.json, backbone and every old rank's classifier file survive on some node, and that is not older
   than the disk checkpoint. Files of two segments are never combined, even at the same step.
3. Each rank builds a checkpoint folder of its own in its node's store (``gather``): meta.json from one node for
   all (``agree_on_resume`` compares its bytes), the backbone, and the old files its new label slice needs:
   linked when its node holds them, else fetched from a rank of a node that does. ``checkpoint.load``
   restores it as it restores a disk checkpoint: bitwise at the same world size, re-sharded at another.
4. When memory cannot cover a newer step (a node and its buddy both lost), one line says so, and the disk
   checkpoint is used.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, NamedTuple, Optional, Tuple

from ...run_files import classifier_file, read_meta

VIEW = "recover-rank-{:05d}"
Key = Tuple[str, int]          # a snapshot: (segment, step)


class Held(NamedTuple):
    """One snapshot on one node: committed there (or landing), its files, the part of meta.json the choice needs."""

    committed: bool
    files: List[str]
    meta: Optional[dict]


class Holding(NamedTuple):
    """What a rank says its node holds, and where the rank serves its node's files."""

    node: str
    address: str
    port: int
    listing: Dict[Key, Held]


def node_listing(store) -> Dict[Key, Held]:
    """This node's snapshots (memory_store.NodeStore)."""
    out = {}
    for key, (committed, files) in store.listing().items():
        meta = None
        if "meta.json" in files:
            try:
                with store.open_file(key, "meta.json") as f:
                    m = json.loads(f.read())
                meta = {"world_size": m["world_size"], "slices": m["slices"], "replicated": m.get("replicated")}
            except (OSError, ValueError, KeyError):
                files = [f for f in files if f != "meta.json"]
        out[key] = Held(committed, files, meta)
    return out


def choose(everyone: List[Holding], disk_step: int, segments: List) -> Tuple[Optional[Key], Optional[str]]:
    """(the snapshot to restore from memory or None, the one line when a newer one cannot be restored).
    ``everyone``: every rank's Holding; ``segments``: what a restore may take (node_memory.read_segments: a
    segment, any of its snapshots; a (segment, step), that one); the same answer on every rank."""
    nodes: Dict[str, Dict[Key, Held]] = {}
    for h in everyone:
        nodes.setdefault(h.node, h.listing)
    committed = sorted({k for lst in nodes.values() for k, held in lst.items()
                        if held.committed and (k[0] in segments or k in segments)},
                       key=lambda k: k[1], reverse=True)
    missed = None
    for snap in committed:
        if snap[1] < disk_step:
            break
        files = set().union(*(set(lst[snap].files) for lst in nodes.values() if snap in lst))
        meta = next((lst[snap].meta for lst in nodes.values() if snap in lst and lst[snap].meta), None)
        if meta is None or "backbone.pt" not in files:
            lacking = ["meta.json and the backbone"]
        else:
            wanted = [classifier_file(r, meta["world_size"]) for r in range(meta["world_size"])]
            lacking = [f"rank {r}'s slice" for r, f in enumerate(wanted) if f not in files]
        if not lacking:
            return snap, missed
        missed = missed or (f"memory snapshot of step {snap[1]} cannot be restored: {', '.join(lacking)} "
                            "survived on no node (its node and its buddy's both lost)")
    return None, missed


def holders(everyone: List[Holding], snap: Key, name: str) -> List[int]:
    """The ranks whose node holds file ``name`` of the snapshot ``snap``, lowest first."""
    return [r for r, h in enumerate(everyone) if snap in h.listing and name in h.listing[snap].files]


def needed_files(meta: dict, rank: int, slices: List[Tuple[int, int]], replicated: bool) -> List[str]:
    """The old classifier files that rank ``rank`` of the new ``slices`` reads (checkpoint.load's choice)."""
    world_size, (start, end) = len(slices), slices[rank]
    if meta["world_size"] == world_size and [list(s) for s in meta["slices"]] == [list(s) for s in slices]:
        return [classifier_file(rank, world_size)]
    if replicated:
        return [classifier_file(0, meta["world_size"])]
    return [classifier_file(r, meta["world_size"]) for r, (a, b) in enumerate(meta["slices"])
            if max(a, start) < min(b, end)]


def gather(node, everyone: List[Holding], snap: Key, view: str, slices: List[Tuple[int, int]], replicated: bool,
           fetched: List[str]) -> None:
    """This rank's folder ``view`` of the snapshot ``snap`` for its slice of ``slices`` (node_memory.NodeMemory
    ``node``: its store and link); the names of the files fetched from other nodes are appended to ``fetched``."""
    node.store.remove_folder(os.path.basename(view))      # never through a link in the store's place
    os.makedirs(view, 0o700)
    meta_from = holders(everyone, snap, "meta.json")[0]
    _place(node, everyone, snap, "meta.json", view, prefer=meta_from, fetched=fetched)
    meta = read_meta(view, check_version=False)
    for name in ["backbone.pt"] + needed_files(meta, node.comm.rank, slices, replicated):
        _place(node, everyone, snap, name, view, prefer=None, fetched=fetched)


def _place(node, everyone: List[Holding], snap: Key, name: str, view: str, prefer: Optional[int],
           fetched: List[str]) -> None:
    """File ``name`` of ``snap`` into ``view``: linked from this node's store when it holds it (and ``prefer``,
    the rank whose node every rank takes it from, is on this node or unset), else fetched from a holder."""
    mine = node.store.find(snap, name)
    here = node.peers[node.comm.rank].node
    if mine and (prefer is None or everyone[prefer].node == here):
        os.symlink(mine, os.path.join(view, name))
        return
    sources = [prefer] if prefer is not None else holders(everyone, snap, name)
    if not sources:
        raise FileNotFoundError(f"no node holds {name} of step {snap[1]}")
    last = None
    for r in sources:
        try:
            with open(os.path.join(view, name), "wb") as f:
                node.link.get((everyone[r].address, everyone[r].port), snap, name, f)
            fetched.append(name)
            return
        except (OSError, RuntimeError) as e:      # a LinkError (a RuntimeError) too: the next holder
            last = e
    raise RuntimeError(f"{name} of step {snap[1]}: no holder answered ({last})")
