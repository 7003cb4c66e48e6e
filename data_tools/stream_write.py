"""Step 3 of a streaming build (`data_tools/stream.py`): reading samples in worker processes, writing shards.

Every shard of this part is read by worker processes in blocks of `data_tools.stream_plan.block_samples`
samples, decoded (``--store raw``) or checked (``encoded``), and written block by block into the shard's
HDF5 file (`data_tools.shard_writer.ShardFileWriter`, the layout the in-memory build writes too); at
most ``2 * workers + 2`` blocks are in flight, so the memory is the index plus a few blocks, whatever the
sample count. Shard bytes do not depend on the workers, the part or a restart: block boundaries depend
only on the sample shape, and h5py stores no timestamps.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import h5py
import numpy as np

from hvd_partialfc.atomic import atomic_path
from hvd_partialfc.data.partition import LabelSlice
from hvd_partialfc.data.shards import ShardError, decode_image, sha256_file

from .recordio_format import read_record, unpack_image
from .shard_writer import ShardFileWriter
from .stream_index import SampleIndex
from .storage import sample_shape

# --- reading one sample (in the worker processes) ---------------------------------------------------------

_READER: Dict[str, Any] = {}          # set before the pool forks: index, store, shape; the open .rec per process


def set_reader(index: SampleIndex, **options: Any) -> None:
    """What the workers read: ``index``, then (once the shape is known) ``store``, ``shape``, ``check``.
    Module state, set before the pool forks: the forked workers inherit it without pickling the index."""
    if index is not _READER.get("index"):
        _READER.clear()
        _READER.update(index=index)
    _READER.update(options)


def _read_bytes(i: int) -> bytes:
    index: SampleIndex = _READER["index"]
    if index.rec_path:
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
    """The in-memory build's rule (`data_tools.storage.sample_shape`), on the index."""
    return sample_shape(_read_bytes, len(index), index.describe, size, color)


def load_blocks(jobs: Iterator[np.ndarray], workers: int) -> Iterator:
    """Results of `_load_block` for ``jobs`` in order, at most ``2 * workers + 2`` in flight; ``close()`` ends
    the workers.

    The worker processes start here, before any shard file is open: a worker forked while a shard was open for
    writing held that file's HDF5 lock (a lock is shared across fork) as long as it lived, and the skip path's
    rewrite of the shard (`_compact`) could not open it ("unable to lock file")."""
    if workers <= 1:
        return (_load_block(rows) for rows in jobs)
    return _Pooled(mp.get_context("fork").Pool(workers), iter(jobs), workers)


class _Pooled:
    def __init__(self, pool, it: Iterator[np.ndarray], workers: int):
        self.pool = pool
        self.results = self._results(it, workers)

    def _results(self, it, workers):
        pending: deque = deque()
        for rows in it:
            pending.append(self.pool.apply_async(_load_block, (rows,)))
            if len(pending) >= 2 * workers + 2:
                break
        while pending:
            yield pending.popleft().get()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(self.pool.apply_async(_load_block, (nxt,)))

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.results)

    def close(self) -> None:
        self.results.close()
        self.pool.terminate()
        self.pool.join()


# --- writing --------------------------------------------------------------------------------------------------

def _shard_file(path: str, plan: Dict, it: Dict, labels: np.ndarray, opts) -> ShardFileWriter:
    kind, shape = plan["kind"], plan["sample_shape"]
    return ShardFileWriter(path, kind, labels, LabelSlice(it["index"], it["label_start"], it["label_end"]),
                           plan["sets"][it["set"]]["num_shards"], sample_shape=shape, compression=opts.compression,
                           chunk_samples=opts.chunk_samples, decoded_shape=shape if kind == "encoded" else None)


def write_item(path: str, plan: Dict, it: Dict, labels: np.ndarray, rows: np.ndarray, blocks: Iterator,
               index: SampleIndex, opts) -> Dict[str, Any]:
    """Write one shard from its blocks; returns its done record. ``rows``: sample numbers, input order."""
    n, bs = len(rows), plan["block_samples"]
    skipped: List[str] = []
    bad = np.zeros(n, bool)
    with atomic_path(path) as tmp:
        with _shard_file(tmp, plan, it, labels, opts) as w:
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
                w.write(a, samples)
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
    kind, bs = plan["kind"], plan["block_samples"]
    keep = np.flatnonzero(~bad)
    other = tmp + ".compact"
    with h5py.File(tmp, "r") as src, _shard_file(other, plan, it, labels[keep], opts) as w:
        for a in range(0, len(keep), bs):
            sel = keep[a:a + bs]
            w.write(a, [src[kind][int(i)] for i in sel] if kind == "encoded" else src[kind][sel])
    os.replace(other, tmp)
