"""Benchmarks of the offline and online data path; prints tables and writes JSON (docs/data.md quotes them).

    python -m data_tools.bench_loader [--out runs/bench_data.json] [--fonts-chars 300] [--quick]

1. storage: random-batch read speed of one raw shard for chunk sizes x compression (how the defaults of
   `data_tools.build` were chosen);
2. build throughput (samples/s, the whole ``build`` call): ``fonts`` and ``imagefolder`` (PNG files);
3. loader throughput (samples/s) of `hvd_partialfc.data.make_loader`, 0 and 2 workers, raw vs encoded;
4. what the trainer consumes: the default ``resnet`` backbone (64x64, embedding 128), forward + backward +
   SGD step at batch 128 on one thread; the loader/trainer ratio must be >= 5.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np


def _glyphs(n: int, classes: int, seed: int = 0) -> tuple:
    """n rendered 64x64 glyph images from the first installed CJK faces (realistic PNG sizes)."""
    from .importers.fonts import import_fonts
    d = import_fonts(max_chars=classes, max_fonts=12, samples_per_font=max(1, -(-n // (classes * 12))),
                     seed=seed, workers=2, progress=False)
    k = min(n, len(d.samples))
    return d.samples[:k], np.asarray([ord(c) for c in d.labels[:k]])


def bench_storage(tmp: str, images: np.ndarray, batches: int) -> list:
    from hvd_partialfc.data import RankShardDataset
    from hvd_partialfc.partition import LabelSlice
    from hvd_partialfc.shards import Manifest, ShardEntry
    from .shard_writer import write_manifest, write_shard
    rows = []
    labels = np.zeros(len(images), np.int64)
    rng = np.random.default_rng(0)
    for comp in (None, "lzf", "gzip"):
        for chunk in ((0,) if comp is None else ()) + (1, 16, 64, 256, 1024):
            d = os.path.join(tmp, f"st-{comp}-{chunk}")
            os.makedirs(d)
            name = "shard-00000-of-00001.h5"
            digest = write_shard(os.path.join(d, name), "images", images, labels, LabelSlice(0, 0, 1), 1,
                                 compression=comp, chunk_samples=chunk)
            write_manifest(d, Manifest(1, "images", list(images.shape[1:]), "uint8",
                                       [ShardEntry(name, 0, 1, len(images), digest)]))
            ds = RankShardDataset(d, 0, 1)
            ds[list(range(128))]
            t = time.perf_counter()
            for _ in range(batches):
                ds[rng.choice(len(ds), 128, replace=False).tolist()]
            sps = batches * 128 / (time.perf_counter() - t)
            rows.append({"compression": comp or "none", "chunk_samples": chunk or "contiguous",
                         "file_mb": os.path.getsize(os.path.join(d, name)) / 2**20, "samples_per_s": sps})
            shutil.rmtree(d)
    return rows


def bench_build(tmp: str, images: np.ndarray, labels: np.ndarray, fonts_chars: int) -> list:
    from PIL import Image
    from .build import BuildOptions, build
    from .importers import get_importer
    rows = []
    for store in ("raw", "encoded"):
        r = build(get_importer("fonts"), None, BuildOptions(out=os.path.join(tmp, f"bf-{store}"), num_shards=2,
                                                            store=store, workers=2, progress=False),
                  max_chars=fonts_chars)
        rows.append({"importer": "fonts", "store": store, "samples": r["manifest"].num_samples,
                     "seconds": r["seconds"], "samples_per_s": r["samples_per_s"],
                     "faces": r["manifest"].source["faces_used"], "workers": 2})
    root = os.path.join(tmp, "folder")
    for i, (img, y) in enumerate(zip(images, labels)):
        os.makedirs(os.path.join(root, str(y)), exist_ok=True)
        Image.fromarray(img).save(os.path.join(root, str(y), f"{i:06d}.png"))
    for store in ("raw", "encoded"):
        out = os.path.join(tmp, f"folder-{store}")
        r = build(get_importer("imagefolder"), root, BuildOptions(out=out, num_shards=1, store=store, workers=2,
                                                                  progress=False))
        rows.append({"importer": "imagefolder", "store": store, "samples": r["manifest"].num_samples,
                     "seconds": r["seconds"], "samples_per_s": r["samples_per_s"], "workers": 2})
    return rows


def bench_loader(tmp: str, batches: int) -> list:
    import torch
    from hvd_partialfc.data import RankShardDataset, make_loader
    torch.set_num_threads(1)
    rows = []
    for store in ("raw", "encoded"):
        ds = RankShardDataset(os.path.join(tmp, f"folder-{store}"), 0, 1)
        for workers in (0, 2):
            loader, _ = make_loader(ds, batch_size=128, seed=0, workers=workers)
            it = iter(loader)
            for _ in range(3 if workers else 1):        # warm-up: workers started, first batches in flight
                next(it)
            t = time.perf_counter()
            for _ in range(batches):
                x, y = next(it)
            sps = batches * 128 / (time.perf_counter() - t)
            rows.append({"store": store, "workers": workers, "samples_per_s": sps,
                         "batch_shape": list(x.shape), "dtype": str(x.dtype)})
            del it, loader
    return rows


def bench_trainer(steps: int) -> dict:
    import torch
    from hvd_partialfc.models import create_model
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = create_model("resnet", in_shape=[64, 64], embedding_dim=128)
    head = torch.nn.Linear(128, 1000, bias=False)
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.1, momentum=0.9)
    x = torch.randn(128, 1, 64, 64)
    y = torch.randint(0, 1000, (128,))

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(head(model(x)), y).backward()
        opt.step()
    step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sec = (time.perf_counter() - t) / steps
    return {"model": "resnet", "in_shape": [64, 64], "embedding_dim": 128, "batch": 128, "threads": 1,
            "step_s": sec, "samples_per_s": 128 / sec}


def _table(title: str, rows: list, cols: list) -> None:
    print(f"\n{title}")
    print("  " + "  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  " + "  ".join(f"{r[c]:>14.1f}" if isinstance(r[c], float) else f"{str(r[c]):>14}" for c in cols))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/bench_data.json")
    p.add_argument("--samples", type=int, default=12000, help="images of the imagefolder/loader sets")
    p.add_argument("--fonts-chars", type=int, default=200, help="characters of the fonts build (all fonts)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = p.parse_args(argv)
    n, batches, steps = (1200, 5, 2) if args.quick else (args.samples, 60, 10)
    tmp = tempfile.mkdtemp(prefix="bench-data-")
    try:
        images, labels = _glyphs(n, classes=max(10, n // 60))
        res = {"cpu_count": os.cpu_count(), "samples": int(len(images))}
        res["storage"] = bench_storage(tmp, images, batches)
        _table(f"storage: random batches of 128 from one raw shard of {len(images)} 64x64 samples",
               res["storage"], ["compression", "chunk_samples", "file_mb", "samples_per_s"])
        res["build"] = bench_build(tmp, images, labels, 20 if args.quick else args.fonts_chars)
        _table("build throughput (whole `build` call, 2 workers)", res["build"],
               ["importer", "store", "samples", "seconds", "samples_per_s"])
        res["loader"] = bench_loader(tmp, batches)
        _table("loader throughput (make_loader, batch 128)", res["loader"], ["store", "workers", "samples_per_s"])
        res["trainer"] = bench_trainer(steps)
        t = res["trainer"]["samples_per_s"]
        for r in res["loader"]:
            r["ratio_to_trainer"] = r["samples_per_s"] / t
        _table(f"trainer consumption: resnet 64x64 fwd+bwd+step, batch 128, 1 thread: {t:.0f} samples/s; "
               f"loader / trainer", res["loader"], ["store", "workers", "ratio_to_trainer"])
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nwrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
