"""Turning imported samples into a shard set: storage, held-out classes, dense renumbering, the partition
policy, atomic writing (`data_tools.shard_writer.AtomicShardDir`).

Renumbering: the original class identities (ints or names) are sorted and numbered 0..C-1, so the same
input always gives the same global labels; the manifest's class-name table maps them back.

Held-out classes (``holdout`` > 0): a seeded random fraction of the classes is taken out *before*
renumbering; those classes never enter the training set and are written as their own shard set (the input
of ``hvd-partialfc-shards pairs``). Both sets are renumbered independently.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvd_partialfc.atomic import recover_folder
from hvd_partialfc.data.partition import balanced_slices, even_slices, imbalance
from hvd_partialfc.data.shards import Manifest, ShardError

from .imported import ImportedData
from .shard_writer import write_shard_set
from .storage import to_storage

# Chosen by measurement (`python -m data_tools.bench_loader`, docs/evidence/data.md §5.1): a contiguous, uncompressed
# dataset (chunk_samples=0) reads a random batch of 128 ~17x faster than any chunked layout, and
# compression (which needs chunks) is slower still; raw glyphs compress only ~1.5x.
DEFAULT_CHUNK_SAMPLES = 0
DEFAULT_COMPRESSION: Optional[str] = None


def renumber(original: Sequence) -> tuple:
    """(dense int64 labels 0..C-1, class names in label order); order: sorted original identities."""
    arr = np.asarray(original)
    names, dense = np.unique(arr, return_inverse=True)
    return dense.astype(np.int64).reshape(-1), [str(n) for n in names.tolist()]


def partition_classes(labels: np.ndarray, num_classes: int, num_shards: int, balance: str):
    return partition_counts(np.bincount(labels, minlength=num_classes), num_shards, balance)


def partition_counts(counts: np.ndarray, num_shards: int, balance: str):
    """(label slices, partition info) from the samples per class (what `partition_classes` needs)."""
    num_classes = len(counts)
    if balance == "classes":
        slices = even_slices(num_classes, num_shards)
    elif balance == "samples":
        slices = balanced_slices(counts.tolist(), num_shards)
    else:
        raise ValueError(f"unknown balance policy {balance!r}; known: classes, samples")
    per_shard = [int(counts[s.start:s.end].sum()) for s in slices]
    even = [int(counts[s.start:s.end].sum()) for s in even_slices(num_classes, num_shards)]
    info = {"policy": balance, "sample_imbalance": imbalance(per_shard),
            "sample_imbalance_by_classes": imbalance(even)}
    return slices, info


def check_classes(data: ImportedData) -> None:
    """Clear errors for a source without classes or with a declared class that has no sample left."""
    if len(data.labels) == 0:
        why = f" ({len(data.skipped)} unreadable samples skipped)" if data.skipped else ""
        raise ShardError(f"no classes: the source holds no samples{why}")
    if data.classes is not None:
        present = {str(l) for l in data.labels}
        empty = [str(c) for c in data.classes if str(c) not in present]
        if empty:
            raise ShardError(f"class {empty[0]!r} is empty ({len(empty)} empty classes; every sample "
                             f"was unreadable and skipped): fix or remove them")


def split_holdout(data: ImportedData, fraction: float, seed: int) -> Tuple[ImportedData, Optional[ImportedData]]:
    """(training part, held-out part or None): a seeded ``fraction`` of the classes goes to the second."""
    if not fraction:
        return data, None
    if not 0 < fraction < 1:
        raise ValueError(f"--holdout must be in [0, 1), got {fraction}")
    names = np.unique(np.asarray(data.labels))
    n_out = int(round(fraction * len(names)))
    if n_out == 0 or n_out == len(names):
        raise ShardError(f"--holdout {fraction} of {len(names)} classes leaves {n_out} held-out and "
                         f"{len(names) - n_out} training classes; both must be >= 1")
    rng = np.random.default_rng(seed)
    held = set(names[np.sort(rng.choice(len(names), n_out, replace=False))].tolist())
    is_held = np.array([l in held for l in np.asarray(data.labels).tolist()])
    return data.subset(np.flatnonzero(~is_held)), data.subset(np.flatnonzero(is_held))


def build_shard_set(data: ImportedData, out: str, num_shards: int, balance: str = "classes",
                    overwrite: bool = False, compression: Optional[str] = DEFAULT_COMPRESSION,
                    chunk_samples: int = DEFAULT_CHUNK_SAMPLES) -> Manifest:
    """Write ``data`` (samples already in their stored form) as a shard set of ``num_shards`` shards."""
    check_classes(data)
    if num_shards < 1:
        raise ShardError(f"--num-shards must be >= 1, got {num_shards}")
    labels, names = renumber(data.labels)
    num_classes = len(names)
    if num_classes < num_shards:
        raise ShardError(f"fewer classes than shards: {num_classes} classes cannot fill {num_shards} shards "
                         f"(need >= 1 class per shard)")
    slices, info = partition_classes(labels, num_classes, num_shards, balance)
    shape = data.sample_shape if data.kind == "encoded" else None
    return write_shard_set(out, data.kind, data.samples, labels, slices, num_classes, class_names=names,
                           partition=info, source=data.source, skipped=data.skipped,
                           overwrite=overwrite, compression=compression, chunk_samples=chunk_samples,
                           sample_shape=shape)


@dataclass
class BuildOptions:
    """Options of one ``build`` (the CLI flags of the same names)."""

    out: str
    num_shards: int
    balance: str = "classes"
    store: str = "raw"
    size: Optional[List[int]] = None          # H, W of image samples (fonts: the square side)
    color: Optional[str] = None               # gray | rgb (image files; default: the first image's)
    on_error: str = "fail"
    workers: int = 1
    seed: int = 0
    holdout: float = 0.0
    holdout_out: Optional[str] = None
    holdout_shards: int = 1
    overwrite: bool = False
    compression: Optional[str] = DEFAULT_COMPRESSION
    chunk_samples: int = DEFAULT_CHUNK_SAMPLES
    progress: bool = True
    check: bool = True                        # encoded, streaming formats: decode every image to check it


def build(importer, source: Optional[str], opts: BuildOptions, **importer_options) -> Dict[str, Any]:
    """Import, store, split, write. Returns a summary (manifests, timings, throughput)."""
    if opts.holdout and not opts.holdout_out:
        opts.holdout_out = opts.out.rstrip("/") + "-holdout"
    # Fail early (before minutes of rendering) on outputs that exist, once a crash's leftovers are settled.
    for path in filter(None, (opts.out, opts.holdout_out if opts.holdout else None)):
        recover_folder(path)
        if os.path.exists(path) and not opts.overwrite:
            raise ShardError(f"{os.path.abspath(path)} already exists (pass --overwrite to replace it)")
    t0 = time.perf_counter()
    data = importer(source, size=opts.size, seed=opts.seed, workers=opts.workers, progress=opts.progress,
                    **importer_options)
    data = to_storage(data, opts.store, opts.size, opts.color, opts.on_error, opts.workers, opts.progress)
    check_classes(data)
    t_import = time.perf_counter() - t0
    train, held = split_holdout(data, opts.holdout, opts.seed)
    for part, shards in ((train, opts.num_shards), (held, opts.holdout_shards)):
        n = len(np.unique(np.asarray(part.labels))) if part is not None else shards
        if n < shards:           # before writing either set
            raise ShardError(f"fewer classes than shards: {n} classes cannot fill {shards} shards "
                             f"(need >= 1 class per shard)")
    write = dict(balance=opts.balance, overwrite=opts.overwrite, compression=opts.compression,
                 chunk_samples=opts.chunk_samples)
    held_manifest = None
    if held is not None:
        held.source["holdout_of"] = os.path.relpath(opts.out, opts.holdout_out)   # relative: the sets move together
        held_manifest = build_shard_set(held, opts.holdout_out, opts.holdout_shards, **write)
        train.source["holdout"] = {"fraction": opts.holdout, "seed": opts.seed,
                                   "path": os.path.relpath(opts.holdout_out, opts.out),
                                   "classes": held_manifest.num_classes}
    try:
        manifest = build_shard_set(train, opts.out, opts.num_shards, **write)
    except BaseException:
        if held_manifest is not None:        # never leave a held-out set without its training set
            shutil.rmtree(opts.holdout_out, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    n = manifest.num_samples + (held_manifest.num_samples if held_manifest else 0)
    return {"manifest": manifest, "holdout": held_manifest, "seconds": seconds, "import_seconds": t_import,
            "samples_per_s": n / seconds if seconds else float("inf"), "skipped": len(data.skipped)}
