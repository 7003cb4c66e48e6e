"""``hvd-partialfc-shards``: build and inspect shard sets offline.

    hvd-partialfc-shards build FORMAT SOURCE --out DIR --num-shards N [--balance classes|samples]
    hvd-partialfc-shards inspect DIR [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _build(args) -> int:
    from .build import build_shard_set
    from .importers import get_importer
    data = get_importer(args.format)(args.source)
    m = build_shard_set(data, args.out, args.num_shards, args.balance, args.overwrite)
    print(f"wrote {args.out}: {m.num_shards} shards, {m.num_classes} classes, {m.num_samples} samples "
          f"({m.kind} {m.sample_shape}); sample imbalance {m.partition['sample_imbalance']:.3f}")
    return 0


def inspect_shard_set(path: str, verify_sha256: bool = True) -> dict:
    """Validate a shard set (manifest, label ranges, every label, counts, sha256) and summarise it."""
    from hvd_partialfc.partition import imbalance
    from hvd_partialfc.shards import check_shard_file, read_manifest
    m = read_manifest(path)
    rows = []
    for i, s in enumerate(m.shards):
        check_shard_file(path, m, i, verify_sha256=verify_sha256)
        rows.append({"file": s.file, "label_start": s.label_start, "label_end": s.label_end,
                     "classes": s.label_end - s.label_start, "samples": s.num_samples})
    return {"path": path, "num_classes": m.num_classes, "num_samples": m.num_samples, "kind": m.kind,
            "sample_shape": m.sample_shape, "partition": m.partition, "shards": rows,
            "sample_imbalance": imbalance([r["samples"] for r in rows]),
            "class_imbalance": imbalance([r["classes"] for r in rows]), "skipped": len(m.skipped)}


def _inspect(args) -> int:
    info = inspect_shard_set(args.dir, verify_sha256=not args.no_sha256)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['path']}: {info['num_classes']} classes, {info['num_samples']} samples, {info['kind']} "
          f"{info['sample_shape']}, {len(info['shards'])} shards: valid")
    for r in info["shards"]:
        print(f"  {r['file']}  labels [{r['label_start']}, {r['label_end']})  {r['classes']} classes  {r['samples']} samples")
    print(f"  imbalance (max/mean): samples {info['sample_imbalance']:.3f}, classes {info['class_imbalance']:.3f}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    from .importers import list_importers
    p = argparse.ArgumentParser(prog="hvd-partialfc-shards", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write a shard set from a source")
    b.add_argument("format", choices=list_importers())
    b.add_argument("source")
    b.add_argument("--out", required=True)
    b.add_argument("--num-shards", type=int, required=True)
    b.add_argument("--balance", choices=["classes", "samples"], default="classes")
    b.add_argument("--overwrite", action="store_true")
    b.set_defaults(fn=_build)
    i = sub.add_parser("inspect", help="validate a shard set and print its per-shard figures")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-sha256", action="store_true", help="skip hashing the shard files")
    i.set_defaults(fn=_inspect)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as err:
        print(f"hvd-partialfc-shards {args.cmd}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
