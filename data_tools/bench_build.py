"""Measure a streaming shard build (docs/evidence/data.md §6.4): wall time, samples/s, the peak RSS of the largest
process and the peak of the PSS sum over the build's process tree (psutil, sampled every 0.2 s).

    python -m data_tools.bench_build --records 1000000 --store raw --workers 2 [--parts 2] [--keep DIR]

It writes a synthetic header-less RecordIO file of 8x8 grey PNG records (64 distinct images reused, 10
samples per class on average) into a temporary folder, then runs ``hvd-partialfc-shards build recordio``
(``--parts M``: M concurrent ``--part K/M`` processes, then ``assemble``).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

MAGIC = 0xCED7230A


def write_synthetic_rec(prefix: str, n: int, classes: int, seed: int = 0, side: int = 8,
                        jpeg: bool = False) -> None:
    """``n`` records of ``side`` x ``side`` grey PNGs (``jpeg``: RGB JPEGs, quality 90, of a smooth image
    plus mild noise, ~face-crop sized at side 112), every one of ``classes`` classes used; whole records
    (no image here holds the magic word, asserted), written 64k records at a time."""
    from PIL import Image
    rng = np.random.default_rng(0)
    blobs = []
    yy, xx = np.mgrid[0:side, 0:side]
    for k in range(64):
        buf = io.BytesIO()
        if jpeg:
            base = np.stack([(xx * (k + 1) + yy * c * 3) % 256 for c in range(3)], -1).astype(np.float32)
            img = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
        else:
            Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    assert not any(struct.pack("<I", MAGIC) in b for b in blobs)
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.arange(classes), rng.integers(0, classes, n - classes)])
    pick = rng.integers(0, len(blobs), n)
    offset = 0
    with open(f"{prefix}.rec", "wb") as rec, open(f"{prefix}.idx", "w") as idx:
        out: List[bytes] = []
        lines: List[str] = []
        for i in range(n):
            payload = struct.pack("IfQQ", 0, float(labels[i]), i, 0) + blobs[pick[i]]
            blob = struct.pack("<II", MAGIC, len(payload)) + payload + b"\0" * ((-len(payload)) % 4)
            lines.append(f"{i}\t{offset}\n")
            out.append(blob)
            offset += len(blob)
            if len(out) == 65536:
                rec.write(b"".join(out))
                idx.write("".join(lines))
                out, lines = [], []
        rec.write(b"".join(out))
        idx.write("".join(lines))


# Runs one build and reports the kernel's figures for it and the workers it waited for: the peak RSS of
# the largest process and the CPU seconds. A small fresh wrapper, because a child forked from a large
# process keeps that process's RSS as its ru_maxrss (measured: 1.1 GB reported for an 84 MB build forked
# from the benchmark after it wrote a JPEG RecordIO file).
_WRAP = """
import json, resource, subprocess, sys
rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "maxrss_kb": r.ru_maxrss, "cpu_s": r.ru_utime + r.ru_stime}))
"""


def run_measured(cmds: List[List[str]], env: Dict[str, str]) -> Dict[str, float]:
    """Run ``cmds`` concurrently: wall time, peak RSS of the largest process (exact, and as sampled),
    the peak PSS sum over all their process trees (psutil, every 0.2 s), total CPU seconds."""
    import psutil
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _WRAP] + c, env=env, stdout=subprocess.PIPE, text=True)
             for c in cmds]
    roots = [psutil.Process(p.pid) for p in procs]
    max_rss, max_pss = 0, 0
    while any(p.poll() is None for p in procs):
        rss_sum_pss = 0
        for r in roots:
            try:
                tree = [r] + r.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for q in tree:
                try:
                    mi = q.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                max_rss = max(max_rss, mi.rss)
                rss_sum_pss += mi.pss
        max_pss = max(max_pss, rss_sum_pss)
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
    reports = [json.loads(p.stdout.read()) for p in procs]
    if any(p.returncode or r["rc"] for p, r in zip(procs, reports)):
        raise SystemExit(f"a build failed: {reports}")
    return {"seconds": seconds, "peak_rss_mb": max(r["maxrss_kb"] for r in reports) / 1024,
            "peak_rss_sampled_mb": max_rss / 2**20, "peak_pss_sum_mb": max_pss / 2**20,
            "cpu_s": sum(r["cpu_s"] for r in reports)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--classes", type=int, default=0, help="default records / 10")
    p.add_argument("--store", choices=["raw", "encoded"], default="raw")
    p.add_argument("--workers", type=int, default=1, help="--workers of each build process")
    p.add_argument("--parts", type=int, default=1, help="concurrent --part K/M processes")
    p.add_argument("--num-shards", type=int, default=16)
    p.add_argument("--jpeg", type=int, default=0, metavar="SIDE",
                   help="RGB JPEG records SIDE x SIDE (e.g. 112, as face crops) instead of 8x8 grey PNGs")
    p.add_argument("--no-check", action="store_true", help="encoded: pass the bytes through undecoded")
    p.add_argument("--inspect", action="store_true", help="also time `inspect --no-sha256` on the result")
    p.add_argument("--keep", help="folder for the input and output (default: a temporary one, removed)")
    args = p.parse_args(argv)
    root = args.keep or tempfile.mkdtemp(prefix="bench-build-")
    os.makedirs(root, exist_ok=True)
    prefix = os.path.join(root, f"synthetic-{args.records}" + (f"-jpeg{args.jpeg}" if args.jpeg else ""))
    if not os.path.isfile(prefix + ".idx"):
        write_synthetic_rec(prefix, args.records, args.classes or max(1, args.records // 10),
                            side=args.jpeg or 8, jpeg=bool(args.jpeg))
    out = os.path.join(root, f"out-{args.store}-w{args.workers}-p{args.parts}-j{args.jpeg}"
                       + ("-nocheck" if args.no_check else ""))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = [sys.executable, "-m", "data_tools.shards_cli", "build", "recordio", prefix, "--out", out, "--num-shards",
            str(args.num_shards), "--store", args.store, "--workers", str(args.workers), "--overwrite"]
    if args.no_check:
        base.append("--no-check")
    import shutil
    from .stream_restart import resumable_dir
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(resumable_dir(out), ignore_errors=True)
    if args.parts == 1:
        r = run_measured([base], env)
    else:
        base.remove("--overwrite")
        r = run_measured([base + ["--part", f"{k}/{args.parts}"] for k in range(1, args.parts + 1)], env)
        t = time.perf_counter()
        subprocess.check_call([sys.executable, "-m", "data_tools.shards_cli", "assemble", out], env=env,
                              stdout=subprocess.DEVNULL)
        r["assemble_seconds"] = time.perf_counter() - t
        r["seconds"] += r["assemble_seconds"]
    if args.inspect:
        t = time.perf_counter()
        subprocess.check_call([sys.executable, "-m", "data_tools.shards_cli", "inspect", out, "--no-sha256"], env=env,
                              stdout=subprocess.DEVNULL)
        r["inspect_no_sha256_seconds"] = time.perf_counter() - t
    r.update(records=args.records, jpeg=args.jpeg, store=args.store, workers=args.workers, parts=args.parts,
             check=not args.no_check,
             samples_per_s=args.records / r["seconds"],
             cores=args.parts * max(1, args.workers))
    r["samples_per_s_per_core"] = r["samples_per_s"] / r["cores"]
    r["samples_per_cpu_s"] = args.records / r["cpu_s"]       # robust to other load on the machine
    r["loadavg_1min_after"] = os.getloadavg()[0]
    print(json.dumps(r))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
