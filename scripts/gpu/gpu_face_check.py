#!/usr/bin/env python
"""The face workload measured through the trainer itself, for scripts/gpu/gpu_check.sh (GPU) and its CPU test.
Run from the repository root:

    python -m scripts.gpu.gpu_face_check prepare WORK [--tiny]     # shard sets + the loader's sustained rate
    torchrun --standalone --nproc-per-node 1 -m scripts.gpu.gpu_face_check measure WORK --engine torch [--tiny]
    horovodrun -np 1 python -m scripts.gpu.gpu_face_check measure WORK --engine horovod [--tiny]
    python -m scripts.gpu.gpu_face_check report WORK OUT          # table + face_check.json; exit 1 if incomplete

What is measured (GPU; ``--tiny`` is the same code at toy sizes on the CPU, so the script cannot rot):

* **The trainer**, built by ``run.startup.start_trainer`` from the ms1mv3_r50 recipe with ``head.mode: local``
  set explicitly, iresnet50 at 112x112 from JPEG shards, batch 128, fp16 then bf16, under the engine the
  launcher started (``--engine``). Two heads: a **125,000-class local head** (one rank's slice of 10^6
  classes on 8 GPUs; a shard set with one sample per class) and a **1,000-class head** (0.8% of those
  columns: the backbone's cost, through the same loop). Step time = batch / the trainer's own samples/s
  (wall clock between log lines, after warm-up), so no timer inside the step is trusted.
* **Peak GPU memory per precision**: ``torch.cuda.reset_peak_memory_stats`` before each run, the previous
  run's objects freed first; the memory still allocated at each start is recorded beside it (it should be ~0).
* **The loader's sustained rate** (``prepare``): ``data_tools.bench_loader.measure_loader_rate``, a new loader
  (cold: no queue filled by earlier runs), the realistic worker count (cores - 2, at most 12), flip on, its
  warm-up excluded, 10 s timed.

Nothing uses a fixed temporary path: WORK comes from the caller (``mktemp -d`` in gpu_check.sh).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from data_tools.bench_loader import measure_loader_rate, write_face_shards  # noqa: E402
from hvd_partialfc.atomic import write_text  # noqa: E402

RECIPE = os.path.join(ROOT, "configs", "ms1mv3_r50.yaml")
PRECISIONS = ("fp16", "bf16")
TINY_PRECISIONS = ("bf16",)   # the CPU smoke: the same loop, without fp16 (no fast fp16 kernels on CPU)
# name -> (classes, samples per class) of the two shard sets
FULL = {"head125k": (125_000, 1), "head1k": (1_000, 8)}
TINY = {"head125k": (100, 1), "head1k": (20, 8)}    # the dry run: 600 classes took 0.8 CPU-s more to write


def sizes(tiny: bool) -> Dict[str, Any]:
    """The run's sizes: GPU figures, or the CPU smoke's (a small resnet, a few steps)."""
    if tiny:
        return {"sets": TINY, "model": "resnet", "kwargs": {"width": 8}, "batch": 4, "steps": 1,
                "precisions": TINY_PRECISIONS,
                "log_every": 1, "workers": 1, "device": "cpu", "loader_seconds": 0.2}
    return {"sets": FULL, "model": "iresnet50", "kwargs": {}, "batch": 128, "steps": 120, "log_every": 10,
            "precisions": PRECISIONS,
            "workers": max(1, min(12, (os.cpu_count() or 4) - 2)), "device": "cuda", "loader_seconds": 10.0}


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1))


# --- prepare: shard sets and the loader's sustained rate ---------------------------------------------

def build_sets(work: str, sets: Dict[str, Any]) -> Dict[str, str]:
    """One shard (one rank's slice) per set: every class has its samples (no empty class is allowed)."""
    return {name: write_face_shards(os.path.join(work, name), classes * per_class, num_shards=1, per_class=per_class)
            for name, (classes, per_class) in sets.items()}


def prepare(work: str, tiny: bool) -> int:
    s = sizes(tiny)
    t0 = time.time()
    sets = build_sets(work, s["sets"])
    built_s = time.time() - t0
    rate = measure_loader_rate(sets["head125k"], s["batch"], s["workers"], s["loader_seconds"])
    write_json(os.path.join(work, "prepare.json"), {"sets": {k: {"classes": c, "per_class": n} for k, (c, n)
                                                             in s["sets"].items()},
                                                    "build_s": built_s, "loader": rate, "cpu_count": os.cpu_count(),
                                                    "tiny": tiny})
    print(f"shards built in {built_s:.0f} s; loader {rate['samples_per_s']:,.0f} samples/s with "
          f"{rate['workers']} workers (cold queue)", flush=True)
    return 0


# --- measure: the trainer under the engine the launcher started --------------------------------------

def run_config(work: str, engine: str, precision: str, head: str, s: Dict[str, Any]):
    from hvd_partialfc.config_io import load_config
    sets = {"head125k": os.path.join(work, "head125k"), "head1k": os.path.join(work, "head1k")}
    extra = {"data": {"shards": sets[head], "batch_size": s["batch"], "workers": s["workers"]},
             "out": os.path.join(work, f"run-{engine}-{precision}-{head}"),
             "model": {"name": s["model"], "kwargs": s["kwargs"]},
             "head": {"mode": "local", "sample_rate": 1.0},
             "train": {"steps": s["steps"], "precision": precision, "device": s["device"], "engine": engine,
                       "log_every": s["log_every"]},
             "checkpoint": {"every": 0}, "eval": {"every": 0}}
    return load_config(RECIPE, (), extra)


def one_run(cfg, comm, device, warm_logs: int) -> Dict[str, Any]:
    """Train ``cfg`` with the trainer; its steady samples/s (log intervals after ``warm_logs``) and peak memory."""
    import torch
    from hvd_partialfc.run.startup import start_trainer
    gc.collect()
    held = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    trainer = start_trainer(cfg, comm)
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del trainer
    gc.collect()
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if '"samples_per_s"' in line]
    steady = recs[warm_logs:] or recs[-1:]
    sps = float(np.median([r["samples_per_s"] for r in steady]))
    return {"samples_per_s": sps, "step_ms": 1000.0 * cfg.data.batch_size / sps,
            "data_share": float(np.median([r["data_time"] / max(r["step_time"] + r["data_time"], 1e-9)
                                           for r in steady])),
            "peak_gib": peak / 2 ** 30, "held_at_start_gib": held / 2 ** 30, "fit_s": wall,
            "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"], "log_intervals": len(steady)}


def measure(work: str, engine: str, tiny: bool) -> int:
    import torch   # here, not at the top: the report needs none of it (two CPU-seconds of its process)
    from hvd_partialfc.engine.select import start_engine
    s = sizes(tiny)
    comm = start_engine(engine, os.environ, s["device"])
    device = torch.device(s["device"], torch.cuda.current_device()) if s["device"] == "cuda" else torch.device("cpu")
    rows: List[Dict[str, Any]] = []
    for precision in s["precisions"]:
        for head in ("head125k", "head1k"):
            cfg = run_config(work, engine, precision, head, s)
            r = one_run(cfg, comm, device, warm_logs=1 if tiny else 3)
            r.update(engine=engine, precision=precision, head=head, model=s["model"], batch=s["batch"],
                     classes=s["sets"][head][0], workers=s["workers"])
            rows.append(r)
            print(json.dumps(r), flush=True)
    info = {"engine": engine, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}
    if engine == "horovod":
        import horovod.torch as hvd
        info["horovod_nccl_built"] = bool(hvd.nccl_built())
    comm.shutdown()
    write_json(os.path.join(work, f"measure-{engine}.json"), info)
    return 0


# --- report ---------------------------------------------------------------------------------------------

def report(work: str, out: str, engines: List[str]) -> int:
    """The table and face_check.json under OUT; exit 1 when a part is missing or a run looks wrong."""
    problems: List[str] = []
    prep = _read(os.path.join(work, "prepare.json"), problems)
    runs = {e: _read(os.path.join(work, f"measure-{e}.json"), problems) for e in engines}
    precisions = TINY_PRECISIONS if prep and prep.get("tiny") else PRECISIONS
    lines = []
    if prep:
        r = prep["loader"]
        lines.append(f"loader (cold queue, flip): {r['samples_per_s']:,.0f} samples/s with {r['workers']} workers "
                     f"({r['samples_per_cpu_s']:,.0f} per CPU-second), batch {r['batch_size']}")
    head_share = "head's share"
    lines.append(f"{'engine':8} {'prec':5} {'125k head ms':>13} {'1k head ms':>11} {head_share:>12} "
                 f"{'125k samples/s':>15} {'data share':>10} {'peak GiB':>9}")
    for engine, info in runs.items():
        if not info:
            continue
        by = {(r["precision"], r["head"]): r for r in info["rows"]}
        for p in precisions:
            full, small = by.get((p, "head125k")), by.get((p, "head1k"))
            if not full or not small:
                problems.append(f"{engine} {p}: a run is missing")
                continue
            for r in (full, small):
                if not np.isfinite(r["last_loss"]) or r["samples_per_s"] <= 0:
                    problems.append(f"{engine} {p} {r['head']}: loss {r['last_loss']}, {r['samples_per_s']} samples/s")
            share = 1 - small["step_ms"] / full["step_ms"]
            lines.append(f"{engine:8} {p:5} {full['step_ms']:13.1f} {small['step_ms']:11.1f} {share:12.0%} "
                         f"{full['samples_per_s']:15,.0f} {full['data_share']:10.0%} "
                         f"{max(full['peak_gib'], small['peak_gib']):9.2f}")
        if engine == "horovod" and info.get("device", "cpu") != "cpu" and not info.get("horovod_nccl_built"):
            problems.append("horovod: built without NCCL on a GPU run")
    table = "\n".join(lines)
    print(table)
    for p in problems:
        print(f"FAILED: {p}")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "face_check.json"), {"prepare": prep, "runs": runs, "problems": problems})
    write_text(os.path.join(out, "face_check.txt"), table + "\n" + "".join(f"FAILED: {p}\n" for p in problems))
    return 1 if problems else 0


def _read(path: str, problems: List[str]):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"{os.path.basename(path)}: {e}")
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("prepare", "measure", "report"))
    p.add_argument("work")
    p.add_argument("out", nargs="?", help="report: the folder for face_check.json / .txt")
    p.add_argument("--engine", choices=("torch", "horovod"))
    p.add_argument("--engines", default="torch,horovod", help="report: the engines measured")
    p.add_argument("--tiny", action="store_true", help="CPU: toy sizes (the check's own test)")
    a = p.parse_args(argv)
    if a.what == "prepare":
        return prepare(a.work, a.tiny)
    if a.what == "measure":
        if not a.engine:
            p.error("measure needs --engine")
        return measure(a.work, a.engine, a.tiny)
    if not a.out:
        p.error("report needs OUT")
    return report(a.work, a.out, [e for e in a.engines.split(",") if e])    # none: the rank stages left out


if __name__ == "__main__":
    from hvd_partialfc.cli_support import freeze_at_exit
    try:
        raise SystemExit(main())
    finally:
        freeze_at_exit()      # the exit skips the shutdown's collections over torch's objects
