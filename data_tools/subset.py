"""A prefix of a shard set as a shard set of its own, with no data copied: a new ``manifest.json`` whose
entries name the source's first shard files by a relative path (``../train/shard-00000-of-00256.h5``).

Why: the scale study (scripts/studies/scale_study.py) trains N ranks on the first N x k shards of one set so that
the classes per rank stay fixed while N grows. Shards hold contiguous label ranges starting at 0, so a
prefix of them is a valid set: labels ``[0, label_end of the last shard)``, the source's class names cut to
them. The loader joins an entry's ``file`` to the set's folder (``data.RankShardDataset``), so a relative
path works as a name does; the shard files themselves still carry the source's index / count attributes,
which no reader checks against the manifest. The manifest is rewritten only when its content changes, so
its sha256 (recorded by checkpoints, checked on resume) stays the same from one run to the next.
"""
from __future__ import annotations

import json
import os

from hvd_partialfc.atomic import write_text
from hvd_partialfc.data import class_identity
from hvd_partialfc.data.shards import MANIFEST, Manifest, ShardEntry, manifest_digest, read_manifest


def write_prefix_subset(src_dir: str, out_dir: str, num_shards: int) -> Manifest:
    """Write ``out_dir/manifest.json``: the first ``num_shards`` shards of ``src_dir``; returns its manifest."""
    src = read_manifest(src_dir)
    if not 1 <= num_shards <= src.num_shards:
        raise ValueError(f"{src_dir}: a prefix of {num_shards} shards, but the set has {src.num_shards}")
    os.makedirs(out_dir, exist_ok=True)
    entries = [ShardEntry(os.path.relpath(os.path.join(src_dir, e.file), out_dir), e.label_start, e.label_end,
                          e.num_samples, e.sha256) for e in src.shards[:num_shards]]
    classes = entries[-1].label_end
    m = Manifest(num_classes=classes, kind=src.kind, sample_shape=list(src.sample_shape),
                 sample_dtype=src.sample_dtype, shards=entries,
                 partition={"policy": src.partition.get("policy", "classes")},
                 class_names=list(src.class_names[:classes]),
                 source={"prefix_of": os.path.relpath(src_dir, out_dir), "prefix_shards": num_shards,
                         "source_shards": src.num_shards, "source_manifest_sha256": manifest_digest(src_dir)})
    m.class_identity = class_identity.of_shard_set(out_dir, m)     # its classes', not the source's
    text = json.dumps(m.to_json(), indent=1, ensure_ascii=False) + "\n"
    path = os.path.join(out_dir, MANIFEST)
    if not (os.path.isfile(path) and open(path, encoding="utf-8").read() == text):
        write_text(path, text)
    return read_manifest(out_dir)     # the reader's checks (label ranges cover [0, classes))
