"""Turning imported samples into a shard set: dense renumbering, the partition policy, atomic writing.

Renumbering: the original class identities (ints or names) are sorted and numbered 0..C-1, so the same
input always gives the same global labels; the manifest's class-name table maps them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hvd_partialfc.partition import balanced_slices, even_slices, imbalance
from hvd_partialfc.shards import Manifest, ShardError, write_shard_set


@dataclass
class ImportedData:
    kind: str                      # images | encoded | features
    samples: Any                   # array (N, ...) or list of encoded bytes
    labels: Any                    # original class identities, one per sample
    source: Dict[str, Any] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    sample_shape: Optional[List[int]] = None   # decoded shape, for encoded samples


def renumber(original: Sequence) -> tuple:
    """(dense int64 labels 0..C-1, class names in label order); order: sorted original identities."""
    arr = np.asarray(original)
    names, dense = np.unique(arr, return_inverse=True)
    return dense.astype(np.int64), [str(n) for n in names.tolist()]


def partition_classes(labels: np.ndarray, num_classes: int, num_shards: int, balance: str):
    counts = np.bincount(labels, minlength=num_classes)
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


def build_shard_set(data: ImportedData, out: str, num_shards: int, balance: str = "classes",
                    overwrite: bool = False, compression: Optional[str] = None) -> Manifest:
    if len(data.labels) == 0:
        raise ShardError("no samples to write (the source is empty, or every sample was skipped)")
    labels, names = renumber(data.labels)
    num_classes = len(names)
    if num_classes < num_shards:
        raise ShardError(f"{num_classes} classes cannot fill {num_shards} shards (need >= 1 class per shard)")
    slices, info = partition_classes(labels, num_classes, num_shards, balance)
    manifest = write_shard_set(out, data.kind, data.samples, labels, slices, num_classes, class_names=names,
                               partition=info, source=data.source, skipped=data.skipped,
                               overwrite=overwrite, compression=compression)
    return manifest
