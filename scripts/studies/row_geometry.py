#!/usr/bin/env python
"""How far apart a trained run's class centres are: cosines between classifier rows, within a rank's slice
and over all rows, from a run's checkpoint (every rank's classifier file).

Used by the scale study (docs/evidence/accuracy.md, "At 64-256 ranks") to see what sampled ``local`` at 97 classes a
rank does to its slices' centres: a row is pushed away from other classes only when it is scored, and at
r = 0.1 of 97 rows a row is a scored negative in about 5 of 97 steps, by the rank's 4 samples.

    python -m scripts.studies.row_geometry runs/scale/local-n256-seed1 runs/scale/local_sampled-n256-seed1 \
        --json runs/row_geometry.json

Per run (its latest checkpoint, or a checkpoint folder): the rows' mean norm; within a slice, the mean
cosine over pairs of distinct rows and the mean over rows of the cosine to the nearest other row of the
slice; over all rows, the mean cosine to the nearest other row (of ``--sample`` rows drawn with seed 0
against all of them). Centres that stay bunched within a slice show as cosines near 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from hvd_partialfc.atomic import write_text  # noqa: E402
from hvd_partialfc.run_files import load_file, read_meta, resolve_checkpoint  # noqa: E402


def slice_weights(ckpt_dir: str) -> List[torch.Tensor]:
    """Every rank's classifier weight (W_r, D), in slice order, as float32."""
    meta = read_meta(ckpt_dir)
    return [load_file(os.path.join(ckpt_dir, name), "classifier checkpoint")["weight"].float()
            for name in meta["classifier_files"]]


def geometry(weights: List[torch.Tensor], sample: int = 4000) -> Dict[str, Any]:
    """The figures of the module docstring for one run's slices (each at least 2 rows)."""
    pair_means, nearest = [], []
    for w in weights:
        u = F.normalize(w, dim=1)
        c = u @ u.T
        n = c.shape[0]
        off = ~torch.eye(n, dtype=torch.bool)
        pair_means.append(c[off].mean())
        nearest.append(c.masked_fill(~off, -2.0).max(1).values.mean())
    rows = F.normalize(torch.cat(weights), dim=1)
    k = min(sample, rows.shape[0])
    pick = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(0))[:k]
    c = rows[pick] @ rows.T
    c[torch.arange(k), pick] = -2.0                                 # not a row's own cosine
    norms = torch.cat([w.norm(dim=1) for w in weights])
    return {"slices": len(weights), "rows": rows.shape[0], "row_norm_mean": float(norms.mean()),
            "within_slice_pair_cos": float(torch.stack(pair_means).mean()),
            "within_slice_nearest_cos": float(torch.stack(nearest).mean()),
            "overall_nearest_cos": float(c.max(1).values.mean()), "overall_sampled_rows": k}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (their latest checkpoint) or checkpoint folders")
    p.add_argument("--sample", type=int, default=4000, help="rows whose nearest neighbour over all is measured")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    results = []
    print("| run | rows | mean |w| | within slice: pair cos | within slice: nearest cos | over all: nearest cos |")
    print("|---|---|---|---|---|---|")
    for run in a.runs:
        ckpt = resolve_checkpoint(run)
        r = {"run": os.path.basename(os.path.normpath(run)), "checkpoint": os.path.basename(ckpt),
             **geometry(slice_weights(ckpt), a.sample)}
        results.append(r)
        print(f"| {r['run']} | {r['rows']:,} | {r['row_norm_mean']:.3f} | {r['within_slice_pair_cos']:.4f} | "
              f"{r['within_slice_nearest_cos']:.4f} | {r['overall_nearest_cos']:.4f} |")
    if a.json:
        write_text(a.json, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
