"""``hvd-partialfc``: thin subcommands that parse, build, call and clean up.

    hvd-partialfc train  [--config FILE] [--shards DIR] [--out RUN] [--steps N] [--set key=value ...]
    hvd-partialfc export RUN --rank K --out backbone.pt
    hvd-partialfc info   RUN [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _train(args) -> int:
    from .config import load_config
    extra = {}
    if args.shards:
        extra.setdefault("data", {})["shards"] = args.shards
    if args.out:
        extra["out"] = args.out
    if args.steps is not None:
        extra.setdefault("train", {})["steps"] = args.steps
    if args.resume:
        extra.setdefault("checkpoint", {})["resume"] = args.resume
    cfg = load_config(args.config, args.set or [], extra)
    from . import comm as comm_lib
    from .train import Trainer
    comm = comm_lib.init()
    try:
        ckpt = Trainer(cfg, comm).fit()
    except Exception as e:
        # Every rank reports with its rank number; the non-zero exit makes the launcher stop the others.
        print(f"[rank {comm.rank}] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    if comm.is_main:
        print(f"done: {ckpt}")
    comm.shutdown()
    return 0


def _export(args) -> int:
    from .export import export_backbone
    info = export_backbone(args.run, args.out, args.rank)
    print(json.dumps(info, indent=1))
    return 0


def _info(args) -> int:
    from .export import run_summary
    s = run_summary(args.run)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"checkpoint {s['checkpoint']}  step {s['step']}/{s['total_steps']}  world size {s['world_size']}  "
          f"classes {s['num_classes']}  backbone {s['model']['name']}  digests agree: {s['digests_agree']}")
    for r in s["ranks"]:
        print(f"  rank {r['rank']:>4}  labels [{r['label_start']}, {r['label_end']})  "
              f"classifier {r['classifier_shape']}  digest {r['digest'][:16]}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="hvd-partialfc", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train under horovodrun / mpirun (or alone, as one rank)")
    t.add_argument("--config", help="YAML config (sections: data, model, head, optim, train, checkpoint)")
    t.add_argument("--shards", help="shard set directory (= --set data.shards=DIR)")
    t.add_argument("--out", help="run directory (= --set out=DIR)")
    t.add_argument("--steps", type=int, help="optimizer steps (= --set train.steps=N)")
    t.add_argument("--resume", help="auto | checkpoint path (= --set checkpoint.resume=...)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. optim.backbone_lr=0.05")
    t.set_defaults(fn=_train)
    e = sub.add_parser("export", help="write a standalone backbone from a run (after checking the digests)")
    e.add_argument("run", help="run folder or checkpoint folder")
    e.add_argument("--rank", type=int, default=0, help="whose copy (all must agree)")
    e.add_argument("--out", required=True, help="output file, e.g. backbone.pt")
    e.set_defaults(fn=_export)
    i = sub.add_parser("info", help="summary of a run: ranks, label slices, classifier shapes, digests")
    i.add_argument("run")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=_info)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        if args.cmd == "train":
            raise
        print(f"hvd-partialfc {args.cmd}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
