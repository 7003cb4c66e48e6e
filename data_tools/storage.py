"""Turning imported samples into what a shard stores: decoding, encoding, checking, in a process pool.

Importers of image files do not read pixels themselves: they return *references* (`FileRef`, a path; or
`RecordRef`, a byte range of a RecordIO file). `to_storage` then reads every reference in worker processes
and, per ``--store``:

* ``raw``:     decodes to uint8 of one ``sample_shape`` (H, W) or (H, W, C) (converted and resized with
  bilinear filtering, exactly as the loader's `hvd_partialfc.data.shards.decode_image` does for encoded samples);
* ``encoded``: keeps the original bytes, after checking that they decode (an unreadable file is found at
  build time, not in the middle of training); in-memory images (fonts, npz) are PNG-encoded.

Results come back in input order (``Pool.imap``), so the output does not depend on the number of workers.
An unreadable sample raises (``on_error="fail"``, the message names it) or is dropped and listed
(``on_error="skip"``). Everything is held in memory until the shards are written: this is the path of the
in-memory sources (npz, fonts) and of `data_tools.build.build`; the CLI builds recordio, list and
imagefolder sources with `data_tools.stream` instead (bounded memory, restartable, parts; docs/data.md §6).
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from hvd_partialfc.data.shards import ShardError, decode_image

from .imported import ImportedData


@dataclass(frozen=True)
class FileRef:
    """An encoded image in its own file."""

    path: str

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True)
class RecordRef:
    """The image bytes of one RecordIO record (``offset`` is the record's start, from the .idx file)."""

    path: str
    offset: int
    key: int

    def read(self) -> bytes:
        from .recordio_format import read_record_at, unpack_image
        return unpack_image(read_record_at(self.path, self.offset))[1]

    def __str__(self) -> str:
        return f"{self.path}#{self.key}"


def read_ref(ref: Any) -> bytes:
    return bytes(ref) if isinstance(ref, (bytes, bytearray, memoryview)) else ref.read()


def describe_ref(ref: Any, i: int) -> str:
    return f"sample {i}" if isinstance(ref, (bytes, bytearray, memoryview)) else str(ref)


# --- decoding / encoding -------------------------------------------------------------------------------

def probe_shape(blob: bytes) -> List[int]:
    """The decoded shape of an image: (H, W) for grayscale, (H, W, 3) otherwise."""
    from PIL import Image
    img = Image.open(io.BytesIO(blob))
    return [img.height, img.width] if img.mode in ("L", "1", "I;16", "I", "F") else [img.height, img.width, 3]


def encode_png(arr: np.ndarray) -> bytes:
    """Lossless PNG bytes of a uint8 (H, W) or (H, W, 3) array; deterministic for a given Pillow."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


# --- the process pool ------------------------------------------------------------------------------------

def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def pmap(fn: Callable, items: Sequence, workers: int, desc: str, chunksize: int = 0,
         progress: bool = True) -> Iterable:
    """``map(fn, items)`` in input order, over ``workers`` forked processes (inline when workers <= 1),
    with a tqdm bar. ``fn`` must be a module-level function (it is pickled by name)."""
    from tqdm import tqdm
    bar = tqdm(total=len(items), desc=desc, unit="it", disable=not progress, dynamic_ncols=True,
               mininterval=1.0)
    if workers <= 1 or len(items) <= 1:
        for x in items:
            yield fn(x)
            bar.update()
        bar.close()
        return
    chunksize = chunksize or max(1, min(256, len(items) // (workers * 8) or 1))
    # fork: workers inherit the imported modules, nothing to re-import; data_tools never imports torch.
    with mp.get_context("fork").Pool(workers) as pool:
        for y in pool.imap(fn, items, chunksize=chunksize):
            yield y
            bar.update()
    bar.close()


def _convert(task: Tuple[Any, str, Optional[Tuple[int, ...]]]) -> Tuple[bool, Any]:
    ref, store, shape = task
    try:
        if isinstance(ref, np.ndarray):                    # an in-memory image to encode
            return True, encode_png(ref)
        blob = read_ref(ref)
        if store == "raw":
            return True, decode_image(blob, shape)
        decode_image(blob, shape)                          # check that it decodes; keep the original bytes
        return True, blob
    except Exception as e:  # noqa: BLE001 - any failure to read/decode one image is reported per image
        return False, f"{type(e).__name__}: {e}"


def to_storage(data: ImportedData, store: str, size: Optional[Sequence[int]] = None, color: Optional[str] = None,
               on_error: str = "fail", workers: int = 1, progress: bool = True):
    """Return a copy of ``data`` (an `ImportedData`) whose samples are what the shards will store.

    ``size`` (H, W) and ``color`` ("gray"/"rgb") fix ``sample_shape`` for image references; by default it is
    the decoded shape of the first readable reference.
    """
    if store not in ("raw", "encoded"):
        raise ValueError(f"unknown storage {store!r}; known: raw, encoded")
    if on_error not in ("fail", "skip"):
        raise ValueError(f"unknown --on-error {on_error!r}; known: fail, skip")
    kind, samples = data.kind, data.samples
    if kind == "features":
        if store == "encoded":
            raise ValueError("feature vectors cannot be stored encoded; use --store raw")
        return data
    if kind == "images":
        arr = np.asarray(samples)
        if store == "raw":
            return data
        blobs = [b for _, b in pmap(_convert, [(a, store, None) for a in arr], workers, "encode")]
        return ImportedData("encoded", blobs, data.labels, data.source, list(data.skipped),
                            list(arr.shape[1:]), data.classes)
    if kind != "refs":
        raise ValueError(f"unknown imported kind {kind!r}")
    shape = _sample_shape(samples, size, color)
    results = pmap(_convert, [(r, store, tuple(shape)) for r in samples], workers,
                   "decode" if store == "raw" else "check", progress=progress)
    keep, out, skipped = [], [], list(data.skipped)
    for i, (ok, value) in enumerate(results):
        if ok:
            keep.append(i)
            out.append(value)
        elif on_error == "fail":
            raise ShardError(f"cannot read {describe_ref(samples[i], i)} ({value}); "
                             f"pass --on-error skip to drop unreadable images")
        else:
            skipped.append(f"{describe_ref(samples[i], i)}: {value}")
    labels = [data.labels[i] for i in keep]
    if store == "raw":
        arr = np.stack(out) if out else np.zeros([0] + shape, np.uint8)
        return ImportedData("images", arr, labels, data.source, skipped, shape, data.classes)
    return ImportedData("encoded", out, labels, data.source, skipped, shape, data.classes)


def _sample_shape(refs: Sequence[Any], size: Optional[Sequence[int]], color: Optional[str]) -> List[int]:
    return sample_shape(lambda i: read_ref(refs[i]), len(refs), lambda i: describe_ref(refs[i], i), size, color)


def sample_shape(read: Callable[[int], bytes], count: int, describe: Callable[[int], str],
                 size: Optional[Sequence[int]], color: Optional[str]) -> List[int]:
    """The stored sample shape: ``size`` and ``color`` where given, otherwise those of the first readable of
    the first 64 samples (``read(i)``: sample i's bytes); unreadable ones are reported later, per sample."""
    base: Optional[List[int]] = None
    if size is None or color is None:
        for i in range(min(64, count)):
            try:
                base = probe_shape(read(i))
                break
            except Exception:  # noqa: BLE001
                continue
        if base is None and count:
            raise ShardError(f"none of the first {min(64, count)} images can be read (first: {describe(0)})")
        if base is None:
            base = [1, 1]
    hw = list(size) if size is not None else base[:2]
    if color is None:
        color = "gray" if len(base) == 2 else "rgb"
    if color not in ("gray", "rgb"):
        raise ValueError(f"unknown --color {color!r}; known: gray, rgb")
    return hw if color == "gray" else hw + [3]
