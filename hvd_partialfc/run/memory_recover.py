"""Resume from memory snapshots (memory.py) at any world size; fall back to the disk checkpoint when they
cannot cover every slice. A collective: every rank calls ``recover`` from resume.py (``checkpoint.resume: auto``).

1. Every rank says what its node holds (steps, committed or landing, the files of each) and where it serves.
2. Every rank computes the same choice: the newest snapshot of a segment the run may restore from (rank 0
   read them from ``RUN/memory_segments``: the last start's, and the one it restored; a node that rejoins
   with an older start's snapshots is ignored) that some node committed (so every copy of it had landed
   everywhere: a landing copy of it elsewhere is then complete too), whose meta.json, backbone and every old
   rank's classifier file survive on some node, and that is not older than the disk checkpoint. Files of two
   segments are never combined, even at the same step.
3. Each rank builds a checkpoint folder of its own in its node's store: meta.json from one node for all
   (``agree_on_resume`` compares its bytes), the backbone, and the old files its new label slice needs: linked
   when its node holds them, else fetched from a rank of a node that does. ``checkpoint.load`` restores it
   as it restores a disk checkpoint: bitwise at the same world size, re-sharded at another.
4. When memory cannot cover a newer step (a node and its buddy both lost), one line says so, and the disk
   checkpoint is used.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

from ..run_files import classifier_file, read_meta

VIEW = "recover-rank-{:05d}"


def _node_listing(store) -> Dict[tuple, Tuple[bool, List[str], Optional[dict]]]:
    """This node's snapshots: (segment, step) -> (committed, files, the part of meta.json the choice needs)."""
    out = {}
    for key, (committed, files) in store.listing().items():
        meta = None
        if "meta.json" in files:
            try:
                m = json.loads(open(store.find(key, "meta.json")).read())
                meta = {"world_size": m["world_size"], "slices": m["slices"], "replicated": m.get("replicated")}
            except (OSError, ValueError, KeyError):
                files = [f for f in files if f != "meta.json"]
        out[key] = (committed, files, meta)
    return out


def choose(everyone: List[tuple], disk_step: int, segments: List[str]) -> Tuple[Optional[tuple], Optional[str]]:
    """(the snapshot (segment, step) to restore from memory or None, the one line when a newer one cannot be
    restored). ``everyone``: every rank's (node key, address, port, listing); ``segments``: those a restore
    may take; the same answer on every rank."""
    nodes: Dict[str, dict] = {}
    for key, _, _, listing in everyone:
        nodes.setdefault(key, listing)
    committed = sorted({k for lst in nodes.values() for k, (c, _, _) in lst.items() if c and k[0] in segments},
                       key=lambda k: k[1], reverse=True)
    missed = None
    for snap in committed:
        if snap[1] < disk_step:
            break
        files = set().union(*(set(lst[snap][1]) for lst in nodes.values() if snap in lst))
        meta = next((lst[snap][2] for lst in nodes.values() if snap in lst and lst[snap][2]), None)
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


def holders(everyone: List[tuple], snap: tuple, name: str) -> List[int]:
    """The ranks whose node holds file ``name`` of the snapshot ``snap`` (segment, step), lowest first."""
    return [r for r, (_, _, _, lst) in enumerate(everyone) if snap in lst and name in lst[snap][1]]


def needed_files(meta: dict, rank: int, slices: List[Tuple[int, int]], replicated: bool) -> List[str]:
    """The old classifier files that rank ``rank`` of the new ``slices`` reads (checkpoint.load's choice)."""
    world_size, (start, end) = len(slices), slices[rank]
    if meta["world_size"] == world_size and [list(s) for s in meta["slices"]] == [list(s) for s in slices]:
        return [classifier_file(rank, world_size)]
    if replicated:
        return [classifier_file(0, meta["world_size"])]
    return [classifier_file(r, meta["world_size"]) for r, (a, b) in enumerate(meta["slices"])
            if max(a, start) < min(b, end)]


def recover(snaps, comm, disk_path: Optional[str], slices: List[Tuple[int, int]], replicated: bool,
            log=print) -> Tuple[Optional[str], Optional[tuple]]:
    """The folder to resume from (a view of a memory snapshot, or ``disk_path``) and the snapshot used,
    (segment, step) (None: none). A collective."""
    store, link = snaps.store, snaps.link
    disk_step = read_meta(disk_path)["step"] if disk_path else -1
    everyone = comm.allgather_object((snaps.peers[comm.rank][0], *link.address, _node_listing(store)),
                                     name="memory.recover")
    snap, missed = choose(everyone, disk_step, snaps.segments)
    if missed and comm.is_main:
        log(f"{missed}; resuming from " + (f"the older memory snapshot of step {snap[1]}" if snap is not None else
                                           f"the disk checkpoint {disk_path} (step {disk_step})" if disk_path
                                           else "step 0 (no disk checkpoint)"))
    if snap is None:
        return disk_path, None
    view = os.path.join(store.path, VIEW.format(comm.rank))
    error, fetched = None, []
    try:
        shutil.rmtree(view, ignore_errors=True)
        os.makedirs(view, 0o700)
        meta_from = holders(everyone, snap, "meta.json")[0]
        _place(snaps, everyone, snap, "meta.json", view, prefer=meta_from, fetched=fetched)
        meta = read_meta(view, check_version=False)
        names = ["backbone.pt"] + needed_files(meta, comm.rank, slices, replicated)
        for name in names:
            _place(snaps, everyone, snap, name, view, prefer=None, fetched=fetched)
    except Exception as e:  # noqa: BLE001 (agreed: every rank falls back together)
        error = f"{type(e).__name__}: {e}"
    failed = comm.failures(error, name="memory.view")
    if failed:
        if comm.is_main:
            log(f"memory snapshot of step {snap[1]} could not be gathered ("
                + "; ".join(f"rank {r}: {e}" for r, e in failed) + "); resuming from "
                + (f"the disk checkpoint {disk_path}" if disk_path else "step 0"))
        shutil.rmtree(view, ignore_errors=True)
        return disk_path, None
    if comm.is_main:
        log(f"memory: resuming from the snapshot of step {snap[1]} in node memory (disk checkpoint: "
            + (f"step {disk_step}" if disk_path else "none") + f"; {len(fetched)} file(s) fetched from other nodes "
            "on rank 0)")
    return view, snap


def _place(snaps, everyone, snap: tuple, name: str, view: str, prefer: Optional[int], fetched: List[str]) -> None:
    """File ``name`` of ``snap`` into ``view``: linked from this node's store when it holds it (and ``prefer``,
    the rank whose node every rank takes it from, is on this node or unset), else fetched from a holder."""
    mine = snaps.store.find(snap, name)
    here = snaps.peers[snaps.comm.rank][0]
    if mine and (prefer is None or everyone[prefer][0] == here):
        os.symlink(mine, os.path.join(view, name))
        return
    sources = [prefer] if prefer is not None else holders(everyone, snap, name)
    if not sources:
        raise FileNotFoundError(f"no node holds {name} of step {snap[1]}")
    last = None
    for r in sources:
        try:
            with open(os.path.join(view, name), "wb") as f:
                snaps.link.get((everyone[r][1], everyone[r][2]), snap, name, f)
            fetched.append(name)
            return
        except (OSError, RuntimeError) as e:      # a LinkError (a RuntimeError) too: the next holder
            last = e
    raise RuntimeError(f"{name} of step {snap[1]}: no holder answered ({last})")


def after_resume(snaps, comm, snap: Optional[tuple]) -> None:
    """Once the resume is agreed: this rank's view goes; each node keeps the snapshot it restored (committed
    here too: it was committed on some node, so it landed everywhere; a newer one, landing when the run
    failed, is stale: the run goes on from here; a failure before the next commit restores it again), every
    other snapshot of the run on the node goes."""
    shutil.rmtree(os.path.join(snaps.store.path, VIEW.format(comm.rank)), ignore_errors=True)
    comm.agree(None, name="memory.resumed")        # every view read before a node's store is tidied
    if snaps.is_writer:
        snaps.store.keep_only(snap)
    snaps.committed = snaps.restored = snap
