"""``hvd-partialfc-shards inspect DIR --decode``: every sample of an encoded set decoded, the failures listed.

The scan splits each shard into blocks of ``BLOCK`` samples, decoded by ``--workers`` forked processes
(storage.pmap; each opens the shard file itself: an HDF5 handle must not cross a fork), the conversion being
the loader's (``shards.decode_image`` to the manifest's ``sample_shape``), so what it lists is exactly what a
run would stop on (``data.on_bad_sample: stop``) or replace (``skip``). ``rebuild_command`` gives the build
that leaves them out: the set's recorded source with ``--on-error skip``, which decodes every image.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from hvd_partialfc.data.bad_samples import describe
from hvd_partialfc.data.shards import Manifest, decode_image, open_shard, read_manifest

# samples per task: one task reads a block with one h5py request; 1,024 112x112 JPEG faces decode in ~0.3 s
# on one core (~3,200/s, docs/data.md), small enough to keep every worker busy to the end of a shard
BLOCK = 1024


def _scan_block(task: Tuple[str, str, int, int, List[int]]) -> List[Dict[str, Any]]:
    """The samples of ``path`` in [start, stop) that do not decode to ``shape``, as records."""
    path, kind, start, stop, shape = task
    with open_shard(path) as f:
        blobs, labels = f[kind][start:stop], f["labels"][start:stop]
    bad = []
    for i, blob in enumerate(blobs):
        try:
            decode_image(blob, shape)
        except Exception as e:
            bad.append({"file": os.path.basename(path), "sample": start + i, "label": int(labels[i]),
                        "bytes": int(len(blob)), "reason": describe(blob, e)})
    return bad


def undecodable(shard_dir: str, workers: int, progress: bool = False) -> List[Dict[str, Any]]:
    """Every sample of the encoded set ``shard_dir`` that does not decode, in file and sample order."""
    from .storage import pmap
    m = read_manifest(shard_dir)
    if m.kind != "encoded":
        raise ValueError(f"{shard_dir}: --decode applies to encoded sets; this one stores {m.kind}, "
                         f"already decoded")
    tasks = [(os.path.join(shard_dir, s.file), m.kind, a, min(a + BLOCK, s.num_samples), list(m.sample_shape))
             for s in m.shards for a in range(0, s.num_samples, BLOCK)]
    return [r for block in pmap(_scan_block, tasks, workers, "decode", chunksize=1, progress=progress)
            for r in block]


def rebuild_command(m: Manifest, shard_dir: str) -> str:
    """The build that leaves the undecodable samples out: the set's recorded format and source (FORMAT
    SOURCE where the manifest has none), its shard count, ``--store encoded --on-error skip``."""
    fmt, path = m.source.get("format", "FORMAT"), m.source.get("path", "SOURCE")
    size = m.sample_shape
    out = os.path.normpath(shard_dir) + "-clean"
    return (f"hvd-partialfc-shards build {fmt} {path} --out {out} --num-shards {m.num_shards} --store encoded "
            f"--size {size[0]},{size[1]} --on-error skip --balance {m.partition.get('policy', 'classes')}")
