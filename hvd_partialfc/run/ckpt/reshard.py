"""Re-sharding: a checkpoint's classifier rows (and their optimizer state) cut for another world size.
``checkpoint.load`` uses it when a run resumes at another world size; ``hvd-partialfc reshard`` writes a
re-sharded copy. Not a collective; imports no Horovod."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional

import torch

from ... import atomic
from ...run_files import CheckpointError, classifier_file, load_file, read_meta, resolve_checkpoint

def _row_sliced(value: Any, width: int, dim: int) -> bool:
    """Per-row optimizer state: shaped like the weight (W, D) (momentum, moments), or a (W,) vector (the
    sampled-rows AdamW's per-row step count, rowsparse.py)."""
    return torch.is_tensor(value) and tuple(value.shape) in ((width, dim), (width,))


def gather_classifier_rows(ckpt_dir: str, meta: Dict[str, Any], start: int, end: int) -> Dict[str, Any]:
    """Classifier rows ``[start, end)`` and their optimizer state, cut from the old ranks' files.

    Rows of the new slice may come from several old files (fewer ranks) or from part of one (more
    ranks). Per-row optimizer state (SGD momentum, Adam moments: tensors shaped like the weight; the
    sampled-rows AdamW's (W,) per-row step; the exact rule's (W,) ``since_base``) is cut the same way;
    per-parameter scalars (Adam's step) are equal on all old ranks and taken from the first.

    The exact rule's ``lrs`` (the lrs since the last sweep, which ``since_base`` counts into) is the one
    per-parameter value that is rank-local: a rank whose classifier step was skipped (a non-finite
    classifier gradient, ``train.max_consecutive_skips``) appended nothing, so its list is shorter and its
    sweeps fall at other steps. When the old files' lists differ, each file's rows are brought current
    with their own list (``rowsparse.sweep_rows``, on copies of the cut rows) and the new state has no
    step since a sweep; the numbers are the dense step's to float32 round-off, as the exact rule's are.
    Taken from the first file (before), another rank's rows were caught up over the wrong steps, or by a
    table too short for them (IndexError at the first step). When the lists are equal (no rank-local
    skip) the rows are cut as they are: bitwise what the old ranks held.
    """
    parts = []
    for (old_start, old_end), name in zip(meta["slices"], meta["classifier_files"]):
        lo, hi = max(start, old_start), min(end, old_end)
        if lo >= hi:
            continue
        path = os.path.join(ckpt_dir, name)
        f = load_file(path, "classifier checkpoint")
        if (f["label_start"], f["label_end"]) != (old_start, old_end):
            raise CheckpointError(f"{path} covers [{f['label_start']}, {f['label_end']}), meta.json says "
                                  f"[{old_start}, {old_end})")
        parts.append((f, lo - old_start, hi - old_start))
    if not parts or sum(b - a for _, a, b in parts) != end - start:
        raise CheckpointError(f"{ckpt_dir}: the classifier files do not cover labels [{start}, {end})")
    histories = {tuple(f["optimizer"].get("state", {}).get(0, {}).get("lrs", ())) for f, _, _ in parts}
    weights, states, scalars, groups = [], [], {}, None
    for f, a, b in parts:
        shape, opt = f["weight"].shape, f["optimizer"]
        groups = groups or opt.get("param_groups")
        st = opt.get("state", {}).get(0, {})
        w, rows = f["weight"][a:b], {k: v[a:b] for k, v in st.items() if _row_sliced(v, *shape)}
        if len(histories) > 1:
            w, rows = _brought_current(w, rows, st["lrs"], opt["param_groups"][0])
        weights.append(w)
        states.append(rows)
        for k, v in st.items():
            if not _row_sliced(v, *shape):
                scalars.setdefault(k, [] if k == "lrs" and len(histories) > 1 else v)
    state = {}
    if states and states[0]:
        state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    state.update(scalars)
    return {"weight": torch.cat(weights),
            "optimizer": {"state": {0: state} if state else {}, "param_groups": groups or []}}


def _brought_current(weight, rows: Dict[str, Any], lrs, group: Dict[str, Any]):
    """Copies of the cut rows ``weight`` and their per-row state, brought up through ``lrs`` (the exact
    rule's sweep with the old rank's own history and hyper-parameters); ``since_base`` then 0."""
    from ...classifier.rowsparse import SWEEP_BLOCK, sweep_rows
    weight = weight.clone()
    rows = {k: v.clone() for k, v in rows.items()}
    mu = group.get("momentum", 0.0)
    state = {"since_base": rows["since_base"], "lrs": list(lrs)}
    tmp = weight.new_empty((min(SWEEP_BLOCK, weight.shape[0]), *weight.shape[1:]))
    sweep_rows(weight, rows["momentum_buffer"] if mu else None, state, mu, group["weight_decay"], tmp)
    return weight, rows


def reshard_slices(ckpt_dir: str, meta: Dict[str, Any], world_size: int, shard_dir: Optional[str] = None):
    """The label slices of ``world_size`` ranks on the checkpoint's shard set: the slices the resumed run
    computes (``RankLayout.from_shards``), so its ranks find their own rows in the re-sharded files.

    A divisor of the shard count needs no sample counts (equal blocks). Any other world size balances
    blocks by samples: meta.json records them since 2026-12-03 (``shard_samples``); for older checkpoints
    they come from the shard set's manifest (``shard_dir``, else the run's ``data.shards``), taken when its
    shards' label ranges are the checkpoint's (as resume requires).
    """
    from ...data.layout import RankLayout
    from ...data.partition import LabelSlice
    shard_slices = [LabelSlice(i, a, b) for i, (a, b) in enumerate(meta["shard_slices"])]
    counts = None
    if 1 <= world_size <= len(shard_slices) and len(shard_slices) % world_size:
        counts = meta.get("shard_samples") or _shard_samples(
            ckpt_dir, meta, world_size, shard_dir or meta.get("config", {}).get("data", {}).get("shards"))
    try:
        return RankLayout.from_shards(shard_slices, world_size, counts).slices
    except ValueError as e:
        raise CheckpointError(f"{ckpt_dir}: cannot re-shard to {world_size} ranks: {e}") from None


def _shard_samples(ckpt_dir: str, meta: Dict[str, Any], world_size: int, shard_dir: Optional[str]) -> List[int]:
    """Every shard's sample count, from the manifest of ``shard_dir`` when it is the checkpoint's shard set."""
    from ...data.shards import ShardError, read_manifest
    why = f"{len(meta['shard_slices'])} shards on {world_size} ranks (not a divisor) are balanced by their " \
          f"sample counts, which {ckpt_dir}/meta.json does not record"
    try:
        manifest = read_manifest(shard_dir) if shard_dir else None
    except ShardError as e:
        raise CheckpointError(f"{why}; the run's shard set cannot be read: {e}") from None
    if manifest is None:
        raise CheckpointError(f"{why}, and no shard set was given")
    if [[s.start, s.end] for s in manifest.shard_slices()] != [list(s) for s in meta["shard_slices"]]:
        raise CheckpointError(f"{why}; {shard_dir} has other shards' label ranges than the checkpoint")
    return [s.num_samples for s in manifest.shards]


def _legacy_length(ckpt_dir: str, meta: Dict[str, Any], shard_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """``progress.legacy_record`` of a checkpoint without ``length``, written at its own world size; None when
    its shards' sample counts are nowhere (resume then reads it from ``resharded_from``)."""
    from ..progress import legacy_record
    try:
        counts = meta.get("shard_samples") or _shard_samples(
            ckpt_dir, meta, meta["world_size"], shard_dir or meta.get("config", {}).get("data", {}).get("shards"))
    except CheckpointError:
        return None
    return legacy_record(meta, counts)


def reshard_checkpoint(src: str, out: str, world_size: int, shard_dir: Optional[str] = None) -> str:
    """Write a copy of checkpoint ``src`` for ``world_size`` ranks (``hvd-partialfc reshard``).

    The backbone is copied; classifier rows and their optimizer state are redistributed to the label
    slices that the shard set gives ``world_size`` ranks (``reshard_slices``: any world size up to the
    shard count); in ``replicated`` mode every rank's file holds the full classifier (its optimizer state
    is the backbone's), so each new rank gets a copy. RNG states do not carry over (each new rank is seeded
    from the run's seed, its rank and the step).

    Crash-safe as a checkpoint save is: the files are written into ``OUT.partial`` and published by the
    checkpoints' own folder commit (``atomic.commit_folder``: every file and folder fsynced, one rename,
    the parent fsynced), so a kill at any point leaves no ``OUT`` or a complete one. A ``OUT.partial`` left
    by a killed run is removed first, never reused: it may hold another world size's classifier files, or
    a half-copied backbone, which the commit would publish with the new ones.
    """
    from ...classifier.modes import get_mode
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    slices = reshard_slices(src, meta, world_size, shard_dir)
    replicated = meta.get("replicated") or get_mode(meta.get("config", {}).get("head", {}).get("mode", "local")).replicated_rows
    if os.path.exists(out):
        raise FileExistsError(f"{out} already exists")
    tmp = out.rstrip("/") + ".partial"
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp)
    elif os.path.lexists(tmp):
        os.unlink(tmp)
    os.makedirs(tmp)
    shutil.copyfile(os.path.join(src, "backbone.pt"), os.path.join(tmp, "backbone.pt"))
    digest = meta["digests"][0]
    full = load_file(os.path.join(src, meta["classifier_files"][0]), "classifier checkpoint") if replicated else None
    for s in slices:
        if replicated:
            rows = {"weight": full["weight"], "optimizer": full["optimizer"]}
        else:
            rows = gather_classifier_rows(src, meta, s.start, s.end)
        rows.update({"rank": s.index, "world_size": world_size, "label_start": s.start, "label_end": s.end,
                     "rng": None, "resharded_from": meta["world_size"], "backbone_digest": digest,
                     "counters": {}})
        atomic.torch_save(rows, os.path.join(tmp, classifier_file(s.index, world_size)))
    new = dict(meta)
    if "length" not in meta:   # a checkpoint from before its run length was kept: its world size is known here
        new["length"] = _legacy_length(src, meta, shard_dir)
    new.update({"world_size": world_size, "slices": [[s.start, s.end] for s in slices],
                "classifier_files": [classifier_file(r, world_size) for r in range(world_size)],
                "digests": [digest] * world_size, "resharded_from": meta["world_size"]})
    atomic.write_text(os.path.join(tmp, "meta.json"), json.dumps(new, indent=1))
    atomic.commit_folder(tmp, out)
    return out
