"""Step 2 of a streaming build (`data_tools/stream.py`): the plan, and which part writes what.

`make_plan` computes the held-out split, renumbering and partition (``--balance``) from the index's
class codes alone, exactly as the in-memory path (`data_tools.build`) computes them from the samples, so
both builders give the same shard sets. `parse_part` says which work items this process writes
(``--part K/M``, or the launcher's rank and size).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvd_partialfc.data.shards import ShardError, shard_name

from .build import partition_counts
from .stream_index import SampleIndex

BLOCK_BYTES = 4 << 20          # decoded bytes per block (raw): bounds memory per block in flight



def _split_sets(n_cls: int, opts) -> List[Tuple[str, np.ndarray, int, str]]:
    """The sets to write, (name, member classes (bool, n_cls), shards, folder): the training set, and the
    held-out one when ``--holdout`` asks (its classes drawn as build.split_holdout draws them); each must have
    a class for every shard."""
    held = np.zeros(n_cls, bool)
    if opts.holdout:
        if not 0 < opts.holdout < 1:
            raise ValueError(f"--holdout must be in [0, 1), got {opts.holdout}")
        n_out = int(round(opts.holdout * n_cls))
        if n_out == 0 or n_out == n_cls:
            raise ShardError(f"--holdout {opts.holdout} of {n_cls} classes leaves {n_out} held-out and "
                             f"{n_cls - n_out} training classes; both must be >= 1")
        rng = np.random.default_rng(opts.seed)           # as build.split_holdout
        held[np.sort(rng.choice(n_cls, n_out, replace=False))] = True
    sets = [("train", ~held, opts.num_shards, opts.out)]
    if opts.holdout:
        sets.append(("holdout", held, opts.holdout_shards, opts.holdout_out))
    for _, members, shards, _ in sets:
        if members.sum() < shards:
            raise ShardError(f"fewer classes than shards: {int(members.sum())} classes cannot fill {shards} "
                             f"shards (need >= 1 class per shard)")
    return sets


def make_plan(index: SampleIndex, opts, shape: List[int]) -> Tuple[Dict[str, Any], np.ndarray, np.ndarray]:
    """(plan, labels int32 (N,): global label in its set, item int32 (N,): work item of each sample).

    A work item's rows are found when it is written (`np.flatnonzero(item == j)`, input order): one
    scan of 4 bytes/sample per shard instead of an argsort kept for the whole build (8 bytes/sample,
    and its workspace: together ~20 bytes/sample of the peak, measured at 5M samples).

    The plan (JSON) holds what the manifests need; work item j is shard j of the training set for
    j < num_shards, then the held-out set's shards.
    """
    n_cls = len(index.classes)
    if len(index) == 0:
        raise ShardError("no classes: the source holds no samples")
    sets = _split_sets(n_cls, opts)
    # Everything per class first (sizes: classes), then two lookups per sample (int32 each): no per-sample
    # temporaries of the sets, which cost ~30 bytes/sample more (measured at 5M samples).
    counts = np.zeros(n_cls, np.int64)
    for a in range(0, len(index), 1 << 20):
        counts += np.bincount(index.codes[a:a + (1 << 20)], minlength=n_cls)
    label_of = np.empty(n_cls, np.int32)
    item_of = np.empty(n_cls, np.int32)
    plan: Dict[str, Any] = {"kind": "images" if opts.store == "raw" else "encoded", "sample_shape": shape,
                            "block_samples": block_samples(opts.store, shape), "sets": [], "items": []}
    for name, members, shards, out in sets:
        cls = np.flatnonzero(members)
        label_of[cls] = np.arange(len(cls), dtype=np.int32)
        slices, info = partition_counts(counts[cls], shards, opts.balance)
        ends = np.array([sl.end for sl in slices], np.int64)
        item_of[cls] = len(plan["items"]) + np.searchsorted(ends, np.arange(len(cls)), side="right")
        set_no = len(plan["sets"])
        plan["sets"].append({"name": name, "out": os.path.abspath(out), "num_classes": int(len(cls)),
                             "class_names": [index.classes[c] for c in cls.tolist()],
                             "partition": info, "source": dict(index.source), "num_shards": shards})
        for sl in slices:
            plan["items"].append({"set": set_no, "index": sl.index, "label_start": sl.start, "label_end": sl.end,
                                  "file": shard_name(sl.index, shards),
                                  "num_samples": int(counts[cls[sl.start:sl.end]].sum())})
    labels = label_of[index.codes]
    item = item_of[index.codes]
    if opts.holdout:
        train, hold = plan["sets"]
        hold["source"]["holdout_of"] = os.path.relpath(train["out"], hold["out"])   # relative, as build.build
        train["source"]["holdout"] = {"fraction": opts.holdout, "seed": opts.seed,
                                      "path": os.path.relpath(hold["out"], train["out"]),
                                      "classes": hold["num_classes"]}
    return plan, labels, item


def block_samples(store: str, shape: Sequence[int]) -> int:
    """Samples per read/write block: ~4 MiB of decoded pixels (raw), 256 encoded images. Depends only on
    the options, never on the workers, so block boundaries (and encoded shards' heap layout) are fixed."""
    if store != "raw":
        return 256
    return int(max(16, min(4096, BLOCK_BYTES // max(1, int(np.prod(shape))))))


def parse_part(text: Optional[str]) -> Tuple[int, int]:
    """``K/M`` (K from 1), or the launcher's rank and size: Open MPI, MPICH/Intel MPI (PMI), Slurm tasks,
    Slurm array jobs; 1/1 without any."""
    if text:
        try:
            k, m = (int(x) for x in text.split("/"))
        except ValueError:
            raise ValueError(f"--part expects K/M, got {text!r}") from None
        if not 1 <= k <= m:
            raise ValueError(f"--part {text}: K must be in 1..M")
        return k, m
    env = os.environ
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in env and size in env and int(env[size]) > 1:
            return int(env[rank]) + 1, int(env[size])
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        k = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", "0")) + 1
        return k, int(env["SLURM_ARRAY_TASK_COUNT"])
    return 1, 1
