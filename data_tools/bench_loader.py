"""Benchmarks of the offline and online data path; prints tables and writes JSON (docs/evidence/data.md
quotes them).

    python -m data_tools.bench_loader [--out runs/bench_data.json] [--fonts-chars 300] [--quick]
    python -m data_tools.bench_loader --faces OUT [--samples 6000] [--quick]     # section 5 only
    python -m data_tools.bench_loader --gpu-decode OUT [--workers 8] [--seconds 10] [--device cuda]  # section 6 only


1. storage: random-batch read speed of one raw shard for chunk sizes x compression (how the defaults of
   `data_tools.build` were chosen);
2. build throughput (samples/s, the whole ``build`` call): ``fonts`` and ``imagefolder`` (PNG files);
3. loader throughput (samples/s) of `hvd_partialfc.data.loader.make_loader`, 0 and 2 workers, raw vs encoded;
4. what the trainer consumes: the default ``resnet`` backbone (64x64, embedding 128), forward + backward +
   SGD step at batch 128 on one thread; the loader/trainer ratio must be >= 5;
5. faces (``--faces OUT``: this section alone, JSON in OUT/faces_loader.json): the loader on an encoded shard
   set of 112x112x3 JPEGs (quality 95, as InsightFace's .rec), 0/1/2 workers, without augmentation, with
   ``flip`` and with every augmentation; one worker's rate is one core's, which sizes the workers a GPU needs;
6. ``data.decode=gpu`` (``--gpu-decode OUT``): its input's distance to PIL's in levels of 255, and the loader's
   sustained rate (``measure_loader_rate``: a new loader each row, warm-up excluded) with either decode.
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
    from hvd_partialfc.data.loader import RankShardDataset
    from hvd_partialfc.data.partition import LabelSlice
    from hvd_partialfc.data.shards import Manifest, ShardEntry
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
    from hvd_partialfc.data.loader import RankShardDataset, make_loader
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


FACE_AUGMENT = {"none": [], "flip": ["flip"], "all": ["flip", "lowres", "blur", "jitter", "gray"]}


def face_jpegs(n: int, unique: int = 2000, seed: int = 0) -> tuple:
    """``n`` JPEG blobs (quality 95) of 112x112x3 smooth random colour images plus mild noise (``unique``
    distinct ones, repeated), and labels of 20 samples per class."""
    import io
    from PIL import Image
    rng = np.random.default_rng(seed)
    blobs = []
    for _ in range(min(n, unique)):
        small = Image.fromarray(rng.integers(0, 256, (7, 7, 3), dtype=np.uint8)).resize((112, 112), Image.BICUBIC)
        img = np.clip(np.asarray(small, np.float32) + rng.normal(0, 6, (112, 112, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    blobs = [blobs[i % len(blobs)] for i in range(n)]
    return blobs, np.arange(n) // 20


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its live children (the DataLoader workers)."""
    import psutil
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def write_face_shards(out: str, n: int, num_shards: int = 4, per_class: int = 20, dirty=None) -> str:
    """An encoded shard set of ``n`` 112x112x3 JPEG faces (``face_jpegs``), ``per_class`` samples a class, in
    ``out``; returns ``out``. ``dirty``: {sample: bytes} stored in those samples' place (an empty or
    truncated image: what a ``--no-check`` build keeps)."""
    from hvd_partialfc.data.partition import even_slices
    from data_tools.shard_writer import write_shard_set
    blobs, _ = face_jpegs(n)
    for i, b in (dirty or {}).items():
        blobs[i] = np.frombuffer(b, np.uint8)
    labels = np.arange(n) // per_class
    classes = int(labels[-1]) + 1
    write_shard_set(out, "encoded", blobs, labels, even_slices(classes, num_shards), classes,
                    sample_shape=[112, 112, 3])
    return out


def measure_loader_rate(shards: str, batch_size: int = 128, workers: int = 2, seconds: float = 5.0,
                        decode: str = "cpu", augment=("flip",), device: str = "cpu",
                        warmup_batches: int = -1) -> dict:
    """The loader's sustained rate: batches made model input on ``device`` (``prepare_batch`` included, so
    ``decode="gpu"`` counts its decode on the device), from a new loader (a cold prefetch queue).

    Warm-up, excluded explicitly: the workers' start and the first ``warmup_batches`` batches (-1: 2 per
    worker, at least 1). Workers start together, so when the timer starts at most ~``workers`` batches are
    queued: the bias is at most ``workers`` batches over the timed ones. Then batches for ``seconds`` of
    wall time. Returns samples/s (wall) and samples per CPU-second of this process and its workers together
    (psutil): what dedicated cores deliver on a shared machine, one worker being one core (docs/evidence/data.md
    §7.2)."""
    import torch
    from hvd_partialfc.data.loader import RankShardDataset, make_loader, prepare_batch
    dev = torch.device(device)
    ds = RankShardDataset(shards, 0, 1)
    loader, _ = make_loader(ds, batch_size, seed=0, workers=workers, augment=list(augment), decode=decode,
                            pin_memory=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    it = iter(loader)
    warm = max(1, 2 * workers) if warmup_batches < 0 else warmup_batches
    t_start = time.perf_counter()
    for _ in range(warm):
        prepare_batch(*next(it), dev, ds.kind)
    sync()
    t, cpu, n = time.perf_counter(), _cpu_seconds(), 0
    while True:
        x, _y = prepare_batch(*next(it), dev, ds.kind)
        n += 1
        if time.perf_counter() - t >= seconds:
            break
    sync()
    wall, cpu = time.perf_counter() - t, _cpu_seconds() - cpu
    del it, loader
    return {"samples_per_s": n * batch_size / wall, "samples_per_cpu_s": n * batch_size / max(cpu, 1e-9),
            "batches_timed": n, "seconds": wall, "warmup_batches": warm, "warmup_s": t - t_start,
            "batch_size": batch_size, "workers": workers, "decode": decode, "augment": list(augment),
            "device": str(dev), "input_shape": list(x.shape)}


def decode_difference(shards: str, device: str = "cuda", batches: int = 8, batch_size: int = 128) -> dict:
    """How far ``data.decode=gpu``'s model input is from the CPU path's (PIL) on the same batches (seed 0,
    flip): |difference| in levels of 255, per pixel (max, 99.9th percentile) and per image (largest mean)."""
    import torch
    from hvd_partialfc.data.device_decode import torchvision_decoder
    from hvd_partialfc.data.loader import RankShardDataset, make_loader, prepare_batch
    dev, ds = torch.device(device), RankShardDataset(shards, 0, 1)
    its = [iter(make_loader(ds, batch_size, seed=0, augment=["flip"], decode=d)[0]) for d in ("cpu", "gpu")]
    diffs = []
    for _ in range(batches):
        (x0, _), (x1, _) = (prepare_batch(*next(it), dev, ds.kind) for it in its)
        diffs.append(((x1 - x0).abs() * 127.5).flatten(1).cpu())
    d = torch.cat(diffs)
    counts = torch.bincount(d.round().long().flatten())             # pixels per whole level of difference
    p999 = int(torch.searchsorted(counts.cumsum(0), 0.999 * d.numel()))
    decoder = "torchvision" if torchvision_decoder()[0] else "PIL (torchvision does not load)"
    return {"device": str(dev), "decoder": decoder,
            "samples": int(d.shape[0]), "max_levels": float(d.max()), "p999_levels": p999,
            "worst_image_mean_levels": float(d.mean(1).max()), "mean_levels": float(d.mean()),
            "pixels_per_level": counts.tolist()}


def run_gpu_decode(out: str, n: int, workers: int, seconds: float, device: str, batch_size: int = 128) -> dict:
    """``--gpu-decode OUT``: on ``n`` synthetic faces, nvJPEG's distance to PIL and the loader's sustained rate
    with either decode (JSON in OUT/gpu_decode.json)."""
    tmp = tempfile.mkdtemp(prefix="bench-decode-")
    try:
        shards = write_face_shards(os.path.join(tmp, "faces"), n)
        res = {"command": "python -m data_tools.bench_loader --gpu-decode OUT", "samples": n,
               "cpu_count": os.cpu_count(),
               "difference": decode_difference(shards, device, max(1, min(8, n // batch_size)), batch_size),
               "rates": [measure_loader_rate(shards, batch_size, w, seconds, d, device=device)
                         for d in ("cpu", "gpu") for w in sorted({1, workers})]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res["difference"]))
    _table("loader sustained rate (a new loader each row, warm-up excluded)", res["rates"],
           ["decode", "workers", "samples_per_s", "samples_per_cpu_s"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def bench_faces(tmp: str, n: int, batches: int) -> dict:
    """Loader samples/s on 112x112 JPEGs for 0/1/2 workers x {none, flip, all} augmentation, plus the bare
    ``decode_image`` rate on one core."""
    import torch
    from hvd_partialfc.data.loader import RankShardDataset, make_loader
    from hvd_partialfc.data.partition import even_slices
    from data_tools.shard_writer import write_shard_set
    from hvd_partialfc.data.shards import decode_image
    torch.set_num_threads(1)
    blobs, labels = face_jpegs(n)
    d = os.path.join(tmp, "faces")
    write_shard_set(d, "encoded", blobs, labels, even_slices(int(labels[-1]) + 1, 4), int(labels[-1]) + 1,
                    sample_shape=[112, 112, 3])
    t = time.process_time()
    k = min(n, 2000)
    for b in blobs[:k]:
        decode_image(b, (112, 112, 3))
    decode_rate = k / (time.process_time() - t)      # per CPU-second of this (single-threaded) process
    ds = RankShardDataset(d, 0, 1)
    rows = []
    for aug, specs in FACE_AUGMENT.items():
        for workers in (0, 1, 2):
            loader, _ = make_loader(ds, batch_size=128, seed=0, workers=workers, augment=specs)
            it = iter(loader)
            for _ in range(2 * workers + 1):                # warm-up: workers started, their queues filled
                next(it)
            t, cpu = time.perf_counter(), _cpu_seconds()
            for _ in range(batches):
                x, _y = next(it)
            wall, cpu = time.perf_counter() - t, _cpu_seconds() - cpu
            rows.append({"augment": aug, "workers": workers, "samples_per_s": batches * 128 / wall,
                         "samples_per_cpu_s": batches * 128 / cpu})
            del it, loader
    # A worker is one process on one core: the loader's samples per CPU-second (trainer process and workers
    # together, so the hand-over is included) is what one dedicated core delivers, whatever else runs.
    per_worker = {aug: float(np.median([r["samples_per_cpu_s"] for r in rows if r["augment"] == aug and r["workers"]]))
                  for aug in FACE_AUGMENT}
    need = {aug: {str(target): int(np.ceil(target / rate)) for target in (3000, 10000)}
            for aug, rate in per_worker.items()}
    return {"command": "python -m data_tools.bench_loader --faces OUT", "samples": n, "jpeg_quality": 95, "sample_shape": [112, 112, 3], "batch": 128,
            "batches_timed": batches, "jpeg_bytes_mean": float(np.mean([len(b) for b in blobs])),
            "augment": FACE_AUGMENT, "decode_image_per_cpu_s": decode_rate, "loader": rows,
            "per_worker_samples_per_s": per_worker, "workers_needed": need, "cpu_count": os.cpu_count()}


def run_faces(out: str, n: int, batches: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-faces-")
    try:
        res = bench_faces(tmp, n, batches)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _table(f"faces: make_loader on encoded 112x112x3 JPEG q95 (mean {res['jpeg_bytes_mean']:.0f} B), batch 128; "
           f"bare decode_image {res['decode_image_per_cpu_s']:.0f} per CPU-second", res["loader"],
           ["augment", "workers", "samples_per_s", "samples_per_cpu_s"])
    for aug, need in res["workers_needed"].items():
        print(f"  augment {aug}: {res['per_worker_samples_per_s'][aug]:.0f} samples per CPU-second per worker: "
              f"{need['3000']} workers for 3,000 samples/s, {need['10000']} for 10,000")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "faces_loader.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {path}")
    return res


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
    p.add_argument("--faces", metavar="OUT", help="run only the faces loader benchmark; JSON in OUT/faces_loader.json")
    p.add_argument("--gpu-decode", metavar="OUT", help="only data.decode=gpu against cpu: pixels and loader rates "
                   "(OUT/gpu_decode.json); with --workers, --seconds, --device")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.gpu_decode:
        run_gpu_decode(args.gpu_decode, 1200 if args.quick else args.samples // 2, args.workers,
                       0.5 if args.quick else args.seconds, args.device)
        return 0
    if args.faces:
        run_faces(args.faces, 1200 if args.quick else args.samples // 2, 3 if args.quick else 60)
        return 0
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
