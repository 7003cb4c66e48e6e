"""Step 1 of a streaming build (`data_tools/stream.py`): the index, and its cache in the work folder.

``INDEXERS[fmt]`` (`index_recordio`, `index_list`, `index_imagefolder`) makes one pass over the labels
only, into numpy arrays: the dense class code of every sample (int32, classes sorted as
`data_tools.build.renumber` sorts them) and where its bytes are (RecordIO: int64 offset and key; files: a
UTF-8 path table, int64 end offsets). Bytes per sample: RecordIO 20, files 12 + the path length. No
Python object per sample: that is what bounds the memory of a build of tens of millions of samples.

The index is saved in the work folder (``index.npz``, keyed by the input files' paths, sizes and mtimes):
a restarted or later-starting part loads it instead of reading the source again.
"""
from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hvd_partialfc.atomic import atomic_file

from .stream_restart import INDEX_CACHE


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
    from .recordio_format import image_key_mask, read_index_arrays, rec_idx_paths, record_label_from
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


# --- the cache -------------------------------------------------------------------------------------------

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
    with atomic_file(os.path.join(folder, INDEX_CACHE)) as f:
        np.savez(f, meta=np.array(json.dumps(meta)), classes=np.array(index.classes, dtype=str), **arrays)

