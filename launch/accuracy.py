#!/usr/bin/env python
"""The accuracy table of docs/accuracy.md: what local-only softmax loses against exact global softmax, and
what cross-shard negatives win back, by world size (classes per rank).

    .venv/bin/python launch/accuracy.py --shards data/demo-fonts/train --pairs data/demo-fonts/pairs.h5 \
        --out runs/accuracy --np 2 4 8 --steps 600 [--seeds 0 1]

Every run: the same backbone, steps, global batch (``--global-batch``, split evenly over ranks), schedule
and seed; only ``head.mode`` / ``head.negatives_*`` and the world size change. Each run evaluates its final
backbone on the held-out pairs (BatchNorm buffers averaged first). Results: OUT/accuracy.json, OUT/accuracy.md,
OUT/accuracy.png. Runs already finished are reused (delete OUT/<run> to redo one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

VARIANTS = {
    "local": [],
    "local+negatives": ["head.negatives_every={every}", "head.negatives_share={share}"],
    "global": ["head.mode=global"],
}


def run_one(args, variant: str, np_: int, seed: int) -> dict:
    name = f"{variant.replace('+', '_')}-np{np_}-seed{seed}"
    out = os.path.join(args.out, name)
    evals = os.path.join(out, "eval.jsonl")
    if not (os.path.isfile(evals) and os.path.isfile(os.path.join(out, "done.json"))):
        sets = [f"data.batch_size={args.global_batch // np_}", f"train.steps={args.steps}", f"train.seed={seed}",
                f"eval.pairs=[{args.pairs}]", "eval.every=0", f"checkpoint.every=0", "train.log_every=25"]
        sets += [s.format(every=args.every, share=args.share) for s in VARIANTS[variant]]
        cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np_), "--gloo", os.path.join(BIN, "hvd-partialfc"), "train",
               "--config", args.config, "--shards", args.shards, "--out", out]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.time()
        env = dict(os.environ, HOROVOD_CYCLE_TIME=str(args.cycle_time_ms))
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{p.stderr[-4000:]}")
        with open(os.path.join(out, "done.json"), "w") as f:
            json.dump({"wall_s": time.time() - t0, "cmd": cmd}, f)
    with open(evals) as f:
        final = [json.loads(l) for l in f if l.strip()][-1]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(l) for l in f if l.strip() and "loss" in json.loads(l)]
    done = json.load(open(os.path.join(out, "done.json")))
    sps = sorted(m["samples_per_s"] for m in metrics)[len(metrics) // 2]
    return {"variant": variant, "np": np_, "seed": seed, "acc": final["acc"], "acc_std": final["acc_std"],
            "auc": final["auc"], "tar@far=1e-3": final["tar@far=1e-3"], "tar@far=1e-2": final["tar@far=1e-2"],
            "samples_per_s": sps, "final_loss": metrics[-1]["loss"], "wall_s": done["wall_s"], "run": out}


def traffic(args, np_: int, num_classes: int, grad_bytes: int, dim: int) -> dict:
    """Bytes each rank sends per step, amortised: backbone gradient, plus the exchange or global's gathers."""
    width = -(-num_classes // np_)
    share = min(args.share or width, width)
    per_rank_batch = args.global_batch // np_
    return {"backbone_grad": grad_bytes,
            "negatives": share * dim * 4 / args.every,
            # global: features (B x D fp32) + labels + row counts + (max, sum, target) of the gathered batch
            # + the features' gradient allreduce (M x D) - the figures of hvd_partialfc.bench
            "global": per_rank_batch * dim * 4 + per_rank_batch * 8 + 8
            + args.global_batch * 4 * 3 + args.global_batch * dim * 4}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--out", default="runs/accuracy")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--np", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--every", type=int, default=50, help="negatives: exchange interval K")
    p.add_argument("--share", type=int, default=0, help="negatives: centres per rank (0: all)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--cycle-time-ms", type=float, default=10.0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    from hvd_partialfc.shards import read_manifest
    from hvd_partialfc.models import create_model
    import yaml
    cfg = yaml.safe_load(open(args.config))
    m = read_manifest(args.shards)
    model = create_model(cfg["model"]["name"], in_shape=m.sample_shape, embedding_dim=cfg["model"]["embedding_dim"],
                         **cfg["model"].get("kwargs", {}))
    grad_bytes = sum(q.numel() * 4 for q in model.parameters())
    rows = []
    for np_ in args.np:
        for seed in args.seeds:
            for v in args.variants:
                r = run_one(args, v, np_, seed)
                r["classes_per_rank"] = m.num_classes // np_
                rows.append(r)
                print(f"np={np_} seed={seed} {v:<16} acc {r['acc']:.4f} TAR@1e-3 {r['tar@far=1e-3']} "
                      f"AUC {r['auc']:.4f} ({r['samples_per_s']:.0f} samples/s, {r['wall_s']:.0f} s)", flush=True)
    tr = {np_: traffic(args, np_, m.num_classes, grad_bytes, cfg["model"]["embedding_dim"]) for np_ in args.np}
    json.dump({"args": vars(args), "rows": rows, "traffic": tr, "num_classes": m.num_classes},
              open(os.path.join(args.out, "accuracy.json"), "w"), indent=1)
    write_table(args, rows, tr, m.num_classes)
    return 0


def write_table(args, rows, tr, num_classes) -> None:
    import numpy as np
    lines = ["| np | classes/rank | mode | 10-fold acc | TAR@FAR=1e-3 | AUC | vs global: acc / TAR | extra bytes/step vs backbone grad | samples/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["np"], r["variant"]), []).append(r)
    for np_ in args.np:
        g = by.get((np_, "global"))
        g_acc = np.mean([r["acc"] for r in g]) if g else None
        g_tar = np.mean([r["tar@far=1e-3"] for r in g]) if g else None
        for v in args.variants:
            rs = by.get((np_, v))
            if not rs:
                continue
            acc, tar = np.mean([r["acc"] for r in rs]), np.mean([r["tar@far=1e-3"] for r in rs])
            spread = f" (±{np.std([r['acc'] for r in rs]):.4f} over {len(rs)} seeds)" if len(rs) > 1 else ""
            extra = {"local": 0.0, "local+negatives": tr[np_]["negatives"], "global": tr[np_]["global"]}[v]
            rel = f"{extra / tr[np_]['backbone_grad']:.2%}"
            vs = f"{acc / g_acc:.3f} / {tar / g_tar:.3f}" if g_acc else "–"
            lines.append(f"| {np_} | {num_classes // np_} | {v} | {acc:.4f}{spread} | {tar:.4f} | "
                         f"{np.mean([r['auc'] for r in rs]):.4f} | {vs} | {rel} | {np.mean([r['samples_per_s'] for r in rs]):.0f} |")
    open(os.path.join(args.out, "accuracy.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "tar@far=1e-3", "TAR@FAR=1e-3"), (axes[1], "acc", "10-fold accuracy")):
        for v in args.variants:
            xs = [np_ for np_ in args.np if (np_, v) in by]
            ax.plot([num_classes // x for x in xs], [np.mean([r[key] for r in by[(x, v)]]) for x in xs],
                    marker="o", label=v)
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("classes per rank (np = 2, 4, 8 →)")
        ax.set_title(f"held-out {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "accuracy.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
