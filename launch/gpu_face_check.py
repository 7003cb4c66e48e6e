#!/usr/bin/env python
"""The face workload on one GPU (issue 13), run by launch/gpu_check.sh; on CPU with ``--tiny`` to show it runs.

    python launch/gpu_face_check.py OUT            # GPU: iresnet50, 112x112 JPEG shards, batch 128
    python launch/gpu_face_check.py OUT --tiny     # CPU: iresnet18, a few steps (no figures worth keeping)

1. An encoded shard set of 112x112x3 JPEGs (quality 95, as InsightFace's .rec) is written under OUT.
2. ``hvd-partialfc train`` (world size 1: plain ``python -m hvd_partialfc.cli``, Horovod runs alone) with
   iresnet50, the ms1mv3_r50 recipe's keys, fp16 then bf16, a few hundred steps through the real loader
   (``data.workers`` = cores - 2, flip on); samples/s and the data-time share from its metrics.jsonl.
3. The step split, samples/s for: (a) the full step, iresnet50 + a local classifier of 125,000 classes (one
   rank's slice of 10^6 classes on 8 GPUs), batches from the loader; (b) the same step without the
   classifier (the backbone alone: the limit); (c) the loader alone with the same workers. (a) and (b) are
   also timed on one batch kept on the device, which says whether the loader or the GPU sets the pace.
Everything is printed as a table and written to OUT/face_check.json (no machine paths).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data_tools.bench_loader import face_jpegs  # noqa: E402
from data_tools.shard_writer import write_shard_set  # noqa: E402
from hvd_partialfc.data.loader import RankShardDataset, make_loader, prepare_batch  # noqa: E402
from hvd_partialfc.classifier.margins import create_margin, margin_cross_entropy  # noqa: E402
from hvd_partialfc.models import create_model  # noqa: E402
from hvd_partialfc.data.partition import even_slices  # noqa: E402


def build_shards(out: str, classes: int, per_class: int) -> str:
    d = os.path.join(out, "faces")
    if not os.path.isfile(os.path.join(d, "manifest.json")):
        blobs, _ = face_jpegs(classes * per_class, unique=min(classes * per_class, 4000))
        labels = np.repeat(np.arange(classes), per_class)
        write_shard_set(d, "encoded", blobs, labels, even_slices(classes, 4), classes, sample_shape=[112, 112, 3])
    return d


def train_cli(shards: str, out: str, model: str, precision: str, steps: int, batch: int, workers: int,
              device: str) -> dict:
    run = os.path.join(out, f"train-{model}-{precision}")
    cmd = [sys.executable, "-m", "hvd_partialfc.cli", "train", "--config", "configs/ms1mv3_r50.yaml",
           "--shards", shards, "--out", run, "--steps", str(steps)]
    for s in (f"model.name={model}", f"train.precision={precision}", f"data.batch_size={batch}",
              f"data.workers={workers}", "train.log_every=1" if steps < 20 else "train.log_every=10", "checkpoint.every=0", f"train.device={device}"):
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
        return {"model": model, "precision": precision, "error": p.stderr.strip().splitlines()[-1:]}
    recs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"samples_per_s"' in line]
    tail = recs[len(recs) // 2:] or recs              # the second half: workers started, caches warm
    return {"model": model, "precision": precision, "steps": steps, "batch": batch, "workers": workers,
            "wall_s": round(time.time() - t0, 1), "samples_per_s": float(np.median([r["samples_per_s"] for r in tail])),
            "data_share": float(np.median([r.get("data_time", 0) / max(r.get("step_time", 1e-9), 1e-9)
                                           for r in tail])),
            "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"]}


def step_split(shards: str, model_name: str, classes: int, batch: int, workers: int, steps: int,
               device: torch.device, precision: str, warmup: int = 3) -> dict:
    torch.manual_seed(0)
    backbone = create_model(model_name, in_shape=[112, 112, 3], embedding_dim=512).to(device)
    weight = torch.nn.Parameter(torch.empty(classes, 512, device=device).normal_(0, 0.01))
    margin = create_margin("arcface", 64.0, 0.5)
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": [weight]}], lr=0.01, momentum=0.9,
                          weight_decay=5e-4)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loader, _ = make_loader(RankShardDataset(shards, 0, 1), batch, seed=0, workers=workers,
                            pin_memory=device.type == "cuda", augment=["flip"])
    it = iter(loader)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(x, y, with_head: bool):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            f = backbone(x)
        loss = margin_cross_entropy(f.float(), weight, y, margin) if with_head else f.float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def timed(fn, n):
        for _ in range(warmup):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return n * batch / (time.perf_counter() - t)

    def from_loader(with_head):
        def fn():
            x, y = prepare_batch(*next(it), device, "encoded")
            step(x, y, with_head)
        return fn

    x0, y0 = prepare_batch(*next(it), device, "encoded")
    out = {"model": model_name, "precision": precision, "classes": classes, "batch": batch, "workers": workers,
           "a_full_step": timed(from_loader(True), steps), "b_backbone_only": timed(from_loader(False), steps),
           "a_full_step_cached_batch": timed(lambda: step(x0, y0, True), steps),
           "b_backbone_only_cached_batch": timed(lambda: step(x0, y0, False), steps)}
    out["c_loader_only"] = timed(lambda: next(it), steps * 2)
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--tiny", action="store_true", help="CPU: iresnet18, batch 4, a few steps")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    workers = max(1, (os.cpu_count() or 2) - 2)
    if args.tiny:
        classes, per_class, model, batch, steps, train_steps, workers = 40, 4, "iresnet18", 4, 1, 2, 1
        head_classes = 1000
    else:
        classes, per_class, model, batch, steps, train_steps = 1000, 20, "iresnet50", 128, 30, 300
        head_classes = 125_000
    t0 = time.time()
    shards = build_shards(args.out, classes, per_class)
    print(f"shards: {classes} classes x {per_class} JPEGs ({time.time() - t0:.0f} s)", flush=True)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "train": [], "split": []}
    for precision in ("fp16", "bf16"):
        r = train_cli(shards, args.out, model, precision, train_steps, batch, workers, device.type)
        report["train"].append(r)
        print(json.dumps(r), flush=True)
    # CPU (--tiny): one precision, one warm-up step (fp16 has no fast CPU kernels: ~25 s a step here)
    for precision in ("bf16",) if args.tiny else ("fp16", "bf16"):
        r = step_split(shards, model, head_classes, batch, workers, steps, device, precision,
                       warmup=1 if args.tiny else 3)
        report["split"].append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'model':10} {'prec':5} {'(a) full step':>14} {'(b) backbone':>13} {'(a) cached':>11} "
          f"{'(b) cached':>11} {'(c) loader':>11}  samples/s, {head_classes:,} classes, batch {batch}, "
          f"{workers} workers")
    for r in report["split"]:
        print(f"{r['model']:10} {r['precision']:5} {r['a_full_step']:14,.0f} {r['b_backbone_only']:13,.0f} "
              f"{r['a_full_step_cached_batch']:11,.0f} {r['b_backbone_only_cached_batch']:11,.0f} "
              f"{r['c_loader_only']:11,.0f}")
    report["wall_s"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "face_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    failed = [r for r in report["train"] if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
