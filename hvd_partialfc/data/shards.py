"""HDF5 shard sets: the on-disk format, and its reader (the writers are in `data_tools.shard_writer`).

A shard set is one directory::

    manifest.json
    shard-00000-of-00004.h5 ... shard-00003-of-00004.h5

Each shard holds the samples of one contiguous range ``[label_start, label_end)`` of global labels, so a
rank that owns a block of consecutive shards owns one contiguous label range (``layout.RankLayout``). Inside a
shard:

* ``labels``   int64 (N,), global labels, each in the shard's range;
* one sample dataset, by ``kind``:
  ``images``   uint8 (N, H, W) or (N, H, W, C)  (raw storage);
  ``encoded``  variable-length uint8 (N,), encoded JPEG/PNG bytes, decoded by the loader to the
  manifest's ``sample_shape`` (also the shard attribute ``sample_shape``);
  ``features`` float32 (N, F)  (feature vectors, for the ``mlp`` backbone);
* attributes repeating the manifest entry (format, version, shard index/count, label range, sample
  count, kind) so a lone file explains itself.

``manifest.json`` is written last, and a whole set is written into a temporary folder renamed at the end,
so a set that has a manifest is complete. `docs/data.md` (§1) is the human-readable spec of this module.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import h5py
import numpy as np

from .layout import RankLayout
from .partition import LabelSlice, check_partition

FORMAT = "hvd_partialfc.shards"
VERSION = 1
MANIFEST = "manifest.json"
SAMPLE_KINDS = ("images", "encoded", "features")


class ShardError(ValueError):
    """A shard set that is missing, corrupt, or does not fit the run (the message names the file)."""


def _rebuild_hint(shard_dir: str) -> str:
    """What to do about a damaged shard set, and the command that checks every file of it."""
    return (f"copy the set again or rebuild it with `hvd-partialfc-shards build`; "
            f"check it with `hvd-partialfc-shards inspect {shard_dir}`")


def _where(path: str, rank: Optional[int]) -> str:
    return f"rank {rank}: {path}" if rank is not None else path


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.h5"


@dataclass
class ShardEntry:
    """One shard as recorded in the manifest."""

    file: str
    label_start: int
    label_end: int
    num_samples: int
    sha256: str

    def label_slice(self, index: int) -> LabelSlice:
        return LabelSlice(index, self.label_start, self.label_end)


@dataclass
class Manifest:
    """The manifest of a shard set. ``sample_shape`` excludes the leading sample axis."""

    num_classes: int
    kind: str
    sample_shape: List[int]
    sample_dtype: str
    shards: List[ShardEntry]
    partition: Dict[str, Any] = field(default_factory=lambda: {"policy": "classes"})
    class_names: List[str] = field(default_factory=list)
    source: Dict[str, Any] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    class_identity: Dict[str, Any] = field(default_factory=dict)   # data.class_identity.of_shard_set
    format: str = FORMAT
    version: int = VERSION

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def shard_slices(self) -> List[LabelSlice]:
        return [s.label_slice(i) for i, s in enumerate(self.shards)]

    def to_json(self) -> Dict[str, Any]:
        d = {
            "format": self.format, "version": self.version, "num_classes": self.num_classes,
            "num_shards": self.num_shards, "num_samples": self.num_samples,
            "sample": {"kind": self.kind, "shape": list(self.sample_shape), "dtype": self.sample_dtype},
            "partition": self.partition,
            "shards": [vars(s) for s in self.shards],
            "class_names": self.class_names, "source": self.source, "skipped": self.skipped,
        }
        if self.class_identity:     # sets built before it have none: their manifest reads back unchanged
            d["class_identity"] = self.class_identity
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], where: str = MANIFEST) -> "Manifest":
        if not isinstance(d, dict):
            raise ShardError(f"{where}: not a hvd_partialfc shard manifest (a JSON {type(d).__name__}, "
                             f"not an object); {_rebuild_hint(os.path.dirname(where) or '.')}")
        try:
            if d.get("format") != FORMAT:
                raise ShardError(f"{where}: not a hvd_partialfc shard manifest (format={d.get('format')!r})")
            if d.get("version") != VERSION:
                raise ShardError(f"{where}: format version {d.get('version')} is not supported "
                                 f"(this hvd_partialfc reads version {VERSION})")
            m = cls(num_classes=int(d["num_classes"]), kind=d["sample"]["kind"],
                    sample_shape=list(d["sample"]["shape"]), sample_dtype=d["sample"]["dtype"],
                    shards=[ShardEntry(**s) for s in d["shards"]], partition=d.get("partition", {}),
                    class_names=list(d.get("class_names", [])), source=d.get("source", {}),
                    skipped=list(d.get("skipped", [])), class_identity=dict(d.get("class_identity", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ShardError(f"{where}: malformed manifest ({type(e).__name__}: {e}); "
                             f"{_rebuild_hint(os.path.dirname(where) or '.')}") from e
        if m.kind not in SAMPLE_KINDS:
            raise ShardError(f"{where}: unknown sample kind {m.kind!r} (known: {', '.join(SAMPLE_KINDS)})")
        try:
            check_partition(m.shard_slices(), m.num_classes)
        except ValueError as e:
            raise ShardError(f"{where}: shard label ranges are invalid: {e}") from e
        return m


def decode_image(blob: Any, shape: Optional[Sequence[int]] = None) -> np.ndarray:
    """Decode encoded bytes (JPEG/PNG; bytes or a uint8 array) to uint8 of ``shape`` (H, W) or (H, W, C).

    The one conversion used by the loader, the pair-set reader and the shard builder: grayscale for
    (H, W) or C = 1, RGB otherwise, bilinear resize when the size differs. Without ``shape``, the image's
    own size, as grayscale or RGB.
    """
    from PIL import Image
    img = Image.open(io.BytesIO(bytes(blob)))
    if not shape:
        return np.asarray(img if img.mode in ("L", "RGB") else img.convert("RGB"), dtype=np.uint8)
    img = img.convert("L" if len(shape) == 2 or shape[-1] == 1 else "RGB")
    if (img.height, img.width) != (shape[0], shape[1]):
        img = img.resize((shape[1], shape[0]), Image.BILINEAR)
    return np.asarray(img, dtype=np.uint8).reshape(shape)


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def feed_values(h: Any, block: np.ndarray, arrays: bool) -> None:
    """Feed ``block``'s values into ``h``, every byte of them. Fixed-size values: their bytes. Variable-length
    arrays (``arrays``; an encoded image is one): each one's byte count, then its bytes. Variable-length
    strings: the ``repr`` of their list, as digests recorded before kept them. Measured reason for the
    arrays' rule: the repr of a numpy array over 1,000 elements shows its first and last three, so that
    digest of an encoded sample saw three bytes at each end and its length, and two sets differing in the
    middle of every image had the same digest (tests/test_shards_data.py)."""
    if block.dtype.kind != "O":
        h.update(np.ascontiguousarray(block).tobytes())
    elif arrays:
        for value in block.reshape(-1):
            b = np.ascontiguousarray(value).tobytes()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    else:   # variable-length strings are object arrays: their values, not their pointers
        h.update(repr(block.tolist()).encode())


def is_vlen_array(dtype: np.dtype) -> bool:
    """Whether an HDF5 dataset of ``dtype`` holds variable-length arrays (not strings)."""
    base = h5py.check_vlen_dtype(dtype)
    return base is not None and base not in (str, bytes)


def sha256_content(path: str) -> str:
    """sha256 of what an HDF5 file holds, not of its bytes: every dataset's name, dtype, shape and values
    (``feed_values``: every byte), in name order. Measured reason: the same ``cjk-20k`` build on two fresh
    machines gave other file bytes (sha256_file) and the same samples (a study cell trained on each gave
    the same TAR to every digit; docs/evidence/data.md §4.1): the HDF5 writer's encoding may change between
    machines, the arrays do not."""
    h = hashlib.sha256()
    names: List[str] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in sorted(names):
            d = f[name]
            h.update(f"{name}|{d.dtype.str}|{d.shape}|".encode())
            arrays = is_vlen_array(d.dtype)
            step = max(1, (1 << 26) // max(1, d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))))
            if arrays:     # an itemsize is a pointer's: 1,024 samples a read, not 4 M (blocks change no digest)
                step = 1024
            for i in range(0, d.shape[0] if d.shape else 1, step):
                feed_values(h, np.asarray(d[i:i + step] if d.shape else d[()]), arrays)
    return h.hexdigest()


def manifest_digest(shard_dir: str) -> str:
    """sha256 of the manifest file, provenance included (``subset`` records its source set's)."""
    return sha256_file(os.path.join(shard_dir, MANIFEST))


# Manifest keys that say where a set came from, not what it holds: the input's path and the font files
# (`source`), the inputs the build could not read (`skipped`).
PROVENANCE_KEYS = ("source", "skipped")
# Manifest keys computed from the shard files, which their sha256 already cover: left out of the data digest
# with the provenance keys, so a set rebuilt with them still resumes the checkpoints of its build without.
DERIVED_KEYS = ("class_identity",)


def data_digest(manifest: Manifest) -> str:
    """sha256 of what a shard set holds, as its (already read) manifest records it: the sample spec, the
    class names and every shard's file, label range, sample count and byte sha256; the provenance and
    derived keys left out. Checkpoints record it and resume compares it. Reason: the manifest's bytes
    (`manifest_digest`) also changed when the same input was rebuilt from another folder
    (`source.path`), and such a set was refused on resume although every shard was byte-identical."""
    d = manifest.to_json()
    for k in PROVENANCE_KEYS + DERIVED_KEYS:
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, ensure_ascii=False,
                                     separators=(",", ":")).encode("utf-8")).hexdigest()


def read_manifest(shard_dir: str) -> Manifest:
    """The manifest of ``shard_dir``; a missing, unreadable or malformed one is a `ShardError` naming the
    file and what to do. No rank in the message: the trainer's agreement step adds it."""
    path = os.path.join(shard_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ShardError(f"{shard_dir}: no {MANIFEST} (not a shard set, or its build did not finish); "
                         f"give a folder written by `hvd-partialfc-shards build`")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:   # the builder writes it last, atomically
        raise ShardError(f"{path}: not valid JSON ({e}); the manifest was damaged after the build: "
                         f"{_rebuild_hint(shard_dir)}") from e
    return Manifest.from_json(d, where=path)


def open_shard(path: str, rank: Optional[int] = None) -> h5py.File:
    """Open one shard file read-only (usable as ``with open_shard(p) as f``).

    A missing, truncated or non-HDF5 file is a `ShardError` that names the rank (when given), the file
    and the command that checks the set: h5py's own message names neither, and a run of hundreds of
    ranks needs both to find the one bad file.
    """
    where, shard_dir = _where(path, rank), os.path.dirname(path) or "."
    if not os.path.isfile(path):
        raise ShardError(f"{where}: missing shard file; {_rebuild_hint(shard_dir)}")
    try:
        return h5py.File(path, "r")
    except OSError as e:
        raise ShardError(f"{where}: cannot open shard file (h5py: {e}); the file is truncated or not "
                         f"HDF5; {_rebuild_hint(shard_dir)}") from e


def unreadable_shard(path: str, what: str, err: BaseException, rank: Optional[int] = None) -> ShardError:
    """The error for a shard that opens but whose ``what`` ("labels", "samples", ...) cannot be read."""
    return ShardError(f"{_where(path, rank)}: cannot read its {what} ({type(err).__name__}: {err}); the file "
                      f"is damaged; {_rebuild_hint(os.path.dirname(path) or '.')}")


def read_shard_labels(path: str, rank: Optional[int] = None) -> np.ndarray:
    """The global labels (int64 (N,)) of one shard file, errors explained as in `open_shard`."""
    with open_shard(path, rank) as f:
        try:
            return f["labels"][:].astype(np.int64)
        except (KeyError, OSError) as e:
            raise unreadable_shard(path, "labels", e, rank) from e


def rank_layout(manifest: Manifest, world_size: int):
    """The shard set's ``layout.RankLayout`` on ``world_size`` ranks (any 1 <= N <= S; uneven blocks are
    balanced by the manifest's per-shard ``num_samples``); ShardError when it does not fit."""
    try:
        return RankLayout.from_manifest(manifest, world_size)
    except ValueError as e:
        raise ShardError(str(e)) from e


def check_shard_file(shard_dir: str, manifest: Manifest, index: int, verify_sha256: bool = False) -> None:
    """Validate one shard against its manifest entry: attributes, sizes, label range of every label."""
    entry = manifest.shards[index]
    path = os.path.join(shard_dir, entry.file)
    labels = read_shard_labels(path)    # a missing, truncated or non-HDF5 file fails here, named
    if verify_sha256:
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ShardError(f"{path}: sha256 {digest[:12]}… does not match the manifest's {entry.sha256[:12]}…")
    with open_shard(path) as f:
        if manifest.kind not in f:
            raise ShardError(f"{path}: no '{manifest.kind}' dataset")
        n = f[manifest.kind].shape[0]
    if len(labels) != entry.num_samples or n != entry.num_samples:
        raise ShardError(f"{path}: {len(labels)} labels / {n} samples, manifest says {entry.num_samples}")
    bad = (labels < entry.label_start) | (labels >= entry.label_end)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ShardError(f"{path}: sample {i} has label {int(labels[i])} outside the shard's range "
                         f"[{entry.label_start}, {entry.label_end}) ({int(bad.sum())} such samples)")
