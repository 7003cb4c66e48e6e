#!/usr/bin/env python
"""The accuracy table of docs/accuracy.md: what local-only softmax loses against exact global softmax, and
what cross-shard negatives win back, by world size (classes per rank), and their trade-off against K and S.

    .venv/bin/python -m scripts.studies.accuracy --shards data/demo-fonts/train --pairs data/demo-fonts/pairs.h5 \
        --heldout data/demo-fonts/heldout --out runs/accuracy --np 2 4 8 --seeds 0 1 --every 50 --share 1024
    # trade-off points: --np 8 --variants local+negatives --every 10 200   (or --share 100 25)

Every run: the same backbone, steps, global batch (``--global-batch``, split evenly over ranks), schedule
and seed; only ``head.mode`` / ``head.negatives_*`` and the world size change (``local`` is the bare method,
``head.negatives_every=0``). Each run evaluates its final backbone on the held-out pairs (BatchNorm buffers
averaged first) and, with ``--heldout``, on every pair of the held-out shard set. Results, rebuilt from every
finished run in OUT: OUT/accuracy.json, OUT/accuracy.md (the table at the first --every / --share, and the
trade-off of all negatives runs), OUT/accuracy.png, OUT/tradeoff.png. Finished runs are reused (delete
OUT/<run> to redo one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)

VARIANTS = {
    "local": ["head.negatives_every=0"],
    "local+negatives": ["head.negatives_every={every}", "head.negatives_share={share}", "head.negatives_pool=0"],
    "global": ["head.mode=global"],
}


def run_name(variant: str, np_: int, seed: int, every: int = 0, share: int = 0) -> str:
    """Folder of one run; negatives runs carry their K and share (``S0``: all centres)."""
    tag = f"-K{every}-S{share}" if variant == "local+negatives" else ""
    return f"{variant.replace('+', '_')}{tag}-np{np_}-seed{seed}"


def run_one(args, variant: str, np_: int, seed: int, every: int = 0, share: int = 0) -> dict:
    if share >= -(-args.num_classes // np_):
        share = 0                # every rank shares its whole slice: the same run as "all"
    name = run_name(variant, np_, seed, every, share)
    out = os.path.join(args.out, name)
    evals = os.path.join(out, "eval.jsonl")
    if not (os.path.isfile(evals) and os.path.isfile(os.path.join(out, "done.json"))):
        sets = [f"data.batch_size={args.global_batch // np_}", f"train.steps={args.steps}", f"train.seed={seed}",
                f"eval.pairs=[{args.pairs}]", "eval.every=0", f"checkpoint.every=0", "train.log_every=25",
                "eval.on_error=stop"]   # the final evaluation is the cell's figure: a failed one fails the cell
        sets += [s.format(every=every, share=share) for s in VARIANTS[variant]] + list(args.set)
        if args.simulate:      # the same run on `hvd-partialfc simulate`'s N virtual ranks (docs/simulate.md)
            cmd = [os.path.join(BIN, "hvd-partialfc"), "simulate", "--ranks", str(np_)]
        else:
            cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np_), "--gloo", os.path.join(BIN, "hvd-partialfc"),
                   "train"]
        cmd += ["--config", args.config, "--shards", args.shards, "--out", out]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.time()
        env = dict(os.environ, HOROVOD_CYCLE_TIME=str(args.cycle_time_ms))
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{p.stderr[-4000:]}")
        with open(os.path.join(out, "done.json"), "w") as f:
            # the command as run from the repository root (no machine paths in what the study writes)
            json.dump({"wall_s": time.time() - t0, "cmd": [os.path.relpath(c, ROOT) if os.path.isabs(c) else c
                                                           for c in cmd]}, f)
    return load_row(args, name)


NAME = re.compile(r"^(local|local_negatives-K(\d+)-S(\d+)|global)-np(\d+)-seed(\d+)$")


def finished_runs(out_dir: str) -> list:
    """Names of the finished runs in ``out_dir`` (the table and the trade-off cover all of them)."""
    return sorted(n for n in os.listdir(out_dir)
                  if NAME.match(n) and os.path.isfile(os.path.join(out_dir, n, "done.json")))


def load_row(args, name: str) -> dict:
    """One finished run's figures (final evaluation, median samples/s, wall time, traffic)."""
    mt = NAME.match(name)
    variant = "local+negatives" if mt.group(2) else mt.group(1)
    every, share, np_, seed = (int(g or 0) for g in mt.groups()[1:])
    out = os.path.join(args.out, name)
    with open(os.path.join(out, "eval.jsonl")) as f:
        final = [json.loads(l) for l in f if l.strip()][-1]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(l) for l in f if l.strip() and "loss" in json.loads(l)]
    done = json.load(open(os.path.join(out, "done.json")))
    sps = sorted(m["samples_per_s"] for m in metrics)[len(metrics) // 2]
    row = {"variant": variant, "np": np_, "seed": seed, "every": every, "share": share, "acc": final["acc"],
           "acc_std": final["acc_std"], "auc": final["auc"], "tar@far=1e-3": final["tar@far=1e-3"],
           "tar@far=1e-2": final["tar@far=1e-2"], "samples_per_s": sps, "final_loss": metrics[-1]["loss"],
           "wall_s": done["wall_s"], "run": out}
    if args.heldout:
        row.update(all_pairs(out, args.heldout))
    row["classes_per_rank"] = args.num_classes // np_
    row.update(extra_cost(args, variant, np_, every, share))
    return row


def extra_cost(args, variant: str, np_: int, every: int, share: int) -> dict:
    """Per-rank bytes above bare `local`, from `hvd_partialfc.tools.estimate`: traffic per step (the negatives'
    all-gather amortised over K, or `global`'s gathers: features, labels, row statistics, the features'
    gradient) and memory (the negatives' buffer and extra logit columns, or `global`'s gathered features
    and (B x N, W) logits)."""
    from hvd_partialfc.tools.estimate import estimate
    kw = dict(classes=args.num_classes, world_size=np_, dim=args.dim, batch=args.global_batch // np_,
              bb=args.bb_figures)
    base = estimate(mode="local", **kw)
    if variant == "local+negatives":
        est = estimate(mode="local", negatives_every=every, negatives_share=share, **kw)
    else:
        est = estimate(mode=variant, **kw)
    grad_bytes = base["traffic_bytes"]["backbone gradient"]
    extra = est["traffic_total"] - base["traffic_total"]
    return {"extra_bytes_per_step": extra, "extra_vs_backbone_grad": extra / grad_bytes,
            "extra_memory_bytes": est["memory_total"] - base["memory_total"]}


def all_pairs(run: str, heldout: str) -> dict:
    """Every pair of the held-out set (`hvd_partialfc.verification.all_pairs.all_pairs_metrics`), once per run."""
    out = os.path.join(run, "all-pairs")
    path = os.path.join(out, "eval.json")
    if not os.path.isfile(path):
        p = subprocess.run([os.path.join(BIN, "hvd-partialfc"), "eval", "--backbone", run, "--all-pairs", heldout,
                            "--out", out], cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"all-pairs evaluation of {run} failed:\n{p.stderr[-4000:]}")
    m = next(iter(json.load(open(path))["all_pairs"].values()))
    return {"ap_auc": m["auc"], "ap_tar@far=1e-3": m["tar@far=1e-3"], "ap_tar@far=1e-4": m["tar@far=1e-4"],
            "ap_tar@far=1e-5": m["tar@far=1e-5"], "ap_pairs": m["pairs"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--heldout", help="held-out shard set: also verify over all its pairs (low-noise TAR)")
    p.add_argument("--out", default="runs/accuracy")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--np", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--every", type=int, nargs="+", default=[10],
                   help="negatives: exchange intervals K (the first is the table's; all go to the trade-off)")
    p.add_argument("--share", type=int, nargs="+", default=[0],
                   help="negatives: centres per rank (0: all; the first is the table's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--cycle-time-ms", type=float, default=10.0)
    p.add_argument("--simulate", action="store_true",
                   help="run every cell on `hvd-partialfc simulate --ranks N` instead of horovodrun -np N (use "
                        "another --out): the simulator's held-out accuracy against real runs'")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run of OUT (keep one OUT per setting)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    from hvd_partialfc.tools.estimate import backbone_figures
    from hvd_partialfc.data.shards import read_manifest
    import yaml
    cfg = yaml.safe_load(open(args.config))
    m = read_manifest(args.shards)
    args.bb_figures = backbone_figures(cfg["model"]["name"], cfg["model"]["embedding_dim"], 1, m.sample_shape,
                                       cfg["model"].get("kwargs", {}))
    args.dim, args.num_classes = cfg["model"]["embedding_dim"], m.num_classes
    for np_ in args.np:
        for seed in args.seeds:
            for v in args.variants:
                configs = [(k, s) for k in args.every for s in args.share] if v == "local+negatives" else [(0, 0)]
                for every, share in configs:
                    r = run_one(args, v, np_, seed, every, share)
                    ap = (f" all-pairs TAR@1e-3 {r['ap_tar@far=1e-3']:.4f} @1e-4 {r['ap_tar@far=1e-4']:.4f}"
                          if args.heldout else "")
                    print(f"{run_name(v, np_, seed, every, share):<34} acc {r['acc']:.4f} "
                          f"TAR@1e-3 {r['tar@far=1e-3']:.4f} AUC {r['auc']:.4f}{ap} "
                          f"({r['samples_per_s']:.0f} samples/s, {r['wall_s']:.0f} s)", flush=True)
    rows = [load_row(args, n) for n in finished_runs(args.out)]   # this call's runs and earlier ones
    json.dump({"args": {k: v for k, v in vars(args).items() if k != "bb_figures"}, "rows": rows, "num_classes": m.num_classes},
              open(os.path.join(args.out, "accuracy.json"), "w"), indent=1)
    write_tables(args, rows, m.num_classes)
    return 0


def _main_key(args, np_: int) -> tuple:
    """The negatives setting of the table at ``np_``: the first --every / --share ("all" when >= the slice)."""
    share = args.share[0] if args.share[0] < -(-args.num_classes // np_) else 0
    return (np_, "local+negatives", args.every[0], share)


def _key(r: dict) -> tuple:
    return (r["np"], r["variant"], r["every"], r["share"])


def _label(r: dict) -> str:
    if r["variant"] != "local+negatives":
        return r["variant"]
    return f"local + negatives (K={r['every']}, {'all' if not r['share'] else r['share']} centres)"


def write_tables(args, rows, num_classes) -> None:
    """OUT/accuracy.md: the table (local / negatives at the first K and share / global by np, seed means) and
    the trade-off (every negatives setting against global), OUT/accuracy.png and OUT/tradeoff.png."""
    import numpy as np
    by = {}
    for r in rows:
        by.setdefault(_key(r), []).append(r)
    metrics = [("acc", "10-fold acc"), ("tar@far=1e-3", "TAR@1e-3 (6k pairs)"), ("auc", "AUC")]
    if args.heldout:
        metrics += [("ap_tar@far=1e-3", "all-pairs TAR@1e-3"), ("ap_tar@far=1e-4", "all-pairs TAR@1e-4")]

    def cell(rs, key):
        v = [r[key] for r in rs]
        return f"{np.mean(v):.4f}" + (f" ±{np.std(v):.4f}" if len(v) > 1 else "")

    def rel(rs, g, key):
        return np.mean([r[key] for r in rs]) / np.mean([r[key] for r in g]) if g else float("nan")

    head = "| np | classes/rank | mode | seeds | " + " | ".join(t for _, t in metrics) + \
           " | vs global: " + " / ".join(t.split(" (")[0] for _, t in metrics[:2] + metrics[3:]) + \
           " | extra bytes/step vs backbone grad | extra memory/rank | samples/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    nps = sorted({r["np"] for r in rows})

    def main_keys(np_):
        return [(np_, "local", 0, 0), _main_key(args, np_), (np_, "global", 0, 0)]

    for np_ in nps:
        g = by.get((np_, "global", 0, 0))
        for key in main_keys(np_):
            rs = by.get(key)
            if not rs:
                continue
            vs = " / ".join(f"{rel(rs, g, key):.3f}" for key, _ in metrics[:2] + metrics[3:])
            lines.append(f"| {np_} | {num_classes // np_} | {_label(rs[0])} | {len(rs)} | "
                         + " | ".join(cell(rs, key) for key, _ in metrics)
                         + f" | {vs} | {rs[0]['extra_vs_backbone_grad']:.2%} | "
                         f"{rs[0]['extra_memory_bytes'] / 2 ** 20:.2f} MB | "
                         f"{np.mean([r['samples_per_s'] for r in rs]):.0f} |")
    lines += ["", "Trade-off: every negatives setting, against `global` at the same np (seed means)", "",
              "| np | K | centres shared per rank | seeds | extra bytes/step vs backbone grad | extra memory/rank | "
              + " | ".join(f"{t} vs global" for _, t in metrics) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(metrics)]
    for key in sorted(k for k in by if k[1] == "local+negatives"):
        rs, g = by[key], by.get((key[0], "global", 0, 0))
        lines.append(f"| {key[0]} | {key[2]} | {key[3] or 'all'} | {len(rs)} | {rs[0]['extra_vs_backbone_grad']:.2%} | "
                     f"{rs[0]['extra_memory_bytes'] / 2 ** 20:.2f} MB | "
                     + " | ".join(f"{rel(rs, g, m_):.3f}" for m_, _ in metrics) + " |")
    open(os.path.join(args.out, "accuracy.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tar = "ap_tar@far=1e-3" if args.heldout else "tar@far=1e-3"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], tar, "TAR@FAR=1e-3" + (" (all pairs)" if args.heldout else "")),
                           (axes[1], "acc", "10-fold accuracy")):
        for i, name in enumerate(("local", "local + negatives", "global")):
            keys = [main_keys(x)[i] for x in nps if main_keys(x)[i] in by]
            if keys:
                ax.errorbar([num_classes // k[0] for k in keys], [np.mean([r[key] for r in by[k]]) for k in keys],
                            yerr=[np.std([r[key] for r in by[k]]) for k in keys], marker="o", capsize=3,
                            label=name if i != 1 else f"{name} (K={args.every[0]}, share {args.share[0] or 'all'})")
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("classes per rank (np = 2, 4, 8 →)")
        ax.set_title(f"held-out {title}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "accuracy.png"), dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for np_ in sorted({k[0] for k in by if k[1] == "local+negatives"}):
        g = by.get((np_, "global", 0, 0))
        pts = sorted((rs[0]["extra_vs_backbone_grad"] * 100, rel(rs, g, tar), k) for k, rs in by.items()
                     if k[0] == np_ and k[1] == "local+negatives")
        loc = by.get((np_, "local", 0, 0))
        line = ax.plot([p_[0] for p_ in pts], [p_[1] for p_ in pts], marker="o", ls="none",
                       label=f"np={np_} negatives")[0]
        for x, y, k in pts:
            ax.annotate(f"K={k[2]}" + (f",S={k[3]}" if k[3] else ""), (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if loc:
            ax.axhline(rel(loc, g, tar), color=line.get_color(), ls=":", lw=1, label=f"np={np_} local (no exchange)")
    ax.axhline(0.99, color="k", ls="--", lw=1, label="target: 99% of global")
    ax.axvline(1.0, color="r", ls="--", lw=1, label="traffic budget: 1%")
    ax.set_xscale("log")
    ax.set_xlabel("amortised extra bytes per step, % of the backbone gradient")
    ax.set_ylabel(("all-pairs " if args.heldout else "") + "TAR@FAR=1e-3 relative to global")
    ax.set_title("cross-shard negatives: accuracy against traffic")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "tradeoff.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
