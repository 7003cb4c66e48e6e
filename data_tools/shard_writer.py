"""Writing shard sets: one shard file, a whole set from memory, the manifest, the atomic set folder.

The format is `hvd_partialfc.shards` (the reader, and docs/data.md §1); the trainer package only reads
it, all writing lives here in `data_tools` (the streaming build, `data_tools.stream`, writes shard files
block by block itself and its manifests with `write_manifest`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

import h5py
import numpy as np

from hvd_partialfc.atomic import write_text
from hvd_partialfc.partition import LabelSlice, check_partition
from hvd_partialfc.shards import (FORMAT, MANIFEST, VERSION, Manifest, ShardEntry, ShardError, sha256_file,
                                  shard_name)


def write_shard(path: str, kind: str, samples: Any, labels: np.ndarray, label_slice: LabelSlice,
                num_shards: int, compression: Optional[str] = None, chunk_samples: int = 0,
                sample_shape: Optional[Sequence[int]] = None) -> str:
    """Write one shard file and return its sha256.

    ``samples`` is an array (images/features) or, for ``encoded``, a sequence of 1-D uint8 arrays/bytes.
    Chunks hold ``chunk_samples`` samples along the first axis; ``chunk_samples=0`` without compression
    writes a contiguous dataset, which HDF5 reads a random batch from ~17x faster than a chunked one
    (measured by `data_tools/bench_loader.py`, docs/data.md; shards are written once, never extended).
    """
    labels = np.asarray(labels, dtype=np.int64)
    with h5py.File(path, "w", libver="latest") as f:
        f.create_dataset("labels", data=labels)
        n = len(labels)
        if kind == "encoded":
            ds = f.create_dataset("encoded", shape=(n,), dtype=h5py.vlen_dtype(np.uint8),
                                  chunks=(max(1, min(n, chunk_samples)),) if n and chunk_samples else None)
            blobs = np.empty(n, dtype=object)   # one write call instead of one per sample
            for i, blob in enumerate(samples):
                blobs[i] = blob if isinstance(blob, np.ndarray) else np.frombuffer(bytes(blob), dtype=np.uint8)
            if n:   # low-level write: ds[...] = blobs would turn equal-length blobs into a 2-D array
                ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, blobs, mtype=h5py.h5t.py_create(ds.dtype))
        else:
            arr = np.ascontiguousarray(samples)
            contiguous = not n or (not chunk_samples and compression is None)
            chunks = None if contiguous else (max(1, min(n, chunk_samples or 64)),) + arr.shape[1:]
            f.create_dataset(kind, data=arr, chunks=chunks, compression=compression)
        f.attrs.update({"format": FORMAT, "version": VERSION, "kind": kind, "shard_index": label_slice.index,
                        "num_shards": num_shards, "label_start": label_slice.start,
                        "label_end": label_slice.end, "num_samples": n})
        if sample_shape is not None:            # the decoded shape (encoded samples), as in the manifest
            f.attrs["sample_shape"] = np.asarray(list(sample_shape), dtype=np.int64)
    return sha256_file(path)


class AtomicShardDir:
    """Write a shard set into a temporary sibling folder and rename it into place on success.

    An interrupted build leaves only a ``.tmp-*`` folder (never a folder with a manifest at ``out``).
    An existing ``out`` is an error unless ``overwrite``.
    """

    def __init__(self, out: str, overwrite: bool = False):
        self.out = os.path.abspath(out)
        self.overwrite = overwrite
        self.tmp: Optional[str] = None

    def __enter__(self) -> str:
        if os.path.exists(self.out) and not self.overwrite:
            raise ShardError(f"{self.out} already exists (pass --overwrite to replace it)")
        parent = os.path.dirname(self.out)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(self.out)}-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)      # mkdtemp makes 0700; the finished set follows the umask
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if os.path.exists(self.out):
            shutil.rmtree(self.out)
        os.rename(self.tmp, self.out)


def write_manifest(shard_dir: str, manifest: Manifest) -> None:
    write_text(os.path.join(shard_dir, MANIFEST), json.dumps(manifest.to_json(), indent=1, ensure_ascii=False))


def write_shard_set(out: str, kind: str, samples: Any, labels: Sequence[int], slices: Sequence[LabelSlice],
                    num_classes: int, class_names: Optional[Sequence[str]] = None,
                    partition: Optional[Dict[str, Any]] = None, source: Optional[Dict[str, Any]] = None,
                    skipped: Optional[Sequence[str]] = None, overwrite: bool = False,
                    compression: Optional[str] = None, chunk_samples: int = 0,
                    sample_shape: Optional[Sequence[int]] = None) -> Manifest:
    """Write a whole shard set from in-memory samples and global labels, one shard per slice.

    Samples keep their input order within a shard (a stable sort by label range), so the same input
    gives byte-identical shards and the same sha256 in the manifest. For ``encoded`` samples pass
    ``sample_shape``, the decoded (H, W) or (H, W, C) the loader decodes to.
    """
    labels = np.asarray(labels, dtype=np.int64)
    check_partition(slices, num_classes)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ShardError(f"labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
    present = np.bincount(labels, minlength=num_classes)
    if (present == 0).any():
        raise ShardError(f"class {int(np.flatnonzero(present == 0)[0])} has no samples "
                         f"({int((present == 0).sum())} empty classes); renumber the labels densely")
    first = samples[0] if kind == "encoded" else np.asarray(samples[:1])
    if kind == "encoded":
        shape = list(sample_shape) if sample_shape is not None else []
    else:
        shape = list(np.asarray(samples).shape[1:])
    dtype = "uint8" if kind in ("encoded", "images") else str(np.asarray(first).dtype)
    entries = []
    with AtomicShardDir(out, overwrite) as tmp:
        for s in slices:
            idx = np.flatnonzero((labels >= s.start) & (labels < s.end))
            part = [samples[i] for i in idx] if kind == "encoded" else np.asarray(samples)[idx]
            name = shard_name(s.index, len(slices))
            digest = write_shard(os.path.join(tmp, name), kind, part, labels[idx], s, len(slices), compression,
                                 chunk_samples, sample_shape=shape if kind == "encoded" else None)
            entries.append(ShardEntry(name, s.start, s.end, int(len(idx)), digest))
        manifest = Manifest(num_classes=num_classes, kind=kind, sample_shape=shape, sample_dtype=dtype,
                            shards=entries, partition=partition or {"policy": "classes"},
                            class_names=list(class_names or [str(i) for i in range(num_classes)]),
                            source=source or {}, skipped=list(skipped or []))
        write_manifest(tmp, manifest)
    return manifest
