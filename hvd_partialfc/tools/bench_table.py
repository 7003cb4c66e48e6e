"""The benchmark's outputs (bench.py): its markdown table (under it, with more than one engine, the torch / horovod
ratios) and its plot of throughput and peak RSS against the class count."""
from __future__ import annotations

from typing import Any, Dict, Optional

from .bench_engines import NO_ENGINE, ratios_markdown

PHASES = ("data", "forward", "backward", "comm", "optimizer")   # how a step's seconds are split (bench.py)


def markdown(result: Dict[str, Any]) -> str:
    """The points' table; under it, with more than one engine, the torch / horovod ratios."""
    rows = ["| D | classes | mode | rate | engine | samples/s/rank | x limit | local / this | step ms: data / fwd / "
            "bwd / comm / opt | logits/step | MB sent/step | peak RSS MB | estimate |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        head = (f"| {p['dim']} | {p['classes']:,} | {p['mode']} | {p.get('sample_rate', 1.0):g} | "
                f"{p.get('engine', 'horovod')} |")
        if "skipped" in p:
            rows.append(f"{head} skipped: {p['skipped']} | | | | | | | |")
            continue
        sp = " / ".join(f"{p['split_s'][k] * 1e3:.1f}" for k in PHASES)
        logits = p.get("logits_per_step")
        rows.append(f"{head} {p['samples_per_s']:.1f} | "
                    f"{_fmt(p.get('vs_limit'))} | {_fmt(p.get('local_vs_this'))} | {sp} | "
                    f"{'' if logits is None else f'{logits:,}'} | "
                    f"{p['bytes_per_step'] / 2 ** 20:.3f} | {p['peak_rss'] / 2 ** 20:.0f} | "
                    f"{p['estimate_err']:+.1%} |")
    ratios = ratios_markdown(result.get("engine_ratios") or [])
    return "\n".join(rows) + ("\n\n" + ratios if ratios else "")


def _fmt(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.2f}"


def plot(result: Dict[str, Any], path: str) -> None:
    """Throughput and peak RSS against the class count, one line per (mode, engine, D); torch's squares."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    pts = [p for p in result["points"] if "skipped" not in p]
    colors = {"limit": "tab:green", "local": "tab:blue", "global": "tab:orange", "replicated": "tab:red",
              "negatives": "tab:purple"}
    for mode, engine in sorted({(p["mode"], p.get("engine", "horovod")) for p in pts}):
        for dim in sorted({p["dim"] for p in pts}):
            sel = sorted((p for p in pts if (p["mode"], p.get("engine", "horovod"), p["dim"]) == (mode, engine, dim)),
                         key=lambda p: p["classes"])
            if not sel:
                continue
            xs = [p["classes"] for p in sel]
            style = "-" if dim == min(p["dim"] for p in pts) else "--"
            kw = dict(marker="s" if engine == "torch" else "o", color=colors.get(mode),
                      label=f"{mode} D={dim}" + ("" if engine == NO_ENGINE else f" {engine}"))
            axes[0].plot(xs, [p["samples_per_s"] for p in sel], style, **kw)
            axes[1].plot(xs, [p["peak_rss"] / 2 ** 30 for p in sel], style, **kw)
    for ax, ylabel in zip(axes, ("samples / s per rank", "peak RSS per rank (GB)")):
        ax.set_xscale("log"), ax.set_yscale("log"), ax.set_xlabel("classes"), ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"np={result['np']}, batch {result['batch']}/rank, backbone {result['backbone']}, 1 thread/rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
