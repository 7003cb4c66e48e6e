#!/usr/bin/env python
"""Does `hvd-partialfc simulate` predict a real run's held-out accuracy? One table from two
`scripts/studies/accuracy.py` outputs, the real runs (horovodrun) and the same cells on the simulator (--simulate):

    .venv/bin/python -m scripts.studies.accuracy --shards data/demo-fonts/train --pairs data/demo-fonts/pairs.h5 \
        --heldout data/demo-fonts/heldout --out runs/simacc --np 8 4 --seeds 0 1 --every 50 --share 1024 \
        --simulate
    .venv/bin/python -m scripts.studies.sim_vs_real docs/accuracy/accuracy.json runs/simacc/accuracy.json

For each (variant, N, seed) present in both: the real and simulated all-pairs TAR at FAR 1e-3 / 1e-4 and
10-fold accuracy, their difference, and, where the real runs have two seeds, the seed-to-seed difference
of the real runs, the noise the simulator's error is to be judged against. Writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys

METRICS = (("ap_tar@far=1e-3", "all-pairs TAR@1e-3"), ("ap_tar@far=1e-4", "all-pairs TAR@1e-4"),
           ("acc", "10-fold acc"))


def key(row: dict) -> tuple:
    # accuracy.py names a negatives run by its share, and calls a share >= the slice "all" (0)
    return row["variant"], row["np"], row.get("every", 0), row.get("share", 0), row["seed"]


def table(real: list, sim: list) -> str:
    by_real, by_sim = {key(r): r for r in real}, {key(r): r for r in sim}
    both = sorted(set(by_real) & set(by_sim), key=lambda k: (-k[1], k[0], k[4]))
    head = "| variant | N | seed | " + " | ".join(f"{t}: real / sim / diff" for _, t in METRICS) + \
           " | real seed 0 vs 1 (TAR@1e-3) |"
    lines = [head, "|" + "---|" * (4 + len(METRICS))]
    diffs = []
    for k in both:
        r, s = by_real[k], by_sim[k]
        cells = []
        for m, _ in METRICS:
            cells.append(f"{r[m]:.4f} / {s[m]:.4f} / {s[m] - r[m]:+.4f}")
        other = by_real.get(k[:4] + (1 - k[4],)) if k[4] in (0, 1) else None
        noise = f"{abs(r['ap_tar@far=1e-3'] - other['ap_tar@far=1e-3']):.4f}" if other else "–"
        diffs.append(abs(s["ap_tar@far=1e-3"] - r["ap_tar@far=1e-3"]))
        lines.append(f"| {k[0]} | {k[1]} | {k[4]} | " + " | ".join(cells) + f" | {noise} |")
    if diffs:
        lines.append("")
        lines.append(f"{len(diffs)} cells; |sim - real| all-pairs TAR@1e-3: mean {sum(diffs) / len(diffs):.4f}, "
                     f"max {max(diffs):.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("real", help="accuracy.json of the real (horovodrun) runs")
    p.add_argument("sim", help="accuracy.json of the same cells run with --simulate")
    a = p.parse_args(argv)
    real, sim = (json.load(open(f))["rows"] for f in (a.real, a.sim))
    print(table(real, sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
