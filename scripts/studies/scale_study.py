#!/usr/bin/env python
"""The scale study: does local-only softmax hold at 64-256 ranks? The study driver, resumable run by run.

    .venv/bin/python -m scripts.studies.scale_study --shards data/cjk-20k/train --heldout data/cjk-20k/heldout \
        --pairs data/cjk-20k/pairs.h5 --out runs/scale --max-cells 2      # a bounded chunk; run again later
    .venv/bin/python -m scripts.studies.scale_study ... --dry-run                  # the cells, in order, and commands
    .venv/bin/python -m scripts.studies.scale_study ... --report-only              # rebuild the tables from OUT

Every cell is one `hvd-partialfc simulate --ranks N` run (docs/simulate.md: a real N-rank run's numbers in
one process) with the same steps, global batch and schedule; only N, the seed, the classifier variant and,
for the fixed-width series, the shard prefix change. Variants (``VARIANTS``): ``local_bare`` (the claimed
method, ``head.negatives_every=0``), ``local`` (its defaults: cross-shard negatives), ``global`` (exact
softmax), ``partialfc`` (``global`` sampling ``--sample-rate`` of the centres) and ``local_sampled``
(``local`` at its defaults, sampling ``--sample-rate`` of its own columns). The *fixed classes per rank*
series trains N ranks on the first N x ``--fixed-shards-per-rank`` shards (a subset manifest written by
``data_tools.subset``, no data copied), so the slice width stays that of one shard block while N grows.

After training, the final backbone (BatchNorm buffers averaged) is evaluated on every pair of the held-out
shard set (all-pairs TAR at FAR 1e-3 / 1e-4) and on the pair set (10-fold accuracy). A cell is finished
when ``OUT/<cell>/done.json`` exists: it is then skipped (delete the folder to redo it). An interrupted cell
resumes from its last checkpoint (``--resume auto``, ``checkpoint.every``); a cell whose training finished
but whose evaluation did not is only evaluated. Cells run in priority order: N = 8, 64, 256 (``--first``)
with seed 0, then seed 1, then the fixed-width series at those N, then the other N; so a partial study
already answers the question at its three points.

Output, rebuilt from every finished cell: OUT/study.json, OUT/study.md (N x variant, seed means ± sd,
ratios to exact ``global`` at the same N, per-rank batch, extra traffic against the backbone gradient for
the study's backbone and for iresnet50, wall time) and OUT/study.png (all-pairs TAR@1e-3 against N). Paths
in them and in the cells' commands are relative to the repository root; nothing records an absolute path.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VARIANTS = {
    "local_bare": ["head.mode=local", "head.negatives_every=0"],
    "local": ["head.mode=local"],
    "global": ["head.mode=global"],
    "partialfc": ["head.mode=global", "head.sample_rate={rate}"],
    "local_sampled": ["head.mode=local", "head.sample_rate={rate}"],
}
IRESNET50 = ("iresnet50", 512, [112, 112, 3])    # the yardstick for the traffic budget


def rel(path: str) -> str:
    """``path`` relative to the repository root (what every command, config and table records)."""
    return os.path.relpath(os.path.abspath(path), ROOT)


@dataclass
class Cell:
    series: str                 # "all" (every class) or "fixed" (N x k shards: fixed classes per rank)
    variant: str
    n: int
    seed: int
    shards: str                 # shard set folder, relative to the repository root
    classes: int
    name: str = ""
    sets: List[str] = field(default_factory=list)


def plan(args, num_shards: int, prefix_classes) -> List[Cell]:
    """The cells in the order they run (priority first), each once. ``prefix_classes(m)``: the classes of
    the first m shards (and writes their subset manifest); m = ``num_shards`` is the whole set."""
    def cells_at(ns, seeds, series, variants):
        out = []
        for seed in seeds if variants else []:
            for n in ns:
                m = num_shards if series == "all" else n * args.fixed_shards_per_rank
                if series == "fixed" and (m > num_shards or m == num_shards):
                    continue                       # beyond the set, or the same cell as the "all" series
                shards, classes = prefix_classes(m)
                for v in variants:
                    out.append(Cell(series, v, n, seed, shards, classes))
        return out

    first = [n for n in args.ranks if n in args.first]
    rest = [n for n in args.ranks if n not in args.first]
    cells = []
    for group in (first, rest):
        for seed in args.seeds:
            cells += cells_at(group, [seed], "all", args.variants)
        cells += cells_at(group, args.seeds, "fixed", args.fixed_variants)
    for c in cells:
        if args.global_batch % c.n:
            raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of N = {c.n}")
        tag = "" if c.series == "all" else f"-{args.fixed_shards_per_rank}sh"
        c.name = f"{c.variant}-n{c.n}{tag}-seed{c.seed}"
        c.sets = [f"data.batch_size={args.global_batch // c.n}", f"train.seed={c.seed}",
                  f"checkpoint.every={args.checkpoint_every}", "checkpoint.keep=1", "eval.every=0",
                  f"train.log_every={args.log_every}"]
        c.sets += [s.format(rate=args.sample_rate) for s in VARIANTS[c.variant]] + list(args.set)
    return cells


def commands(args, c: Cell) -> Dict[str, List[str]]:
    """The cell's two commands (argument lists for ``python -m hvd_partialfc.cli``), paths relative to ROOT."""
    out = rel(os.path.join(args.out, c.name))
    train = ["simulate", "--ranks", str(c.n), "--config", rel(args.config), "--shards", c.shards, "--out", out,
             "--steps", str(args.steps), "--resume", "auto"]
    for s in c.sets:
        train += ["--set", s]
    ev = ["eval", "--backbone", out, "--all-pairs", rel(args.heldout), "--pairs", rel(args.pairs),
          "--out", os.path.join(out, "eval.tmp")]
    return {"train": train, "eval": ev}


def _cli(argv: List[str], log: Optional[str] = None) -> None:
    """Run ``hvd-partialfc ARGV`` from the repository root; its output goes to ``log`` (appended) or is kept
    for the error message. SIGTERM to this driver is passed on: the run checkpoints and exits 75 (as under a
    scheduler), and this driver stops with 75; the same command later resumes the cell."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "a") if log else open(os.devnull, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "hvd_partialfc.cli"] + argv, cwd=ROOT, env=env,
                                stdout=sink if log else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        old = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
        try:
            text = proc.communicate()[0] or ""
        finally:
            signal.signal(signal.SIGTERM, old)
    if proc.returncode == 75:
        print(f"`hvd-partialfc {argv[0]}` stopped at a checkpoint (signal); run the study again to resume",
              file=sys.stderr)
        raise SystemExit(75)
    if proc.returncode != 0:
        if log:
            text = open(log).read()
        raise SystemExit(f"`hvd-partialfc {' '.join(argv)}` failed (exit {proc.returncode}):\n{text[-4000:]}")


def run_cell(args, c: Cell) -> None:
    """Train (resuming), evaluate, then write done.json: the marker that the cell is finished."""
    out = os.path.join(args.out, c.name)
    cmd = commands(args, c)
    trained = os.path.join(out, "trained.json")
    if not os.path.isfile(trained):
        os.makedirs(out, exist_ok=True)
        sessions = os.path.join(out, "train_sessions.json")     # wall seconds of every session (resumes)
        t0 = time.time()
        try:
            _cli(cmd["train"], os.path.join(out, "train.log"))
        finally:
            past = json.load(open(sessions)) if os.path.isfile(sessions) else []
            _write(sessions, past + [round(time.time() - t0, 1)])
        past = json.load(open(sessions))
        _write(trained, {"train_s": sum(past), "train_sessions": len(past)})
    t0 = time.time()
    _cli(cmd["eval"])
    tmp = os.path.join(out, "eval.tmp")
    ev = json.load(open(os.path.join(tmp, "eval.json")))
    shutil.rmtree(tmp)              # its eval.json records absolute paths; keep the figures only
    pairs = next(iter(ev["sets"].values()))["backbone"]
    ap = next(iter(ev["all_pairs"].values()))
    figures = {"acc": pairs["acc"], "acc_std": pairs["acc_std"], "pairs_auc": pairs["auc"],
               "pairs_tar@far=1e-3": pairs.get("tar@far=1e-3"),
               "ap_auc": ap["auc"], "ap_tar@far=1e-3": ap.get("tar@far=1e-3"),
               "ap_tar@far=1e-4": ap.get("tar@far=1e-4"), "ap_pairs": ap["pairs"]}
    _write(os.path.join(out, "eval.json"), figures)
    done = {"cell": c.name, "series": c.series, "variant": c.variant, "n": c.n, "seed": c.seed,
            "shards": c.shards, "classes": c.classes, "steps": args.steps, "global_batch": args.global_batch,
            "per_rank_batch": args.global_batch // c.n, "data_sha256": args.data_sha256,
            "data_content_sha256": args.data_content_sha256, **json.load(open(trained)),
            "eval_s": time.time() - t0, "commands": {k: ["hvd-partialfc"] + v for k, v in cmd.items()}}
    _write(os.path.join(out, "done.json"), done)
    if args.keep:      # the finished cell's figures, kept in the repository: a later run skips the cell
        os.makedirs(args.keep, exist_ok=True)
        _write(os.path.join(args.keep, f"{c.name}.json"), {"done": done, "eval": figures})


def finished(args, c: Cell) -> Optional[Dict[str, dict]]:
    """(done, eval) of a finished cell: from OUT, or from the copy kept in ``--keep``; None if unfinished.
    A cell measured on other data (its recorded digest differs) stops the study: its figures cannot sit in
    one table with these. Compared: the digest of what the files hold where the cell records it, else that of
    the files' bytes (cells kept before 2026-12-02); cells kept before 2026-12-01 carry neither."""
    out = os.path.join(args.out, c.name)
    kept = os.path.join(args.keep, f"{c.name}.json") if args.keep else ""
    if os.path.isfile(os.path.join(out, "done.json")):
        cell, where = {"done": json.load(open(os.path.join(out, "done.json"))),
                       "eval": json.load(open(os.path.join(out, "eval.json")))}, os.path.join(out, "done.json")
    elif kept and os.path.isfile(kept):
        cell, where = json.load(open(kept)), kept
    else:
        return None
    key = "data_content_sha256" if "data_content_sha256" in cell["done"] else "data_sha256"
    recorded, here = cell["done"].get(key), getattr(args, key)
    if recorded is not None and recorded != here:
        raise SystemExit(f"{rel(where)} was measured on other data ({key} {recorded[:12]}..., this data "
                         f"{here[:12]}...): rebuild the data the cell names, or move the cell away")
    return cell


def _data_digest(args, of_shard, of_file) -> str:
    """sha256 over both manifests' class counts and label ranges, ``of_shard(folder, entry)`` of every shard
    and ``of_file(path)`` of the pair set: the two digests below differ only in these two."""
    import hashlib
    from hvd_partialfc.data.shards import read_manifest
    parts = []
    for d in (args.shards, args.heldout):
        m = read_manifest(d)
        parts.append([m.num_classes] + [[e.label_start, e.label_end, of_shard(d, e)] for e in m.shards])
    parts.append(of_file(args.pairs))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def data_sha256(args) -> str:
    """One digest of the data every figure depends on: the shard files' sha256 as the training and held-out
    manifests record them (the trainer checks its files against these with `data.verify_sha256`,
    `hvd-partialfc-shards inspect` any set's) and the bytes of the pair set."""
    from hvd_partialfc.data.shards import sha256_file
    return _data_digest(args, lambda d, e: e.sha256, sha256_file)


def data_content_sha256(args) -> str:
    """The same, of what the files hold (``shards.sha256_content``: the arrays, not the HDF5 encoding), so a
    rebuild of the same samples on another machine, whose file bytes differ (docs/evidence/data.md §4.1), is the same
    data. Cells record both; a cell with this digest is checked on it, an older one on its ``data_sha256``."""
    from hvd_partialfc.data.shards import sha256_content
    return _data_digest(args, lambda d, e: sha256_content(os.path.join(d, e.file)), sha256_content)


def _write(path: str, obj) -> None:
    from hvd_partialfc.atomic import write_text
    write_text(path, json.dumps(obj, indent=1) + "\n")


def collective_bytes(args, c: Cell, bb_params: int, dim: int) -> Dict[str, float]:
    """Bytes per step per rank through collectives, sent + received, above bare ``local``; and the backbone
    gradient's. Convention: an allreduce of S bytes hands in S and gets back S (2 S); an all-gather of s
    bytes per rank hands in s and gets back N x s ((N + 1) s). From `estimate.estimate`'s components, which
    count bytes handed in only: the negatives' centres are an all-gather of share x D x 4 every K steps;
    ``global``'s features and labels are all-gathers, its feature gradient and softmax statistics
    allreduces. The share is what a real run shares (``negatives.negatives_share``: negatives_share or W, capped
    at ceil(negatives_pool / N)), W = ceil(C / N)."""
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.tools.estimate import estimate
    h = load_config(args.config, c.sets, {"data": {"shards": c.shards}}).head
    kw = dict(classes=c.classes, world_size=c.n, dim=dim, batch=args.global_batch // c.n,
              bb={"params": bb_params, "activation_bytes": 0})
    est = estimate(mode=h.mode, negatives_every=h.negatives_every if h.mode == "local" else 0,
                   negatives_share=h.negatives_share, negatives_pool=h.negatives_pool, sample_rate=h.sample_rate,
                   **kw)
    gather = ("features (allgather)", "labels (allgather)", "centres (allgather, amortised)")
    extra = sum(v * ((c.n + 1) if k in gather else 2) for k, v in est["traffic_bytes"].items()
                if k != "backbone gradient")
    grad = 2 * est["traffic_bytes"]["backbone gradient"]
    return {"extra_bytes_per_step": extra, "backbone_grad_bytes": grad, "extra_vs_grad": extra / grad}


def load_rows(args, cells: List[Cell], bb: Dict[str, int]) -> List[dict]:
    rows = []
    for c in cells:
        cell = finished(args, c)
        if cell is None:
            continue
        row = {k: v for k, v in cell["done"].items() if k != "commands"}
        row.update(cell["eval"])
        row["classes_per_rank"] = -(-c.classes // c.n)
        demo = collective_bytes(args, c, bb["study"], bb["dim"])
        big = collective_bytes(args, c, bb["iresnet50"], IRESNET50[1])
        row.update({"extra_bytes_per_step": demo["extra_bytes_per_step"], "extra_vs_grad": demo["extra_vs_grad"],
                    "iresnet50_extra_bytes_per_step": big["extra_bytes_per_step"],
                    "iresnet50_extra_vs_grad": big["extra_vs_grad"]})
        rows.append(row)
    return rows


def shared_endpoints(args, rows: List[dict], num_shards: int) -> List[dict]:
    """The fixed series' cell where N x ``--fixed-shards-per-rank`` is every shard is the whole-set cell (run
    once, under the *all* series): its rows again, as the fixed series' end point."""
    k = args.fixed_shards_per_rank
    return [dict(r, series="fixed", same_cell_as_all=True) for r in rows
            if r["series"] == "all" and r["variant"] in args.fixed_variants and r["n"] * k == num_shards]


def summarise(rows: List[dict]) -> List[dict]:
    """Seed means ± sd per (series, N, variant), and ratios to exact ``global`` of the same series and N."""
    import numpy as np
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["series"], r["n"], r["variant"]), []).append(r)
    metrics = ("ap_tar@far=1e-3", "ap_tar@far=1e-4", "acc")
    table = []
    for (series, n, v), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "all", kv[0][1],
                                                                       list(VARIANTS).index(kv[0][2]))):
        s = {"series": series, "n": n, "variant": v, "seeds": sorted(r["seed"] for r in rs),
             "classes": rs[0]["classes"], "classes_per_rank": rs[0]["classes_per_rank"],
             "per_rank_batch": rs[0]["per_rank_batch"], "train_s_mean": float(np.mean([r["train_s"] for r in rs])),
             "eval_s_mean": float(np.mean([r["eval_s"] for r in rs])),
             "same_cell_as_all": bool(rs[0].get("same_cell_as_all"))}
        for k in ("extra_vs_grad", "iresnet50_extra_vs_grad", "extra_bytes_per_step", "iresnet50_extra_bytes_per_step"):
            s[k] = rs[0][k]
        g = groups.get((series, n, "global"))
        for m in metrics:
            vals = [r[m] for r in rs if r[m] is not None]
            s[m] = float(np.mean(vals)) if vals else None
            s[m + "_sd"] = float(np.std(vals)) if len(vals) > 1 else None
            gv = [r[m] for r in g if r[m] is not None] if g else []
            s[m + "_vs_global"] = s[m] / float(np.mean(gv)) if vals and gv and np.mean(gv) else None
        table.append(s)
    return table


def write_outputs(args, table: List[dict], rows: List[dict], cells: List[Cell]) -> None:
    settings = {"config": rel(args.config), "shards": rel(args.shards), "heldout": rel(args.heldout),
                "pairs": rel(args.pairs), "steps": args.steps, "global_batch": args.global_batch,
                "sample_rate": args.sample_rate, "fixed_shards_per_rank": args.fixed_shards_per_rank,
                "set": list(args.set), "cells_planned": len(cells), "cells_done": len(rows)}
    _write(os.path.join(args.out, "study.json"), {"settings": settings, "table": table, "cells": rows})

    def f(x, sd=None):
        return "–" if x is None else f"{x:.4f}" + (f" ±{sd:.4f}" if sd is not None else "")

    def ratio(x):
        return "–" if x is None else f"{x:.3f}"
    lines = [f"Scale study: {settings['cells_done']} of {settings['cells_planned']} cells finished; "
             f"{args.steps} steps, global batch {args.global_batch}, config `{settings['config']}`, "
             f"train `{settings['shards']}`, held-out `{settings['heldout']}` (all pairs) and `{settings['pairs']}`.",
             "Series *all*: every class; *fixed*: the first N x "
             f"{args.fixed_shards_per_rank} shards (classes per rank fixed while N grows; *fixed = all*: at that N "
             f"the first N x {args.fixed_shards_per_rank} shards are every shard, the *all* cell again). Seed means ± sd; "
             "vs global: the ratio to exact `global` of the same series and N. Extra traffic: bytes sent + "
             "received per rank and step above bare `local` (an all-gather receives N shares), against the "
             "backbone gradient's allreduce (sent + received), for this backbone and for iresnet50 (D = 512).", "",
             "| series | N | classes/rank | per-rank batch | variant | seeds | all-pairs TAR@1e-3 | all-pairs TAR@1e-4 "
             "| 10-fold acc | vs global: TAR@1e-3 / TAR@1e-4 / acc | extra traffic vs grad (this / iresnet50) "
             "| train min | eval min |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in table:
        lines.append(
            f"| {s['series'] + (' = all' if s['same_cell_as_all'] else '')} | {s['n']} | {s['classes_per_rank']} | {s['per_rank_batch']} | {s['variant']} | "
            f"{','.join(map(str, s['seeds']))} | {f(s['ap_tar@far=1e-3'], s['ap_tar@far=1e-3_sd'])} | "
            f"{f(s['ap_tar@far=1e-4'], s['ap_tar@far=1e-4_sd'])} | {f(s['acc'], s['acc_sd'])} | "
            f"{ratio(s['ap_tar@far=1e-3_vs_global'])} / {ratio(s['ap_tar@far=1e-4_vs_global'])} / "
            f"{ratio(s['acc_vs_global'])} | {s['extra_vs_grad']:.2%} / {s['iresnet50_extra_vs_grad']:.2%} | "
            f"{s['train_s_mean'] / 60:.1f} | {s['eval_s_mean'] / 60:.1f} |")
    from hvd_partialfc.atomic import write_text
    write_text(os.path.join(args.out, "study.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(args, table)


def plot(args, table: List[dict]) -> None:
    """Left: held-out all-pairs TAR@1e-3 against N per variant and series; right: its ratio to exact
    ``global`` of the same series and N (the study's question), with the 99% goal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(11, 4.5))
    for series, ls in (("all", "-"), ("fixed", ":")):
        for i, v in enumerate(VARIANTS):
            pts = [s for s in table if s["series"] == series and s["variant"] == v and s["ap_tar@far=1e-3"] is not None]
            if not pts:
                continue
            label = v + (" (fixed classes/rank)" if series == "fixed" else "")
            style = dict(marker="o", ls=ls, color=f"C{i}", label=label)
            ax.errorbar([s["n"] for s in pts], [s["ap_tar@far=1e-3"] for s in pts],
                        yerr=[s["ap_tar@far=1e-3_sd"] or 0 for s in pts], capsize=3, **style)
            pts = [s for s in pts if s["ap_tar@far=1e-3_vs_global"] is not None]
            if v != "global" and pts:
                rx.plot([s["n"] for s in pts], [s["ap_tar@far=1e-3_vs_global"] for s in pts], **style)
    rx.axhline(0.99, color="k", lw=0.8, ls="--", label="goal: 99% of global")
    for a, y in ((ax, "held-out all-pairs TAR@FAR=1e-3"), (rx, "TAR@FAR=1e-3 / global's (same series and N)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("ranks N")
        a.set_ylabel(y)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.suptitle(f"{args.steps} steps, global batch {args.global_batch}; seed means (left: ± sd)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "study.png"), dpi=110)
    plt.close(fig)


@functools.lru_cache(maxsize=None)
def _params(name: str, dim: int, in_shape: tuple, kwargs: str) -> int:
    from hvd_partialfc.models import create_model
    model = create_model(name, in_shape=list(in_shape), embedding_dim=dim, **json.loads(kwargs))
    return sum(p.numel() for p in model.parameters())


def backbone_params(args) -> Dict[str, int]:
    """Parameter counts of the study's backbone and of iresnet50 (the traffic yardsticks)."""
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.data.shards import read_manifest
    cfg = load_config(args.config, list(args.set), {"data": {"shards": rel(args.shards)}})
    shape = tuple(read_manifest(args.shards).sample_shape)
    return {"study": _params(cfg.model.name, cfg.model.embedding_dim, shape, json.dumps(cfg.model.kwargs)),
            "iresnet50": _params(IRESNET50[0], IRESNET50[1], tuple(IRESNET50[2]), "{}"),
            "dim": cfg.model.embedding_dim}


def parse(argv: Optional[List[str]] = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", required=True, help="training shard set (e.g. data/cjk-20k/train)")
    p.add_argument("--heldout", required=True, help="held-out shard set: every pair is verified")
    p.add_argument("--pairs", required=True, help="held-out pair set (.h5): 10-fold accuracy")
    p.add_argument("--out", default="runs/scale")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256],
                   help="N of the study (the second phase adds 32 128: --ranks 8 64 256 32 128)")
    p.add_argument("--first", type=int, nargs="+", default=[8, 64, 256], help="these N run first")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--fixed-variants", nargs="*", default=["local_bare", "local", "global"], choices=list(VARIANTS),
                   help="variants of the fixed classes-per-rank series (none: no such series)")
    p.add_argument("--fixed-shards-per-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--sample-rate", type=float, default=0.1, help="partialfc and local_sampled")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (resume)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every cell (keep one OUT per setting)")
    p.add_argument("--keep", default="docs/accuracy/scale/cells",
                   help="folder (in the repository) where each finished cell's figures are copied; a cell found "
                        "there is finished, so the study continues across sessions and machines ('': off)")
    p.add_argument("--max-cells", type=int, default=0, help="run at most K unfinished cells, then stop (0: all)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their commands; run nothing")
    p.add_argument("--report-only", action="store_true", help="only rebuild study.json / .md / .png")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    from data_tools.subset import write_prefix_subset
    from hvd_partialfc.data.shards import read_manifest
    src = read_manifest(args.shards)
    os.makedirs(args.out, exist_ok=True)
    args.data_sha256, args.data_content_sha256 = data_sha256(args), data_content_sha256(args)

    def prefix_classes(m: int):
        if m == src.num_shards:
            return rel(args.shards), src.num_classes
        d = os.path.join(args.out, "subsets", f"first-{m}-shards")
        if args.dry_run and not os.path.isfile(os.path.join(d, "manifest.json")):
            return rel(d), src.shards[m - 1].label_end
        return rel(d), write_prefix_subset(args.shards, d, m).num_classes

    cells = plan(args, src.num_shards, prefix_classes)
    todo = [c for c in cells if finished(args, c) is None]
    if args.dry_run:
        for i, c in enumerate(cells):
            state = "todo" if c in todo else "done"
            cmd = commands(args, c)
            print(f"{i + 1:>3} [{state}] {c.name}: {c.classes} classes, {-(-c.classes // c.n)}/rank, "
                  f"batch {args.global_batch // c.n}/rank\n      hvd-partialfc {' '.join(cmd['train'])}\n"
                  f"      hvd-partialfc {' '.join(cmd['eval'])}")
        print(f"{len(cells)} cells, {len(todo)} to run")
        return 0
    if not args.report_only:
        for c in todo[: args.max_cells or None]:
            t0 = time.time()
            run_cell(args, c)
            print(f"{c.name}: done in {(time.time() - t0) / 60:.1f} min", flush=True)
    rows = load_rows(args, cells, backbone_params(args))
    write_outputs(args, summarise(rows + shared_endpoints(args, rows, src.num_shards)), rows, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
