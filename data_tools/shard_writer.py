"""Writing shard sets: one shard file, a whole set from memory, the manifest, the atomic set folder.

The format is `hvd_partialfc.data.shards` (the reader, and docs/data.md §1); the trainer package only reads
it, all writing lives here in `data_tools`. `ShardFileWriter` is the one place that lays out a shard
file: `write_shard` (in-memory builds) writes a shard in one go with it, the streaming build
(`data_tools/stream_write.py`) block by block.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Dict, Optional, Sequence

import h5py
import numpy as np

from hvd_partialfc.atomic import commit_folder, recover_folder, write_text
from hvd_partialfc.data import class_identity
from hvd_partialfc.data.partition import LabelSlice, check_partition
from hvd_partialfc.data.shards import (FORMAT, MANIFEST, VERSION, Manifest, ShardEntry, ShardError, sha256_file,
                                  shard_name)


class ShardFileWriter:
    """One shard file being written (a context manager): the ``labels`` dataset, the samples dataset,
    its rows (`write`, in one go or block by block), and the attributes, written on a normal exit.

    Samples: ``kind`` ``images``/``features`` is an (N, *shape) dataset, ``encoded`` an (N,) one of
    variable-length uint8. Pass ``data`` (the whole array) to create an array dataset with its content
    (then `write` is not called), or ``sample_shape`` to create it empty (uint8) and fill it with `write`;
    encoded rows always come through `write`. ``chunk_samples=0`` without compression gives a contiguous dataset, which HDF5
    reads a random batch from ~17x faster than a chunked one (measured by `data_tools/bench_loader.py`,
    docs/data.md; shards are written once, never extended). ``decoded_shape``, the (H, W[, C]) an
    encoded sample decodes to, is stored as the ``sample_shape`` attribute, as in the manifest.

    The order of the calls into HDF5, and which handles are open when the file closes, are part of the
    bytes: what a builder writes is pinned byte for byte (tests/pins.py), and with the default layout
    (contiguous) the in-memory and the streaming build write identical files. A chunked array dataset
    written whole (``data``) and one written block by block differ in their metadata, not in the samples.
    """

    def __init__(self, path: str, kind: str, labels: np.ndarray, label_slice: LabelSlice, num_shards: int,
                 sample_shape: Optional[Sequence[int]] = None, data: Optional[np.ndarray] = None,
                 compression: Optional[str] = None, chunk_samples: int = 0,
                 decoded_shape: Optional[Sequence[int]] = None):
        self.kind, self.label_slice, self.num_shards = kind, label_slice, num_shards
        self.decoded_shape = decoded_shape
        labels = np.asarray(labels, dtype=np.int64)
        self.n = n = len(labels)
        self.file = h5py.File(path, "w", libver="latest")
        try:
            self.file.create_dataset("labels", data=labels)
            if kind == "encoded":
                self.ds = self.file.create_dataset(
                    "encoded", shape=(n,), dtype=h5py.vlen_dtype(np.uint8),
                    chunks=(max(1, min(n, chunk_samples)),) if n and chunk_samples else None)
                return
            shape = tuple(data.shape[1:]) if data is not None else tuple(sample_shape)
            contiguous = not n or (not chunk_samples and compression is None)
            chunks = None if contiguous else (max(1, min(n, chunk_samples or 64)),) + shape
            if data is not None:      # written whole; the handle is not kept (open handles at close, and
                # so the order HDF5 flushes metadata in, shape the bytes of a chunked file)
                self.file.create_dataset(kind, data=data, chunks=chunks, compression=compression)
                self.ds = None
            else:
                self.ds = self.file.create_dataset(kind, shape=(n,) + shape, dtype=np.uint8, chunks=chunks,
                                                   compression=compression)
        except BaseException:
            self.file.close()
            raise

    def write(self, start: int, samples: Any) -> None:
        """Rows ``start..start+len(samples)``: an array, or for ``encoded`` a sequence of bytes/uint8 arrays."""
        m = len(samples)
        if not m:
            return
        ds = self.ds
        if self.kind == "encoded":
            blobs = np.empty(m, dtype=object)   # one write call instead of one per sample
            for i, b in enumerate(samples):
                blobs[i] = b if isinstance(b, np.ndarray) else np.frombuffer(bytes(b), dtype=np.uint8)
            # low-level write: ds[...] = blobs would turn equal-length blobs into a 2-D array
            fspace = ds.id.get_space()
            fspace.select_hyperslab((start,), (m,))
            ds.id.write(h5py.h5s.create_simple((m,)), fspace, blobs, mtype=h5py.h5t.py_create(ds.dtype))
        else:
            ds[start:start + m] = samples

    def __enter__(self) -> "ShardFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                s = self.label_slice
                self.file.attrs.update({"format": FORMAT, "version": VERSION, "kind": self.kind,
                                        "shard_index": s.index, "num_shards": self.num_shards,
                                        "label_start": s.start, "label_end": s.end, "num_samples": self.n})
                if self.decoded_shape is not None:
                    self.file.attrs["sample_shape"] = np.asarray(list(self.decoded_shape), dtype=np.int64)
        finally:
            self.file.close()


def write_shard(path: str, kind: str, samples: Any, labels: np.ndarray, label_slice: LabelSlice,
                num_shards: int, compression: Optional[str] = None, chunk_samples: int = 0,
                sample_shape: Optional[Sequence[int]] = None) -> str:
    """Write one shard file in one go (`ShardFileWriter`) and return its sha256.

    ``samples`` is an array (images/features) or, for ``encoded``, a sequence of 1-D uint8 arrays/bytes;
    ``sample_shape``: the decoded shape of encoded samples (stored as an attribute).
    """
    if kind == "encoded":
        with ShardFileWriter(path, kind, labels, label_slice, num_shards, compression=compression,
                             chunk_samples=chunk_samples, decoded_shape=sample_shape) as w:
            w.write(0, samples)
    else:
        with ShardFileWriter(path, kind, labels, label_slice, num_shards, data=np.ascontiguousarray(samples),
                             compression=compression, chunk_samples=chunk_samples, decoded_shape=sample_shape):
            pass
    return sha256_file(path)


class AtomicShardDir:
    """Write a shard set (or any folder) into a temporary sibling folder and publish it as ``out`` on success
    (`hvd_partialfc.atomic.commit_folder`).

    An interrupted build leaves only a ``.tmp-*`` folder, removed on an exception (never a folder with a
    manifest at ``out``); a build over an existing ``out`` (``overwrite``) keeps the old set until the new
    one is in place, so a crash at any point leaves one complete set at ``out`` (after `recover_folder`,
    done here first). An existing ``out`` is an error unless ``overwrite``. The temporary name is unique
    (``mkdtemp``): two builds of one ``out`` never write into one folder, the last to finish wins.
    """

    def __init__(self, out: str, overwrite: bool = False):
        self.out = os.path.abspath(out)
        self.overwrite = overwrite
        self.tmp: Optional[str] = None

    def __enter__(self) -> str:
        recover_folder(self.out)
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
        if exc_type is None:
            try:
                commit_folder(self.tmp, self.out)
                return
            except BaseException:
                shutil.rmtree(self.tmp, ignore_errors=True)
                raise
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_manifest(shard_dir: str, manifest: Manifest) -> None:
    """Write the manifest of the shards in ``shard_dir`` (last: a set with a manifest is complete), with
    their ``class_identity`` (computed here from the files when the manifest has none)."""
    if not manifest.class_identity:
        manifest.class_identity = class_identity.of_shard_set(shard_dir, manifest)
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
