"""What a person reads: text tables for the terminal, ROC plots, and where ``eval`` writes.

Every protocol's result dict comes in and text or a PNG goes out; nothing here computes a figure.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Sequence

import numpy as np

from .metrics import FARS, far_key

BASELINE_LABELS = {"backbone": "trained backbone", "pixels": "raw pixels",
                   "pixels_ncc": "raw pixels, centred (NCC)", "random_init": "random-init backbone"}


def format_table(name: str, rows: Dict[str, Dict[str, Any]], fars: Sequence[float] = FARS) -> str:
    """A plain-text table of one pair set: one row per model/baseline, ``-`` where a TAR is undefined."""
    first = next(iter(rows.values()))
    head = (f"{name}: {first['pairs']} pairs ({first['same_pairs']} same, {first['different_pairs']} different)")
    tar_heads = "".join(f"{far_key(f).replace('tar@far=', 'TAR@'):>12}" for f in fars)
    cols = f"{'model':<28}{'acc (10-fold)':>18}{'AUC':>9}{tar_heads}{'threshold':>11}"
    lines = [head, cols]
    for key, m in rows.items():
        tars = "".join(f"{m[far_key(f)]:>12.4f}" if m[far_key(f)] is not None else f"{'-':>12}" for f in fars)
        thr = f"{m['best_threshold']:>11.4f}" if m["best_threshold"] is not None else f"{'-':>11}"
        acc = f"{m['acc']:.4f} ± {m['acc_std']:.4f}"
        lines.append(f"{BASELINE_LABELS.get(key, key):<28}{acc:>18}{m['auc']:>9.4f}{tars}{thr}")
    for key, reason in first["notes"].items():   # a FAR too fine for the set (None), or TAR 0 and why
        lines.append(f"  {key}: {'not reported, ' if first[key] is None else ''}{reason}")
    return "\n".join(lines)


def format_all_pairs(shard_dir: str, m: Dict[str, Any]) -> str:
    """One line per FAR of `all_pairs_metrics`, for the terminal."""
    lines = [f"all pairs of {shard_dir}: {m['samples']} samples, {m['same_pairs']:,} same-class and "
             f"{m['different_pairs']:,} different-class pairs, AUC {m['auc']:.4f}"]
    for key in sorted((k for k in m if k.startswith("tar@far=")), key=lambda k: -float(k[8:])):
        lines.append(f"  {key:<14} {'-' if m[key] is None else f'{m[key]:.4f}'}  {m['notes'].get(key, '')}")
    return "\n".join(lines)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def format_ijb(m: Dict[str, Any]) -> str:
    """The IJB 1:1 table: one row of TAR at each FAR (``-`` where too few different pairs), AUC, counts,
    the options that were on, and the throughput."""
    keys = sorted((k for k in m if k.startswith("tar@far=")), key=lambda k: float(k[8:]))
    lines = [f"{m['name']} 1:1 verification ({m['root']}): {m['images']:,} images, {m['templates']:,} templates, "
             f"{m['pairs']:,} template pairs ({m['same_pairs']:,} same, {m['different_pairs']:,} different)",
             f"  flip {_on_off(m['flip'])}, norm-score {_on_off(m['norm_score'])}, detector-score "
             f"{_on_off(m['detector_score'])}; aligned to {m['in_shape']}; {m['images_per_s']:,.0f} images/s, "
             f"{m['time_s']:.1f} s",
             "".join(f"{k.replace('tar@far=', 'TAR@'):>11}" for k in keys) + f"{'AUC':>9}",
             "".join(f"{'-' if m[k] is None else format(m[k], '.4f'):>11}" for k in keys) + f"{m['auc']:>9.4f}"]
    for key, reason in m["notes"].items():
        lines.append(f"  {key}: {'not reported, ' if m[key] is None else ''}{reason}")
    return "\n".join(lines)


def format_identification(shard_dir: str, m: Dict[str, Any]) -> str:
    """The 1:N figures of one shard set on two lines."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"
    tp = ", ".join(f"{k.replace('tpir@fpir=', 'TPIR@FPIR=')} {f(m[k])}" for k in m if k.startswith("tpir@fpir="))
    lines = [f"identification (1:N) on {shard_dir}: gallery {m['gallery']:,} classes, {m['mated_probes']:,} mated "
             f"and {m['nonmated_probes']:,} non-mated probes (seed {m['seed']})",
             f"  rank-1 {f(m.get('rank1'))}, rank-5 {f(m.get('rank5'))}, {tp}"]
    for key, reason in m["notes"].items():
        lines.append(f"  {key}: not reported, {reason}")
    return "\n".join(lines)


def plot_roc(results: Dict[str, Dict[str, Dict[str, Any]]], path: str) -> str:
    """One panel per pair set, one step curve per model/baseline, log-scale FAR axis; written to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(results)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 4.2 * rows), squeeze=False)
    for ax, (set_name, models) in zip(axes.flat, results.items()):
        lo = 1.0
        for key, m in models.items():
            far, tar = np.asarray(m["roc"]["far"]), np.asarray(m["roc"]["tar"])
            lo = min(lo, 1.0 / max(m["different_pairs"], 1))
            ax.plot(np.maximum(far, lo / 2), tar, drawstyle="steps-post",
                    label=f"{BASELINE_LABELS.get(key, key)} (AUC {m['auc']:.3f})")
        ax.plot([lo / 2, 1.0], [lo / 2, 1.0], ls="--", color="grey", lw=0.8, label="chance")
        ax.set_xscale("log")
        ax.set_xlim(lo / 2, 1.0)
        ax.set_ylim(0.0, 1.01)
        ax.set_xlabel("false accept rate (log)")
        ax.set_ylabel("true accept rate")
        ax.set_title(f"ROC: {set_name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def default_out_dir(backbone: str) -> str:
    """Where ``eval`` writes when no ``--out`` is given: the run/checkpoint folder, or beside the file."""
    return backbone if os.path.isdir(backbone) else (os.path.dirname(os.path.abspath(backbone)))

