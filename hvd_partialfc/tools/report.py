"""The demo report: what a person reads after ``make demo`` (``RUN/report.md`` and its PNGs).

It gathers what the run already wrote (``metrics.jsonl``, ``eval.jsonl``, ``info``, the final
``eval.json`` with baselines and ``roc.png``) and adds two figures: the training curves, and a grid of
held-out pairs with their scores (true/false accepts and rejects at the best threshold), so a person sees
what the model gets right and wrong. No Horovod here.

    python -m hvd_partialfc.tools.report RUN --pairs PAIRS.h5 [--eval-dir RUN/eval]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import numpy as np


def _read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(run: str, out: str) -> Optional[str]:
    """Loss (mean over ranks) and held-out verification accuracy / TAR@FAR=1e-3 against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metrics = [m for m in _read_jsonl(os.path.join(run, "metrics.jsonl")) if "loss" in m]
    evals = [e for e in _read_jsonl(os.path.join(run, "eval.jsonl")) if "error" not in e]   # failed: no figures
    if not metrics:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2)
    a.set_xlabel("step")
    a.set_ylabel("training loss (mean over ranks)")
    a.set_title("loss")
    a.grid(alpha=0.3)
    for name in sorted({e["set"] for e in evals}):
        rows = [e for e in evals if e["set"] == name]
        b.plot([e["step"] for e in rows], [e["acc"] for e in rows], marker="o", label=f"{name}: 10-fold acc")
        tar = [(e["step"], e.get("tar@far=1e-3")) for e in rows if e.get("tar@far=1e-3") is not None]
        if tar:
            b.plot(*zip(*tar), marker="s", label=f"{name}: TAR@FAR=1e-3")
    b.set_xlabel("step")
    b.set_ylim(0, 1.01)
    b.set_title("held-out verification during training")
    b.grid(alpha=0.3)
    if evals:
        b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def pair_grid(backbone: str, pairs_path: str, threshold: float, out: str, per_kind: int = 6,
              seed: int = 0) -> Dict[str, int]:
    """A grid of held-out pairs in four rows: true accepts, false rejects, false accepts, true rejects.

    Within each kind the hardest examples are shown (scores nearest the threshold for correct decisions,
    farthest for errors), so the picture shows where the model fails, not only easy wins.
    Returns the count of each kind over the whole set.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from ..verification.embedding import score_pairs
    from ..models.pretrained import load_backbone
    from ..data.pair_files import read_pairs
    model, _ = load_backbone(backbone)
    ps = read_pairs(pairs_path)
    scores = score_pairs(model, ps)
    accept = scores >= threshold
    kinds = [("true accept (same, accepted)", ps.same & accept, -1),
             ("false reject (same, rejected)", ps.same & ~accept, 1),
             ("false accept (different, accepted)", ~ps.same & accept, -1),
             ("true reject (different, rejected)", ~ps.same & ~accept, 1)]
    fig, axes = plt.subplots(len(kinds), per_kind, figsize=(1.9 * per_kind, 1.35 * len(kinds) + 0.6), squeeze=False)
    counts = {}
    for row, (title, mask, order) in enumerate(kinds):
        idx = np.flatnonzero(mask)
        counts[title.split(" (")[0]] = int(len(idx))
        # errors: the most confident mistakes; correct: the closest calls
        key = np.abs(scores[idx] - threshold)
        pick = idx[np.argsort(-key if title.startswith(("false",)) else key, kind="stable")[:per_kind]]
        for col in range(per_kind):
            ax = axes[row, col]
            ax.axis("off")
            if col >= len(pick):
                continue
            i = pick[col]
            left, right = ps.images[ps.left[i]], ps.images[ps.right[i]]
            ax.imshow(np.concatenate([left, np.full_like(left[:, :4], 255), right], axis=1), cmap="gray",
                      vmin=0, vmax=255)
            ax.set_title(f"{scores[i]:.2f}", fontsize=8, color="green" if title.startswith("true") else "red")
        axes[row, 0].text(-0.05, 0.5, title.split(" (")[0], transform=axes[row, 0].transAxes, ha="right",
                          va="center", fontsize=8)
    fig.suptitle(f"held-out pairs, cosine scores; threshold {threshold:.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return counts


def _fmt(v: Any, digits: int = 4) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pairs_table(rows: Dict[str, Dict[str, Any]]) -> List[str]:
    """The pair set's table: the trained backbone beside its baselines, and why a figure is missing."""
    model = rows["backbone"]
    lines = [f"Open-set verification on **{model['pairs']} held-out pairs** ({model['same_pairs']} same, "
             f"{model['different_pairs']} different) of characters that never entered training.", ""]
    labels = {"backbone": "trained backbone", "pixels": "baseline: raw pixels",
              "pixels_ncc": "baseline: raw pixels, mean-centred", "random_init": "baseline: same backbone, random init"}
    lines += ["| model | 10-fold acc | AUC | TAR@FAR=1e-2 | TAR@FAR=1e-3 | TAR@FAR=1e-4 | threshold |",
              "|---|---|---|---|---|---|---|"]
    for key, m in rows.items():
        lines.append(f"| {labels.get(key, key)} | {m['acc']:.4f} ± {m['acc_std']:.4f} | {m['auc']:.4f} | "
                     f"{_fmt(m.get('tar@far=1e-2'))} | {_fmt(m.get('tar@far=1e-3'))} | {_fmt(m.get('tar@far=1e-4'))} | "
                     f"{_fmt(m.get('best_threshold'))} |")
    for key, reason in model.get("notes", {}).items():
        lines.append(f"\n{key}: not reported, {reason}.")
    return lines


def _protocol_lines(ev: Dict[str, Any]) -> List[str]:
    """A paragraph for each other protocol the eval ran: all pairs, IJB-style templates, 1:N identification."""
    lines: List[str] = []
    for shard_dir, m in ev.get("all_pairs", {}).items():   # `eval --all-pairs`: every pair of the set
        lines += ["", f"Every pair of the **{m['samples']:,} held-out samples** ({m['same_pairs']:,} same, "
                  f"{m['different_pairs']:,} different; `{shard_dir}`), trained backbone: AUC {m['auc']:.4f}, "
                  + ", ".join(f"{k.replace('tar@far=', 'TAR@FAR=')} {_fmt(v)}" for k, v in m.items()
                              if k.startswith("tar@far=")) + "."]
    for name, m in ev.get("ijb", {}).items():              # `eval --ijb`: the IJB-shaped glyph set
        opts = ", ".join(f"{k.replace('_', '-')} {'on' if m[k] else 'off'}" for k in ("flip", "norm_score", "detector_score"))
        lines += ["", f"{name}-style 1:1 template verification ({m['templates']:,} templates of {m['images']:,} loose "
                  f"crops, five-point aligned; {m['same_pairs']:,} same and {m['different_pairs']:,} different template "
                  f"pairs; {opts}): AUC {m['auc']:.4f}, "
                  + ", ".join(f"{k.replace('tar@far=', 'TAR@FAR=')} {_fmt(v)}" for k, v in m.items()
                              if k.startswith("tar@far=") and v is not None) + ".",
                  "", f"![{name} ROC](eval/roc-{name.lower()}.png)"]
    for shard_dir, m in ev.get("identification", {}).items():   # `eval --identification`
        lines += ["", f"1:N identification ({m['gallery']:,} gallery classes, {m['mated_probes']:,} mated and "
                  f"{m['nonmated_probes']:,} non-mated probes): rank-1 {_fmt(m['rank1'])}, rank-5 {_fmt(m['rank5'])}, "
                  + ", ".join(f"{k.replace('tpir@fpir=', 'TPIR@FPIR=')} {_fmt(v)}" for k, v in m.items()
                              if k.startswith("tpir@fpir=")) + "."]
    return lines


def _data_line(info: Dict[str, Any]) -> str:
    """The shard set the run trained on, from its checkpoint's config; a report is still written without it."""
    from ..data.shards import read_manifest
    try:
        m = read_manifest(info["checkpoint"] and json.load(open(os.path.join(info["checkpoint"], "meta.json")))["config"]["data"]["shards"])
        data_line = f"{m.num_classes} classes, {m.num_samples} samples ({m.kind} {m.sample_shape}), {m.num_shards} shards"
        src = m.source or {}
        if "faces_used" in src:
            data_line += f"; rendered from {src['faces_used']} font faces of {src.get('families_used', '?')} families"
    except Exception:
        data_line = "(shard set not found)"
    return data_line


def _run_lines(run: str, info: Dict[str, Any], extra: Optional[Dict[str, Any]]) -> List[str]:
    """The Run section: data, ranks and their slices, digests, steps, final loss, throughput, the notes."""
    metrics = [m for m in _read_jsonl(os.path.join(run, "metrics.jsonl")) if "loss" in m]
    data_line = _data_line(info)
    lines = ["## Run", "", f"* data: {data_line}",
             f"* world size {info['world_size']}, label slices " + ", ".join(
                 f"[{r['label_start']}, {r['label_end']})" for r in info["ranks"]),
             f"* backbone digests agree on all ranks: {info['digests_agree']} (`{info['ranks'][0]['digest'][:16]}`)",
             f"* steps {info['step']}; final loss {_fmt(metrics[-1]['loss'] if metrics else None, 3)}; "
             f"throughput {_fmt(np.median([m['samples_per_s'] for m in metrics]) if metrics else None, 0)} samples/s (median, all ranks)"]
    for k, v in (extra or {}).items():
        lines.append(f"* {k}: {v}")
    return lines


def write_report(run: str, pairs_path: str, eval_dir: str, extra: Optional[Dict[str, Any]] = None) -> str:
    from .export import run_summary
    info = run_summary(run)
    ev = json.load(open(os.path.join(eval_dir, "eval.json")))
    cfg_text = open(os.path.join(run, "config.yaml")).read()
    lines = ["# hvd_partialfc demo report", ""]
    rows = next(iter(ev["sets"].values()))
    model = rows["backbone"]
    lines += _pairs_table(rows)
    lines += _protocol_lines(ev)
    lines += ["", "![ROC](eval/roc.png)", ""]
    curves = plot_curves(run, os.path.join(run, "curves.png"))
    if curves:
        lines += ["## Training", "", "![loss and held-out accuracy](curves.png)", ""]
    counts = pair_grid(run, pairs_path, model["best_threshold"], os.path.join(run, "pairs.png"))
    lines += ["## What the model gets right and wrong", "",
              "Rows: true accepts (hardest correct same pairs), false rejects and false accepts (most confident "
              "mistakes), true rejects (hardest correct different pairs). Counts over the whole set: "
              + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".", "", "![pairs](pairs.png)", ""]
    lines += _run_lines(run, info, extra)
    lines += ["", "<details><summary>config</summary>", "", "```yaml", cfg_text.strip(), "```", "</details>", ""]
    path = os.path.join(run, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_partialfc.tools.report", description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--pairs", required=True)
    p.add_argument("--eval-dir", help="folder of eval.json / roc.png (default RUN/eval)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE", help="extra line in the Run section")
    args = p.parse_args(argv)
    extra = dict(n.split("=", 1) for n in args.note)
    path = write_report(args.run, args.pairs, args.eval_dir or os.path.join(args.run, "eval"), extra)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
