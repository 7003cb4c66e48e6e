"""Resume from memory snapshots (memory.py) at any world size; fall back to the disk checkpoint when they
cannot cover every slice. A collective: every rank calls ``recover`` from resume.py (``checkpoint.resume: auto``).

1. Every rank says what its node holds (steps, committed or landing, the files of each) and where it serves.
2. Every rank computes the same choice: the newest step that some node committed (so every copy of it had
   landed everywhere: a landing copy of that step elsewhere is then complete too), whose meta.json, backbone
   and every old rank's classifier file survive on some node, and that is not older than the disk checkpoint.
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


def _node_listing(store) -> Dict[int, Tuple[bool, List[str], Optional[dict]]]:
    """This node's snapshots: step -> (committed, files, the part of meta.json the choice needs)."""
    out = {}
    for step, (committed, files) in store.listing().items():
        meta = None
        if "meta.json" in files:
            try:
                m = json.loads(open(store.find(step, "meta.json")).read())
                meta = {"world_size": m["world_size"], "slices": m["slices"], "replicated": m.get("replicated")}
            except (OSError, ValueError, KeyError):
                files = [f for f in files if f != "meta.json"]
        out[step] = (committed, files, meta)
    return out


def choose(everyone: List[tuple], disk_step: int) -> Tuple[Optional[int], Optional[str]]:
    """(the step to restore from memory or None, the one line when a newer step cannot be restored).
    ``everyone``: every rank's (node key, address, port, listing); the same answer on every rank."""
    nodes: Dict[str, dict] = {}
    for key, _, _, listing in everyone:
        nodes.setdefault(key, listing)
    committed = sorted({s for lst in nodes.values() for s, (c, _, _) in lst.items() if c}, reverse=True)
    missed = None
    for step in committed:
        if step < disk_step:
            break
        files = set().union(*(set(lst[step][1]) for lst in nodes.values() if step in lst))
        meta = next((lst[step][2] for lst in nodes.values() if step in lst and lst[step][2]), None)
        if meta is None or "backbone.pt" not in files:
            lacking = ["meta.json and the backbone"]
        else:
            wanted = [classifier_file(r, meta["world_size"]) for r in range(meta["world_size"])]
            lacking = [f"rank {r}'s slice" for r, f in enumerate(wanted) if f not in files]
        if not lacking:
            return step, missed
        missed = missed or (f"memory snapshot of step {step} cannot be restored: {', '.join(lacking)} "
                            "survived on no node (its node and its buddy's both lost)")
    return None, missed


def holders(everyone: List[tuple], step: int, name: str) -> List[int]:
    """The ranks whose node holds file ``name`` of the snapshot of ``step``, lowest first."""
    return [r for r, (_, _, _, lst) in enumerate(everyone) if step in lst and name in lst[step][1]]


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
            log=print) -> Tuple[Optional[str], Optional[int]]:
    """The folder to resume from (a view of a memory snapshot, or ``disk_path``) and the memory step used
    (None: none). A collective."""
    store, link = snaps.store, snaps.link
    disk_step = read_meta(disk_path)["step"] if disk_path else -1
    everyone = comm.allgather_object((snaps.peers[comm.rank][0], *link.address, _node_listing(store)),
                                     name="memory.recover")
    step, missed = choose(everyone, disk_step)
    if missed and comm.is_main:
        log(f"{missed}; resuming from " + (f"the older memory snapshot of step {step}" if step is not None else
                                           f"the disk checkpoint {disk_path} (step {disk_step})" if disk_path
                                           else "step 0 (no disk checkpoint)"))
    if step is None:
        return disk_path, None
    view = os.path.join(store.path, VIEW.format(comm.rank))
    error, fetched = None, []
    try:
        shutil.rmtree(view, ignore_errors=True)
        os.makedirs(view)
        meta_from = holders(everyone, step, "meta.json")[0]
        _place(snaps, everyone, step, "meta.json", view, prefer=meta_from, fetched=fetched)
        meta = read_meta(view, check_version=False)
        names = ["backbone.pt"] + needed_files(meta, comm.rank, slices, replicated)
        for name in names:
            _place(snaps, everyone, step, name, view, prefer=None, fetched=fetched)
    except Exception as e:  # noqa: BLE001 (agreed: every rank falls back together)
        error = f"{type(e).__name__}: {e}"
    failed = comm.failures(error, name="memory.view")
    if failed:
        if comm.is_main:
            log(f"memory snapshot of step {step} could not be gathered ("
                + "; ".join(f"rank {r}: {e}" for r, e in failed) + "); resuming from "
                + (f"the disk checkpoint {disk_path}" if disk_path else "step 0"))
        shutil.rmtree(view, ignore_errors=True)
        return disk_path, None
    if comm.is_main:
        log(f"memory: resuming from the snapshot of step {step} in node memory (disk checkpoint: "
            + (f"step {disk_step}" if disk_path else "none") + f"; {len(fetched)} file(s) fetched from other nodes "
            "on rank 0)")
    return view, step


def _place(snaps, everyone, step: int, name: str, view: str, prefer: Optional[int], fetched: List[str]) -> None:
    """File ``name`` of ``step`` into ``view``: linked from this node's store when it holds it (and ``prefer``,
    the rank whose node every rank takes it from, is on this node or unset), else fetched from a holder."""
    mine = snaps.store.find(step, name)
    here = snaps.peers[snaps.comm.rank][0]
    if mine and (prefer is None or everyone[prefer][0] == here):
        os.symlink(mine, os.path.join(view, name))
        return
    sources = [prefer] if prefer is not None else holders(everyone, step, name)
    if not sources:
        raise FileNotFoundError(f"no node holds {name} of step {step}")
    last = None
    for r in sources:
        try:
            with open(os.path.join(view, name), "wb") as f:
                snaps.link.get((everyone[r][1], everyone[r][2]), step, name, f)
            fetched.append(name)
            return
        except (OSError, RuntimeError) as e:      # a LinkError (a RuntimeError) too: the next holder
            last = e
    raise RuntimeError(f"{name} of step {step}: no holder answered ({last})")


def after_resume(snaps, comm, step: Optional[int]) -> None:
    """Once the resume is agreed: this rank's view goes; each node keeps the snapshot it restored (a failure
    before the next commit restores it again), every other snapshot of the run on the node goes."""
    shutil.rmtree(os.path.join(snaps.store.path, VIEW.format(comm.rank)), ignore_errors=True)
    comm.agree(None, name="memory.resumed")        # every view read before a node's store is tidied
    if snaps.is_writer:
        if step is None:
            snaps.store.keep_only(None)
        else:           # committed here too: it was committed on some node, so it landed everywhere; a newer
            snaps.store.commit(step)        # one (landing when the run failed) is stale: the run goes on from here
            snaps.store.keep_only(step)
    snaps.committed = step
