#!/usr/bin/env python
"""The bf16 head's accuracy check (docs/gpu.md, "Speed on the GPU"): the same run with ``head.matmul=fp32``
and ``head.matmul=bf16`` for each seed, each final backbone verified over every pair of a held-out set.

    # the demo's run (configs/demo.yaml, 2 ranks; on the GPU day add --set train.device=cuda):
    .venv/bin/python -m scripts.studies.head_matmul_check --shards data/demo-fonts/train \
        --heldout data/demo-fonts/heldout --config configs/demo.yaml --np 2 --seeds 0 1 --out runs/matmul
    # the small CPU check (a synthetic feature set, built here):
    .venv/bin/python -m scripts.studies.head_matmul_check --synthetic --steps 300 --seeds 0 1 2 3 --out runs/matmul-cpu

Every run goes through ``hvd-partialfc simulate --ranks NP`` (one process). On CPU, bf16 products are the
bf16-rounded operands multiplied in float32 (classifier/margins.py): the same rounding as the GPU's bf16
GEMM with float32 output, so this measures its accuracy, not its speed. Writes OUT/matmul.json and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNTHETIC = ["model.name=mlp", "model.embedding_dim=64", "model.kwargs={hidden_dim: 128}", "data.batch_size=64",
             "head.loss=arcface", "head.scale=32", "head.margin=0.3", "optim.warmup_steps=30",
             "optim.clip_grad_norm=5.0", "train.log_every=50", "head.negatives_every=0"]


def synthetic(out: str) -> tuple:
    """2,000 training classes and 200 held-out ones (32-d Gaussian clusters, 24 samples each)."""
    sys.path.insert(0, ROOT)
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    dirs = []
    for name, classes, seed in (("train", 2000, 0), ("heldout", 200, 1)):
        d = os.path.join(out, "data", name)
        if not os.path.isfile(os.path.join(d, "manifest.json")):
            rng = np.random.default_rng(seed)
            centres = rng.normal(size=(classes, 32)).astype(np.float32)
            y = np.repeat(np.arange(classes), 24)
            x = centres[y] + 0.9 * rng.normal(size=(len(y), 32)).astype(np.float32)
            os.makedirs(os.path.dirname(d), exist_ok=True)
            npz = d + ".npz"
            np.savez(npz, features=x, labels=y)
            build_shard_set(get_importer("npz")(npz), d, 4)
        dirs.append(d)
    return tuple(dirs)


def run(args, matmul: str, seed: int) -> dict:
    out = os.path.join(args.out, f"{matmul}-seed{seed}")
    if not os.path.isfile(os.path.join(out, "all-pairs", "eval.json")):
        cmd = [sys.executable, "-m", "hvd_partialfc.cli", "simulate", "--ranks", str(args.np), "--shards", args.shards,
               "--out", out]
        cmd += ["--config", args.config] if args.config else []
        sets = list(args.set) + [f"head.matmul={matmul}", f"train.seed={seed}", "checkpoint.every=0", "eval.every=0"]
        sets += [f"train.steps={args.steps}"] if args.steps else []
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        subprocess.run([sys.executable, "-m", "hvd_partialfc.cli", "eval", "--backbone", out, "--all-pairs", args.heldout,
                        "--out", os.path.join(out, "all-pairs")], cwd=ROOT, check=True, capture_output=True, text=True)
    m = next(iter(json.load(open(os.path.join(out, "all-pairs", "eval.json")))["all_pairs"].values()))
    return {"matmul": matmul, "seed": seed, "tar@1e-3": m["tar@far=1e-3"], "tar@1e-4": m["tar@far=1e-4"],
            "auc": m["auc"], "pairs": m["pairs"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards")
    p.add_argument("--heldout")
    p.add_argument("--synthetic", action="store_true", help="build and use the small synthetic feature set")
    p.add_argument("--config", default="")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="0: the config's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", default="runs/matmul")
    args = p.parse_args()
    if args.synthetic:
        args.shards, args.heldout = synthetic(args.out)
        args.set = SYNTHETIC + args.set
    if not (args.shards and args.heldout):
        p.error("--shards and --heldout, or --synthetic")
    rows = [run(args, mm, s) for s in args.seeds for mm in ("fp32", "bf16")]
    with open(os.path.join(args.out, "matmul.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| head.matmul | seed | all-pairs TAR@1e-3 | TAR@1e-4 | AUC |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['matmul']} | {r['seed']} | {r['tar@1e-3']:.4f} | {r['tar@1e-4']:.4f} | {r['auc']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
