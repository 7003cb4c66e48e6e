"""Time and peak memory of ``hvd-partialfc import-arcface`` per million classes (docs/evidence/migrate.md, "Measured").

    .venv/bin/python -m scripts.studies.arcface_import_size --classes 1000000 --dim 512 --ranks 8 --work /tmp/aimp

Writes a shard set of C classes (one 16-d feature each), an arcface_torch run of W ranks over them (this
package's small mlp backbone, so the figures are the classifier's: rows and momentum, C x D x 4 bytes each,
read and written once), imports it in a child process and prints a table row and JSON: seconds, the
child's peak RSS, bytes of the rank files. The peak is bounded by one rank file and one slice, not by C.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    from conftest import build_shards
    from helpers_arcface import write_run
    from hvd_partialfc.models import create_model
    os.makedirs(a.work, exist_ok=True)
    shards = os.path.join(a.work, "shards")
    if not os.path.isdir(shards):
        rng = np.random.default_rng(0)
        npz = os.path.join(a.work, "f.npz")
        np.savez(npz, features=rng.normal(size=(a.classes, 16)).astype(np.float32), labels=np.arange(a.classes))
        build_shards(npz, shards, a.ranks)
    run = os.path.join(a.work, "run")
    if not os.path.isdir(run):
        torch.manual_seed(0)
        model = create_model("mlp", in_shape=[16], embedding_dim=a.dim, hidden_dim=64)
        rows = torch.randn(a.classes, a.dim)
        write_run(run, model.state_dict(), [n for n, _ in model.named_parameters()], rows, 0.01 * rows, {}, a.ranks,
                  step=100)
        del rows
    out = os.path.join(a.work, "imported")
    shutil.rmtree(out, ignore_errors=True)
    args = ["import-arcface", run, "--shards", shards, "--out", out, "--set", "model.name=mlp",
            "--set", f"model.embedding_dim={a.dim}", "--set", "model.kwargs={hidden_dim: 64}",
            "--set", "head.negatives_every=0", "--set", "data.batch_size=1",
            # write_run's scheduler state: 1,000 batches of poly power 2, no warm-up (the import checks them)
            "--set", "optim.schedule=poly", "--set", "optim.poly_power=2", "--set", "train.steps=1000"]
    # the import alone in a process of its own, which reports its own peak RSS (the builds above are other
    # processes' and this one's)
    code = ("import resource, sys; from hvd_partialfc.cli import main; rc = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code, *args], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.time() - t0
    peak = int(p.stderr.strip().splitlines()[-1]) * 1024
    size = sum(os.path.getsize(os.path.join(run, f)) for f in os.listdir(run))
    per_m = 1e6 / a.classes
    row = {"classes": a.classes, "dim": a.dim, "ranks": a.ranks, "seconds": round(seconds, 1),
           "peak_rss_mb": round(peak / 2 ** 20), "rank_files_mb": round(size / 2 ** 20),
           "seconds_per_million_classes": round(seconds * per_m, 1)}
    print(f"| {a.classes:,} | {a.dim} | {a.ranks} | {size / 2 ** 20:,.0f} MB | {seconds:.1f} s | "
          f"{peak / 2 ** 20:,.0f} MB |")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
