"""Streaming shard builds: bounded memory, restartable, in parallel parts (issue 16).

Used by ``build`` for the sources whose samples live in files (``recordio``, ``list``, ``imagefolder``).
Three steps:

1. **Index** (`index_source`): one pass over the labels only, into numpy arrays: the dense class code of
   every sample (int32, classes sorted as `build.renumber` sorts them) and where its bytes are (RecordIO:
   int64 offset and key; files: a UTF-8 path table, int64 end offsets). Bytes per sample: RecordIO 20,
   files 12 + the path length. No Python object per sample.
2. **Plan** (`make_plan`): the held-out split, renumbering and partition (`--balance`) from the codes
   alone, exactly as the in-memory path computes them; a stable argsort groups the samples by shard in
   input order (8 more bytes per sample).
3. **Write**: every shard of this part (``--part K/M``: work items ``K-1, K-1+M, ...``) is read by worker
   processes in blocks of `block_samples` samples, decoded (``--store raw``) or checked (``encoded``), and
   written block by block into the shard's HDF5 file; at most ``2 * workers + 2`` blocks are in flight,
   so the memory is the index plus a few blocks, whatever the sample count.

Restart: shards go into ``.tmp-NAME-resumable`` beside ``OUT`` (and beside the held-out set), each file
written atomically (`hvd_partialfc.atomic.atomic_path`) and followed by a ``*.done.json`` record (size,
sha256, samples, skipped). A re-run checks the record's size and sha256 against the file and writes only
what is missing; ``fingerprint.json`` (options + the index digest + sizes/mtimes of the container files)
tells a changed input or option, which is refused. The part that completes the last shard does not
assemble: ``build`` without parts (1/1) or ``hvd-partialfc-shards assemble OUT`` writes the manifests and
renames the folders into place. Shard bytes do not depend on the workers, the part or a restart: block
boundaries depend only on the sample shape, and h5py stores no timestamps.

Difference from the in-memory path (npz, fonts): with ``--on-error skip`` the partition is computed
before decoding, so a skipped sample still counts in ``--balance samples``; a shard that loses samples is
rewritten without them (one extra copy of that shard).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import h5py
import numpy as np

from hvd_partialfc.atomic import atomic_path, fsync_dir, write_text
from hvd_partialfc.shards import (FORMAT, VERSION, Manifest, ShardEntry, ShardError, decode_image, sha256_file,
                                  shard_name)

from .shard_writer import write_manifest

PLAN = "plan.json"
FINGERPRINT = "fingerprint.json"
INDEX_CACHE = "index.npz"
DONE = ".done.json"
BLOCK_BYTES = 4 << 20          # decoded bytes per block (raw): bounds memory per block in flight


def resumable_dir(out: str) -> str:
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".tmp-{os.path.basename(out)}-resumable")


# --- 1. the index ------------------------------------------------------------------------------------------

@dataclass
class SampleIndex:
    """Where every sample is and its class, as arrays (see the module docstring for bytes/sample)."""

    codes: np.ndarray                      # int32 (N,): index into ``classes``
    classes: List[str]                     # sorted original identities, as strings (manifest class names)
    source: Dict[str, Any]
    rec_path: Optional[str] = None         # recordio
    offsets: Optional[np.ndarray] = None   # int64 (N,)
    keys: Optional[np.ndarray] = None      # int64 (N,)
    path_blob: Optional[np.ndarray] = None  # uint8: concatenated UTF-8 paths (files)
    path_ends: Optional[np.ndarray] = None  # int64 (N,)
    inputs: List[str] = field(default_factory=list)   # container files whose size/mtime the fingerprint records

    def __len__(self) -> int:
        return len(self.codes)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.offsets, self.keys, self.path_blob, self.path_ends)
                   if a is not None)

    def path(self, i: int) -> str:
        start = int(self.path_ends[i - 1]) if i else 0
        return self.path_blob[start:int(self.path_ends[i])].tobytes().decode("utf-8", "surrogateescape")

    def describe(self, i: int) -> str:
        return f"{self.rec_path}#{int(self.keys[i])}" if self.rec_path else self.path(i)

    def digest(self) -> str:
        h = hashlib.sha256()
        for a in (self.codes, self.offsets, self.keys, self.path_blob, self.path_ends):
            if a is not None:           # the buffer itself: tobytes() would copy each array
                h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
        h.update(json.dumps(self.classes).encode())
        return h.hexdigest()


class _Paths:
    """A growing path table: UTF-8 bytes + end offsets (no Python string kept per sample)."""

    def __init__(self):
        self.blob, self.ends, self.n = bytearray(), array("q"), 0

    def add(self, path: str) -> None:
        self.blob += path.encode("utf-8", "surrogateescape")
        self.ends.append(len(self.blob))

    def arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(bytes(self.blob), np.uint8), np.frombuffer(self.ends, np.int64).copy()


def _sorted_classes(first_seen: List[Any], codes: array) -> Tuple[np.ndarray, List[str]]:
    """Re-code first-seen codes into sorted-identity codes (as `build.renumber`: np.unique's order).
    ``first_seen[c]`` is the identity of code c; equal identities (labels "1" and "01" read as
    integers) become one class, as in the in-memory path."""
    if not first_seen:
        return np.zeros(0, np.int32), []
    names, remap = np.unique(np.asarray(first_seen), return_inverse=True)
    c = np.frombuffer(codes, np.int32)
    return remap.reshape(-1).astype(np.int32)[c], [str(n) for n in names.tolist()]


def index_recordio(prefix: str) -> SampleIndex:
    from .recordio import image_key_mask, read_index_arrays, rec_idx_paths, record_label_from
    rec, idx = rec_idx_paths(prefix)
    keys, offsets = read_index_arrays(idx)
    n_records = len(keys)
    mask = image_key_mask(rec, keys, offsets)
    if not mask.all():
        keys, offsets = keys[mask], offsets[mask]
    del mask
    labels = np.empty(len(keys), np.float32)          # IRHeader labels are float32
    with open(rec, "rb", buffering=1 << 16) as f:
        for a in range(0, len(offsets), 1 << 16):     # .tolist() of all offsets: 36 bytes/sample of ints
            for i, off in enumerate(offsets[a:a + (1 << 16)].tolist(), a):
                labels[i] = record_label_from(f, rec, off)
    # Checked, converted to int32 and renumbered in place (the float32 buffer viewed as int32), 1M
    # at a time: whole-array temporaries cost ~13 bytes/sample of the peak (measured at 5M samples).
    codes = labels.view(np.int32)
    top = -1
    for a in range(0, len(labels), 1 << 20):
        chunk = labels[a:a + (1 << 20)].copy()
        bad = (chunk != np.floor(chunk)) | (chunk < 0)
        if bad.any():
            i = a + int(np.flatnonzero(bad)[0])
            raise ValueError(f"{rec}: record {int(keys[i])} has label {chunk[i - a]}, expected a non-negative "
                             f"integer class id")
        codes[a:a + len(chunk)] = chunk.astype(np.int32)
        top = max(top, int(chunk.max()) if len(chunk) else -1)
    # Renumbering through a presence table (np.unique(return_inverse) sorts: 24 bytes/sample), unless
    # the ids are so sparse that the table would outweigh that.
    if top + 1 > 4 * len(codes) + (1 << 24):
        names, inverse = np.unique(codes, return_inverse=True)
        codes[:] = inverse.reshape(-1)
    else:
        present = np.zeros(top + 1, bool)
        for a in range(0, len(codes), 1 << 20):
            present[codes[a:a + (1 << 20)]] = True
        remap = (np.cumsum(present, dtype=np.int64) - 1).astype(np.int32)
        for a in range(0, len(codes), 1 << 20):
            codes[a:a + (1 << 20)] = remap[codes[a:a + (1 << 20)]]
        names = np.flatnonzero(present)
    src = {"format": "recordio", "path": os.path.abspath(rec), "records": int(n_records),
           "images": int(len(keys))}
    return SampleIndex(codes, [str(n) for n in names.tolist()], src, rec_path=rec,
                       offsets=offsets, keys=keys, inputs=[rec, idx])


def index_list(path: str) -> SampleIndex:
    from .importers.listfile import iter_list
    paths, codes, seen = _Paths(), array("i"), {}
    for file, label in iter_list(path):
        paths.add(file)
        codes.append(seen.setdefault(label, len(seen)))
    # Integer labels sort numerically (as the in-memory importer does); other labels sort as names.
    idents: List[Any] = list(seen)           # in code order (dicts keep insertion order)
    if idents and all(l.lstrip("-").isdigit() for l in idents):
        idents = [int(l) for l in idents]
    dense, names = _sorted_classes(idents, codes)
    blob, ends = paths.arrays()
    return SampleIndex(dense, names, {"format": "list", "path": os.path.abspath(path)}, path_blob=blob,
                       path_ends=ends, inputs=[path])


def index_imagefolder(path: str) -> SampleIndex:
    from .importers.imagefolder import IMAGE_EXTENSIONS
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a folder (imagefolder expects DIR/CLASS/IMAGE files)")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and not d.startswith("."))
    if not classes:
        raise ValueError(f"{path}: no class subfolders (imagefolder expects DIR/CLASS/IMAGE files)")
    paths, codes = _Paths(), array("i")
    for ci, c in enumerate(classes):
        found = 0
        for root, dirs, files in os.walk(os.path.join(path, c), followlinks=True):
            dirs.sort()
            for name in sorted(files):
                if name.lower().endswith(IMAGE_EXTENSIONS):
                    paths.add(os.path.join(root, name))
                    codes.append(ci)
                    found += 1
        if not found:
            raise ValueError(f"{path}: class folder {c!r} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    blob, ends = paths.arrays()
    return SampleIndex(np.frombuffer(codes, np.int32).copy(), classes,
                       {"format": "imagefolder", "path": os.path.abspath(path)}, path_blob=blob, path_ends=ends)


INDEXERS = {"recordio": index_recordio, "list": index_list, "imagefolder": index_imagefolder}


def _inputs_key(fmt: str, source: str, inputs: List[str]) -> str:
    return json.dumps([fmt, os.path.abspath(source)] + [[os.path.abspath(p), os.stat(p).st_size,
                                                          os.stat(p).st_mtime_ns] for p in inputs])


def load_index_cache(folder: str, fmt: str, source: str) -> Optional[SampleIndex]:
    """The index a previous part or run of this build saved, if its input files (path, size, mtime)
    are unchanged: a restarted or later-starting part skips the index pass (for WebFace42M ~100 s with
    the ``.rec`` cached, about a full read of it when not). ImageFolder is never cached (its listing is
    the input)."""
    path = os.path.join(folder, INDEX_CACHE)
    if fmt == "imagefolder" or not os.path.isfile(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta["key"] != _inputs_key(fmt, source, meta["inputs"]):
                return None
            arrays = {k: z[k] for k in ("codes", "offsets", "keys", "path_blob", "path_ends") if k in z.files}
            classes = [str(c) for c in z["classes"].tolist()]
    except (OSError, ValueError, KeyError):       # a damaged cache is recomputed
        return None
    return SampleIndex(classes=classes, source=meta["source"], rec_path=meta["rec_path"], inputs=meta["inputs"],
                       **arrays)


def save_index_cache(folder: str, fmt: str, source: str, index: SampleIndex) -> None:
    if fmt == "imagefolder":
        return
    meta = {"key": _inputs_key(fmt, source, index.inputs), "inputs": index.inputs, "source": index.source,
            "rec_path": index.rec_path}
    arrays = {k: getattr(index, k) for k in ("codes", "offsets", "keys", "path_blob", "path_ends")
              if getattr(index, k) is not None}
    with atomic_path(os.path.join(folder, INDEX_CACHE)) as tmp, open(tmp, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), classes=np.array(index.classes, dtype=str), **arrays)


# --- reading one sample (in the worker processes) ---------------------------------------------------------

_READER: Dict[str, Any] = {}          # set before the pool forks: index, store, shape; the open .rec per process


def _read_bytes(i: int) -> bytes:
    index: SampleIndex = _READER["index"]
    if index.rec_path:
        from .recordio import read_record, unpack_image
        f = _READER.get("rec_file")
        if f is None or _READER.get("rec_pid") != os.getpid():
            f = _READER["rec_file"] = open(index.rec_path, "rb")
            _READER["rec_pid"] = os.getpid()
        return unpack_image(read_record(f, index.rec_path, int(index.offsets[i])))[1]
    with open(index.path(i), "rb") as f:
        return f.read()


def _load_block(rows: np.ndarray) -> Tuple[List[Optional[str]], Any]:
    """(per row: None or the error, samples): a uint8 block (raw) or a list of bytes (encoded)."""
    store, shape = _READER["store"], tuple(_READER["shape"])
    errors: List[Optional[str]] = []
    out = np.zeros((len(rows),) + shape, np.uint8) if store == "raw" else []
    check = _READER.get("check", True)
    for j, i in enumerate(rows.tolist()):
        try:
            blob = _read_bytes(i)
            if store == "raw":
                out[j] = decode_image(blob, shape)
            else:
                if check:           # pass-through without it: the build is bounded by the disk, not the CPU
                    decode_image(blob, shape)
                out.append(blob)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - any failure to read/decode one image is reported per image
            errors.append(f"{type(e).__name__}: {e}")
            if store != "raw":
                out.append(b"")
    return errors, out


def probe_sample_shape(index: SampleIndex, size: Optional[Sequence[int]], color: Optional[str]) -> List[int]:
    """The in-memory build's rule (`storage.sample_shape`), on the index."""
    from .storage import sample_shape
    return sample_shape(_read_bytes, len(index), index.describe, size, color)


# --- 2. the plan ---------------------------------------------------------------------------------------------

def make_plan(index: SampleIndex, opts, shape: List[int]) -> Tuple[Dict[str, Any], np.ndarray, np.ndarray]:
    """(plan, labels int32 (N,): global label in its set, item int32 (N,): work item of each sample).

    A work item's rows are found when it is written (`np.flatnonzero(item == j)`, input order): one
    scan of 4 bytes/sample per shard instead of an argsort kept for the whole build (8 bytes/sample,
    and its workspace: together ~20 bytes/sample of the peak, measured at 5M samples).

    The plan (JSON) holds what the manifests need; work item j is shard j of the training set for
    j < num_shards, then the held-out set's shards.
    """
    from .build import partition_counts
    n_cls = len(index.classes)
    if len(index) == 0:
        raise ShardError("no classes: the source holds no samples")
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


# --- 3. writing ----------------------------------------------------------------------------------------------

def _create(f: h5py.File, kind: str, n: int, shape: Sequence[int], compression, chunk_samples: int):
    if kind == "encoded":
        return f.create_dataset("encoded", shape=(n,), dtype=h5py.vlen_dtype(np.uint8),
                                chunks=(max(1, min(n, chunk_samples)),) if n and chunk_samples else None)
    contiguous = not n or (not chunk_samples and compression is None)
    chunks = None if contiguous else (max(1, min(n, chunk_samples or 64)),) + tuple(shape)
    return f.create_dataset(kind, shape=(n,) + tuple(shape), dtype=np.uint8, chunks=chunks,
                            compression=compression)


def _write_rows(ds, kind: str, start: int, samples) -> None:
    m = len(samples)
    if not m:
        return
    if kind == "encoded":       # low-level write, as data_tools.shard_writer.write_shard
        blobs = np.empty(m, dtype=object)
        for i, b in enumerate(samples):
            blobs[i] = b if isinstance(b, np.ndarray) else np.frombuffer(bytes(b), dtype=np.uint8)
        fspace = ds.id.get_space()
        fspace.select_hyperslab((start,), (m,))
        ds.id.write(h5py.h5s.create_simple((m,)), fspace, blobs, mtype=h5py.h5t.py_create(ds.dtype))
    else:
        ds[start:start + m] = samples


def _attrs(f: h5py.File, kind: str, it: Dict, num_shards: int, n: int, shape) -> None:
    f.attrs.update({"format": FORMAT, "version": VERSION, "kind": kind, "shard_index": it["index"],
                    "num_shards": num_shards, "label_start": it["label_start"], "label_end": it["label_end"],
                    "num_samples": n})
    if kind == "encoded":
        f.attrs["sample_shape"] = np.asarray(list(shape), dtype=np.int64)


def _write_item(path: str, plan: Dict, it: Dict, labels: np.ndarray, rows: np.ndarray, blocks: Iterator,
                index: SampleIndex, opts) -> Dict[str, Any]:
    """Write one shard from its blocks; returns its done record. ``rows``: sample numbers, input order."""
    kind, shape = plan["kind"], plan["sample_shape"]
    num_shards = plan["sets"][it["set"]]["num_shards"]
    n, bs = len(rows), plan["block_samples"]
    skipped: List[str] = []
    bad = np.zeros(n, bool)
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w", libver="latest") as f:
            f.create_dataset("labels", data=labels.astype(np.int64))
            ds = _create(f, kind, n, shape, opts.compression, opts.chunk_samples)
            for a in range(0, n, bs):
                errors, samples = next(blocks)
                for j, e in enumerate(errors):
                    if e is None:
                        continue
                    where = index.describe(int(rows[a + j]))
                    if opts.on_error == "fail":
                        raise ShardError(f"cannot read {where} ({e}); pass --on-error skip to drop unreadable "
                                         f"images")
                    skipped.append(f"{where}: {e}")
                    bad[a + j] = True
                _write_rows(ds, kind, a, samples)
            _attrs(f, kind, it, num_shards, n, shape)
        if bad.any():
            _compact(tmp, plan, it, labels, bad, opts)
    keep = labels[~bad]
    present = np.unique(keep)
    if len(present) != it["label_end"] - it["label_start"]:
        missing = sorted(set(range(it["label_start"], it["label_end"])) - set(present.tolist()))
        names = plan["sets"][it["set"]]["class_names"]
        os.unlink(path)
        raise ShardError(f"class {names[missing[0]]!r} is empty ({len(missing)} empty classes in "
                         f"{it['file']}; every sample was unreadable and skipped): fix or remove them")
    return {"file": it["file"], "size": os.path.getsize(path), "sha256": sha256_file(path),
            "num_samples": int(len(keep)), "skipped": skipped}


def _compact(tmp: str, plan: Dict, it: Dict, labels: np.ndarray, bad: np.ndarray, opts) -> None:
    """Rewrite ``tmp`` without the skipped rows, block by block (contiguous datasets cannot shrink)."""
    kind, shape, bs = plan["kind"], plan["sample_shape"], plan["block_samples"]
    keep = np.flatnonzero(~bad)
    other = tmp + ".compact"
    with h5py.File(tmp, "r") as src, h5py.File(other, "w", libver="latest") as f:
        f.create_dataset("labels", data=labels[keep].astype(np.int64))
        ds = _create(f, kind, len(keep), shape, opts.compression, opts.chunk_samples)
        for a in range(0, len(keep), bs):
            sel = keep[a:a + bs]
            _write_rows(ds, kind, a, [src[kind][int(i)] for i in sel] if kind == "encoded" else src[kind][sel])
        _attrs(f, kind, it, plan["sets"][it["set"]]["num_shards"], len(keep), shape)
    os.replace(other, tmp)


def _blocks(jobs: Iterator[np.ndarray], workers: int) -> Iterator:
    """Results of `_load_block` for ``jobs`` in order, at most ``2 * workers + 2`` in flight."""
    if workers <= 1:
        for rows in jobs:
            yield _load_block(rows)
        return
    with mp.get_context("fork").Pool(workers) as pool:
        pending: deque = deque()
        it = iter(jobs)
        for rows in it:
            pending.append(pool.apply_async(_load_block, (rows,)))
            if len(pending) >= 2 * workers + 2:
                break
        while pending:
            yield pending.popleft().get()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.apply_async(_load_block, (nxt,)))


def fingerprint(index: SampleIndex, opts, shape: List[int]) -> Dict[str, Any]:
    files = []
    for p in index.inputs:
        st = os.stat(p)
        files.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    options = {k: getattr(opts, k) for k in ("num_shards", "balance", "store", "size", "color", "on_error", "seed",
                                             "holdout", "holdout_shards", "compression", "chunk_samples")}
    options["check"] = bool(getattr(opts, "check", True)) or opts.store == "raw"   # raw always decodes
    options["holdout_out"] = os.path.abspath(opts.holdout_out) if opts.holdout else None
    return {"format": FORMAT + ".build", "options": options, "sample_shape": shape, "source": index.source,
            "index_sha256": index.digest(), "files": files}


def _check_fingerprint(folder: str, fp: Dict[str, Any], out: str) -> None:
    path = os.path.join(folder, FINGERPRINT)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != fp:
            what = [k for k in fp if old.get(k) != fp[k]]
            if "options" in what:
                what = [f"option {k}" for k in fp["options"] if old.get("options", {}).get(k) != fp["options"][k]] \
                    + [w for w in what if w != "options"]
            raise ShardError(f"{out}: an unfinished build in {folder} used other inputs or options "
                             f"({', '.join(what)} differ); re-run it with the same command, or pass --overwrite "
                             f"to start afresh")
    else:
        os.makedirs(folder, exist_ok=True)
        write_text(path, json.dumps(fp, indent=1, sort_keys=True))


def _done(folder: str, it: Dict, verify: bool = True) -> Optional[Dict[str, Any]]:
    """The done record of a finished shard whose file still matches it (size, and sha256 if ``verify``)."""
    rec, path = os.path.join(folder, it["file"] + DONE), os.path.join(folder, it["file"])
    if not (os.path.isfile(rec) and os.path.isfile(path)):
        return None
    with open(rec, encoding="utf-8") as f:
        done = json.load(f)
    if os.path.getsize(path) != done["size"] or (verify and sha256_file(path) != done["sha256"]):
        return None
    return done


def _remove_partial(folder: str, file: str) -> None:
    """Remove ``atomic_path``'s temporary files of ``file`` (``.FILE.tmp-PID``) left by a killed build."""
    for name in os.listdir(folder):
        if name.startswith(f".{file}.tmp-"):
            os.unlink(os.path.join(folder, name))


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


def build_streaming(fmt: str, source: str, opts, part: Tuple[int, int] = (1, 1)) -> Dict[str, Any]:
    """Index, plan, write this part's missing shards; with part 1/1, assemble. Returns a summary."""
    k, m = part
    if opts.holdout and not opts.holdout_out:
        opts.holdout_out = opts.out.rstrip("/") + "-holdout"
    outs = [opts.out] + ([opts.holdout_out] if opts.holdout else [])
    if opts.overwrite and m > 1:
        raise ShardError("--overwrite with --part M > 1 would let one part delete what another wrote; remove "
                         f"{', '.join(outs)} and {', '.join(resumable_dir(o) for o in outs)} first")
    for path in outs:
        if os.path.exists(path) and not opts.overwrite:
            raise ShardError(f"{os.path.abspath(path)} already exists (pass --overwrite to replace it)")
    if opts.overwrite:
        for path in outs:
            shutil.rmtree(resumable_dir(path), ignore_errors=True)
    t0 = time.perf_counter()
    index = load_index_cache(resumable_dir(opts.out), fmt, source)
    cached = index is not None
    if index is None:
        index = INDEXERS[fmt](source)
    if len(index) == 0:
        raise ShardError("no classes: the source holds no samples")
    _READER.clear()
    _READER.update(index=index)
    shape = probe_sample_shape(index, opts.size, opts.color)
    _READER.update(store=opts.store, shape=shape, check=getattr(opts, "check", True))
    plan, labels, item = make_plan(index, opts, shape)
    t_index = time.perf_counter() - t0
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    fp = fingerprint(index, opts, shape)
    for folder in folders:
        _check_fingerprint(folder, fp, opts.out)
    if not cached:
        save_index_cache(folders[0], fmt, source, index)
    write_text(os.path.join(folders[0], PLAN), json.dumps(plan, ensure_ascii=False))
    mine = [j for j in range(len(plan["items"])) if j % m == k - 1]
    todo = [j for j in mine if _done(folders[plan["items"][j]["set"]], plan["items"][j]) is None]
    for j in todo:       # a killed writer's temporary file (only this part's shards: parts may run at once)
        _remove_partial(folders[plan["items"][j]["set"]], plan["items"][j]["file"])
    bs = plan["block_samples"]

    def jobs() -> Iterator[np.ndarray]:      # runs ahead of the writer by the blocks in flight
        for j in todo:
            rows = np.flatnonzero(item == j)
            for a in range(0, len(rows), bs):
                yield rows[a:a + bs]

    blocks = _blocks(jobs(), opts.workers)
    written = 0
    from tqdm import tqdm
    bar = tqdm(total=sum(plan["items"][j]["num_samples"] for j in todo), desc=f"part {k}/{m}", unit="sample",
               disable=not opts.progress, dynamic_ncols=True, mininterval=1.0)
    try:
        for j in todo:
            it = plan["items"][j]
            rows = np.flatnonzero(item == j)      # again (a scan of ~5 ms per 1M samples): no shared state
            folder = folders[it["set"]]
            done = _write_item(os.path.join(folder, it["file"]), plan, it, labels[rows], rows, blocks, index, opts)
            write_text(os.path.join(folder, it["file"] + DONE), json.dumps(done))
            written += done["num_samples"]
            bar.update(it["num_samples"])
    finally:
        blocks.close()
        bar.close()
    seconds = time.perf_counter() - t0
    summary = {"part": part, "index_cached": cached, "shards_written": len(todo), "shards_resumed": len(mine) - len(todo),
               "seconds": seconds, "index_seconds": t_index, "index_bytes": index.nbytes(),
               "index_bytes_per_sample": index.nbytes() / len(index), "samples_written": written,
               "samples_per_s": written / seconds if seconds else float("inf"), "manifest": None, "holdout": None}
    if m == 1:
        summary.update(assemble(opts.out))
    return summary


def assemble(out: str) -> Dict[str, Any]:
    """Write the manifests of a build whose shards are all done (by any parts) and move the sets into
    place (the held-out set first, as the in-memory path). Checks every shard's size against its record."""
    folder = resumable_dir(out)
    plan_path = os.path.join(folder, PLAN)
    if not os.path.isfile(plan_path):
        raise ShardError(f"{out}: no unfinished build to assemble ({plan_path} is missing)")
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    dones = [_done(folders[it["set"]], it, verify=False) for it in plan["items"]]
    missing = [it["file"] for it, d in zip(plan["items"], dones) if d is None]
    if missing:
        raise ShardError(f"{out}: {len(missing)} shards are not written yet ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}); run the missing parts of the build first")
    manifests = []
    for s, (st, folder) in enumerate(zip(plan["sets"], folders)):
        entries, skipped = [], []
        for it, d in zip(plan["items"], dones):
            if it["set"] == s:
                entries.append(ShardEntry(it["file"], it["label_start"], it["label_end"], d["num_samples"],
                                          d["sha256"]))
                skipped += d["skipped"]
        manifests.append(Manifest(num_classes=st["num_classes"], kind=plan["kind"], sample_shape=plan["sample_shape"],
                                  sample_dtype="uint8", shards=entries, partition=st["partition"],
                                  class_names=st["class_names"], source=st["source"], skipped=skipped))
    for s in reversed(range(len(plan["sets"]))):       # held-out set first
        folder, target = folders[s], plan["sets"][s]["out"]
        for name in os.listdir(folder):
            if name.endswith(DONE) or name in (PLAN, FINGERPRINT, INDEX_CACHE) or ".tmp-" in name:
                os.unlink(os.path.join(folder, name))
        write_manifest(folder, manifests[s])
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(folder, target)
        fsync_dir(os.path.dirname(target))
    return {"manifest": manifests[0], "holdout": manifests[1] if len(manifests) > 1 else None}
