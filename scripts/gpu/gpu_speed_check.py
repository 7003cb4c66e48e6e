#!/usr/bin/env python
"""The ``speed`` stage of scripts/gpu/gpu_check.sh: the speed table measured in one budgeted pass (docs/gpu.md,
"The one call"; its cells and goals: docs/evidence/gpu.md).

    python -m scripts.gpu.gpu_speed_check WORK OUT [--arcface-dir DIR] [--budget 150] [--deadline EPOCH_S]
        [--only NAME,...] [--tiny]

WORK holds the ``prepare`` stage's shard sets (``head125k``); results go to ``OUT/speed.json`` (rewritten after
every cell, so a cut-short run keeps what it measured; and into the call's ``$OUT`` too, publish.py),
``OUT/speed/`` (each profile's and comparison's own JSON and traces) and ``OUT/speed_table.md`` (the GPU
speed table). Cells run in ``plan``'s order, the headline comparison first; a cell whose estimated seconds
no longer fit ``--budget`` or ``--deadline`` (the call's one deadline, in seconds since the epoch) is recorded
as skipped, with the command that runs it alone (``--only NAME``) in a later call. A cell that runs is cut at its limit,
4 times its estimate (at least ``CELL_FLOOR_S``) and never past the deadline: recorded as ``timeout``, and
the next cell starts. A cell that runs out of device memory is recorded as ``oom``, a failed one as
``failed``, and the pass goes on; the stage fails (exit 1) when no cell that ran gave a result, and
refuses to start (exit 2, one line) when ``--arcface-dir`` holds no arcface_torch.

Cells (one GPU, fp16, 112 px, batch 128 unless named):
* ``compare-*``: tools/arcface_compare.py in this process: arcface_torch's train_v2 step (``--arcface-dir``;
  without it ours alone, said) against ``local`` and ``global`` (r = 0.1, the heads that gather scoring the
  rows of a rank of 8: ``--gathered 8``), alternating rounds. arcface's backbone runs without train_v2's DDP
  wrapper: at one rank its all-reduce (fp16-compressed) is a cost ours does not pay. ``-bmax``: at the
  largest batch ours fits, each contender alone on the GPU.
* ``gpu-tests``: tests/test_fast_paths.py's GPU test (the device decision bitwise the host's on CUDA).
* ``profile-*``: ``hvd-partialfc profile`` on the trainer itself (the shards, 8 loader workers at most,
  ``--torch-trace``): the phase split on the GPU's clock, idle time, top kernels, host syncs CUDA saw;
  ``-nvjpeg``: with ``data.decode=gpu``; ``-bf16``: bf16, its top kernels beside fp16's (why bf16 was the slower).
* ``switches``: each fast-path key on against the defaults, one process, alternating rounds (iresnet50,
  125k-class ``local``): channels_last, fused kernels, the device decision, bf16, and all the winners'
  candidates together. ``compile-*``: train.compile's settings, each against the defaults again.
* ``largest-*``: the largest batch ``local`` fits: peak memory at two batches, a line through them, 92% of
  the GPU's memory, checked by running it.
``--tiny`` runs every cell at toy sizes on the CPU (tests/test_gpu_check.py), compile with dynamo's eager
backend: its test measures nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hvd_partialfc.atomic import write_text  # noqa: E402
from hvd_partialfc.tools import arcface_compare as cmp  # noqa: E402
from hvd_partialfc.tools.arcface_step import find_arcface  # noqa: E402
from scripts.gpu.publish import publish_from_env  # noqa: E402
from scripts.gpu.speed_cells import CellClock, run_cell, why_not_start  # noqa: E402

SWITCHES = {"defaults": [], "channels_last": ["train.channels_last=true"],
            "fused kernels": ["optim.backbone_kernel=fused"],
            "device decision": ["train.skip_decision=device", "optim.backbone_kernel=fused"],
            "bf16": ["train.precision=bf16"], "bf16 + channels_last": ["train.precision=bf16", "train.channels_last=true"],
            "channels_last + fused + device": ["train.channels_last=true", "optim.backbone_kernel=fused",
                                               "train.skip_decision=device"]}
COMPILES = {"compile-blocks": ["train.compile=blocks"], "compile-model": ["train.compile=model"],
            "compile-cudagraphs": ["train.compile=model", "train.compile_mode=reduce-overhead"],
            "compile-head": ["train.compile_head=true"]}


TINY_CELLS = ("profile-r50", "switches", "largest-r50", "compare-r50-125k-bmax")   # each code path once


def sizes(tiny: bool, arcface: str) -> Dict[str, Any]:
    """The cells' sizes: the GPU's, or the dry run's toy ones. Ours is then always the small resnet (width 4);
    where arcface_torch is compared, it gets its iresnet with one block a stage (a name it knows) at 112 px, the
    size its iresnet's head needs, and ours runs at 112 px too. The dry run measures nothing: it runs the
    plumbing, at a fraction of the CPU time our own iresnet at 112 px would take in every cell."""
    if tiny:
        toy = {"r50": "iresnet18", "blocks": "1,1,1,1", "image_size": 112} if arcface else \
            {"r50": "resnet", "blocks": "", "image_size": 32}
        toy["ours"] = ["model.name=resnet", "model.kwargs={width: 4}"]
        return dict(toy, tiny=True, r100=toy["r50"], batch=2, k125=50, k1250=80, gathered=2, precision="fp32",
                    rounds=1, steps=1, warmup=1, profile=["1", "1"], workers=1,
                    profile_model=["--set", "model.name=resnet", "--set", "model.kwargs={width: 8}"])
    return {"tiny": False, "r50": "iresnet50", "r100": "iresnet100", "blocks": "", "image_size": 112, "ours": [],
            "batch": 128, "k125": 125_000, "k1250": 1_250_000, "gathered": 8, "precision": "fp16", "rounds": 3,
            "steps": 10, "warmup": 5, "profile": ["10", "20"], "profile_model": [],
            "workers": max(1, min(8, (os.cpu_count() or 4) - 2))}


def compare_args(s, arcface_dir, model, classes, batch, contenders="arcface,local,global", sets=()):
    names = contenders.split(",") if arcface_dir else [c for c in contenders.split(",") if c != "arcface"]
    return SimpleNamespace(arcface_dir=arcface_dir, contenders=",".join(names), model=model, blocks=s["blocks"],
                           batch=batch, image_size=s["image_size"], classes=classes, gathered=s["gathered"],
                           sample_rate=0.1, precision=s["precision"], warmup=s["warmup"], rounds=s["rounds"],
                           steps=s["steps"], pool=4, device="cpu" if s["tiny"] else "auto", threads=0, no_ddp=True,
                           set=s["ours"] + list(sets), out=None)


def free_memory() -> None:
    """The last contender's or cell's device memory back before the next one is built: a built step's parts
    hold each other in reference cycles, so ``del`` leaves them to the cyclic collector (iresnet50 and a
    125k-class head with their gradients and momentum: 1.3 GB by their sizes, which a largest-batch line or
    the next contender alone would count); then the cached blocks go back to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(a) -> Dict[str, Any]:
    r = cmp.run(a)
    if not a.arcface_dir:
        r["note"] = "arcface_torch not measured: no --arcface-dir (ARCFACE_DIR) on this machine"
    return r


def compare_alone(a) -> Dict[str, Any]:
    """Each contender built, measured and freed alone (the largest batch: three heads would not fit together)."""
    out = None
    for name in a.contenders.split(","):
        r = cmp.run(SimpleNamespace(**dict(vars(a), contenders=name)))
        out = r if out is None else dict(out, contenders={**out["contenders"], **r["contenders"]})
        free_memory()
    base = out["contenders"].get("arcface", {}).get("median_ms")
    for r in out["contenders"].values():
        if base and "median_ms" in r:
            r["speed_vs_arcface"] = base / r["median_ms"]
    return out


def switches(s, cells: Dict[str, List[str]], model: str) -> Dict[str, Any]:
    """Our ``local`` step under each set of keys, 125k classes: built together and measured in alternating
    rounds (cmp.measure); with ``train.compile_head`` one after the other instead, since the softmax's
    compiled passes are the process's (margins.py ``compile_passes``): every step built before would use them."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not s["tiny"] \
        else torch.device("cpu")
    a = compare_args(s, None, model, s["k125"], s["batch"], contenders="local")
    from torch._dynamo.utils import counters
    graph_skips = counters["inductor"]["cudagraph_skips"]
    total = a.warmup + a.rounds * a.steps + 1

    def build(name, sets):
        try:
            fn = cmp.our_step(SimpleNamespace(**dict(vars(a), set=a.set + sets)), "local", device, total)
            data = cmp.device_batches(a, device, a.classes)
            return {"run": lambda d=data, f=fn: f(d), "compiled": fn.compiled}
        except Exception as e:    # a key that fails here is a result: recorded, the others go on
            return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    built: Dict[str, Any] = {}
    if any("train.compile_head=true" in sets for sets in cells.values()):
        out = {}
        for name, sets in cells.items():
            built[name] = build(name, sets)
            out.update(cmp.measure(a, device, {name: built[name]}))
    else:
        built = {name: build(name, sets) for name, sets in cells.items()}
        out = cmp.measure(a, device, dict(built))
    for name, c in built.items():
        if c.get("compiled") not in (None, {"compile": "none"}):     # what compiled, its seconds, or its fallback
            out[name]["compile"] = c["compiled"]
    base = out.get("defaults", {}).get("median_ms")
    for r in out.values():
        if base and "median_ms" in r:
            r["speed_vs_defaults"] = base / r["median_ms"]
    result = {"model": model, "batch": a.batch, "classes": a.classes, "precision": a.precision, "cells": out,
              "sets": cells}
    if any("train.compile_mode=reduce-overhead" in sets for sets in cells.values()):
        # inductor says why it ran a graph without CUDA graphs only in its "cudagraphs" log, which is off by
        # default: its count of such skips here (0: the compiled cell's figure is CUDA graphs')
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - graph_skips
        if result["cudagraph_skips"]:
            print(f"speed: reduce-overhead ran without CUDA graphs {result['cudagraph_skips']} time(s) "
                  "(TORCH_LOGS=cudagraphs says why)", flush=True)
    return result


def profile(s, work: str, out: str, name: str, extra: List[str], limit_s: float) -> Dict[str, Any]:
    """``hvd-partialfc profile`` of the trainer in a process of its own (the GPU's clock and memory are then its
    own alone); in the dry run (tiny) the same command line in this process: a second process would import
    torch and its compiler again (3-4 CPU-seconds on the test's 2-core machine), and the dry run measures nothing."""
    folder = os.path.join(out, "speed", name)
    argv = [sys.executable, "-m", "hvd_partialfc.cli", "profile", "--config", os.path.join(ROOT, "configs",
            "ms1mv3_r50.yaml"), "--shards", os.path.join(work, "head125k"), "--profile-out", folder,
            "--warmup", s["profile"][0], "--profile-steps", s["profile"][1], *([] if s["tiny"] else ["--torch-trace"]),
            "--set", "head.mode=local", "--set", f"data.batch_size={s['batch']}", "--set", f"data.workers={s['workers']}",
            "--set", f"train.precision={'bf16' if s['tiny'] else 'fp16'}", "--set", "train.engine=torch",
            "--set", f"train.device={'cpu' if s['tiny'] else 'cuda'}", *s["profile_model"],
            *extra]
    if s["tiny"]:        # the cell's limit holds here too (speed_cells.cut_after)
        from hvd_partialfc import cli
        try:
            code = cli.main(argv[3:])
        except SystemExit as e:      # argparse's refusal: the cell's failure, not the stage's end
            code = e.code
        if code != 0:
            raise RuntimeError(f"profile exited {code}")
    else:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                           env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
        if p.returncode != 0:
            raise RuntimeError(f"profile exited {p.returncode}: {p.stderr[-1500:]}")
        print(p.stdout[-2500:], flush=True)
    with open(os.path.join(folder, "profile.json")) as f:
        return json.load(f)


def gpu_tests(limit_s: float) -> Dict[str, Any]:
    """The fast paths' GPU tests (tests/test_fast_paths.py, marked gpu): the device decision on CUDA."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests/test_fast_paths.py"], cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                       env=dict(os.environ, HVD_PARTIALFC_TEST_GPU="1"))
    if p.returncode != 0:
        raise RuntimeError(f"pytest exited {p.returncode}: {p.stdout[-1500:]}")
    return {"summary": p.stdout.strip().splitlines()[-1]}


def largest_batch(s, model: str) -> Dict[str, Any]:
    """The largest batch ``local`` fits (see the module docstring); on CPU (tiny) the batch itself."""
    if not torch.cuda.is_available() or s["tiny"]:
        return {"batch": s["batch"], "note": "no GPU: the tiny batch"}
    device = torch.device("cuda", torch.cuda.current_device())
    total_mem = torch.cuda.get_device_properties(device).total_memory

    def peak(batch: int) -> int:
        free_memory()              # the previous try's parts (an out-of-memory one's too) are not counted here
        a = compare_args(s, None, model, s["k125"], batch, contenders="local")
        fn = cmp.our_step(a, "local", device, 4)
        data = cmp.device_batches(SimpleNamespace(**dict(vars(a), pool=1)), device, a.classes)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(2):
            fn(data)
        torch.cuda.synchronize(device)
        used = torch.cuda.max_memory_allocated(device)
        del fn, data
        free_memory()
        return used
    p1, p2 = peak(128), peak(256)
    per = (p2 - p1) / 128
    batch = int((0.92 * total_mem - (p1 - 128 * per)) / per) // 32 * 32
    tried = []
    for _ in range(3):
        try:
            tried.append(batch)
            peak(batch)
            return {"batch": batch, "peak_128_gib": p1 / 2 ** 30, "peak_256_gib": p2 / 2 ** 30,
                    "gib_per_sample": per / 2 ** 30, "gpu_gib": total_mem / 2 ** 30, "tried": tried}
        except torch.cuda.OutOfMemoryError:
            batch = int(batch * 0.85) // 32 * 32      # its parts are freed by the next peak's free_memory
    raise RuntimeError(f"no batch of {tried} fits")


def plan(s, work: str, out: str, arcface: str, left: Callable[[], float]) -> List[Any]:
    """(name, estimated seconds on an H100, what to run) in the order they run: the headline comparison
    first, so that nothing before it can spend the call. ``left()``: the running cell's seconds to its
    limit (its subprocesses' timeout)."""
    r50, r100, b, k, kk = s["r50"], s["r100"], s["batch"], s["k125"], s["k1250"]
    found: Dict[str, Any] = {}

    def at_max(model):
        return lambda: compare_alone(compare_args(s, arcface, model, k, found.get(model, {}).get("batch", b)))

    def find(model):
        def go():
            found[model] = largest_batch(s, model)
            return found[model]
        return go
    def compiled(name):
        return lambda: switches(s, {"defaults": [], "compiled": COMPILES[name]}, r50)
    cells = [("compare-r50-125k", 35, lambda: compare(compare_args(s, arcface, r50, k, b))),
             ("gpu-tests", 25, lambda: gpu_tests(left())),
             ("profile-r50", 30, lambda: profile(s, work, out, "profile-r50", [], left())),
             ("switches", 45, lambda: switches(s, {k: v for k, v in SWITCHES.items() if not s["tiny"] or k in
                                                   ("defaults", "channels_last", "device decision")}, r50)),
             ("compare-r50-1250k", 45, lambda: compare(compare_args(s, arcface, r50, kk, b))),
             ("compare-r100-125k", 45, lambda: compare(compare_args(s, arcface, r100, k, b))),
             ("compile-cudagraphs", 90, compiled("compile-cudagraphs")),
             ("compile-blocks", 60, compiled("compile-blocks")),
             ("profile-r50-bf16", 30, lambda: profile(s, work, out, "profile-r50-bf16",
                                                      ["--set", "train.precision=bf16"], left())),
             ("profile-r50-nvjpeg", 30, lambda: profile(s, work, out, "profile-r50-nvjpeg",
                                                        ["--set", f"data.decode={'cpu' if s['tiny'] else 'gpu'}"],
                                                        left())),
             ("compare-r100-1250k", 55, lambda: compare(compare_args(s, arcface, r100, kk, b))),
             ("largest-r50", 20, find(r50)), ("compare-r50-125k-bmax", 45, at_max(r50)),
             ("largest-r100", 25, find(r100)), ("compare-r100-125k-bmax", 60, at_max(r100)),
             ("compile-model", 90, compiled("compile-model")), ("compile-head", 40, compiled("compile-head"))]
    if s["tiny"]:     # each kind of cell once: the CPU test of this script stays short
        cells = [c for c in cells if c[0] in TINY_CELLS]
    return cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--arcface-dir", default="")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds this stage may take")
    ap.add_argument("--deadline", type=float, default=None, help="the call's one deadline (seconds since the "
                    "epoch): no cell starts or runs past it")
    ap.add_argument("--only", default="", help="these cells (comma-separated names) alone, ignoring the budget")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args(argv)
    arcface = ""
    if a.arcface_dir:       # asked for and absent: refused before any work, not measured without it
        try:
            arcface = find_arcface(a.arcface_dir)
        except ValueError as e:
            print(f"gpu_speed_check: {e}", file=sys.stderr, flush=True)
            return 2
    s = sizes(a.tiny, arcface)
    if a.tiny:
        from hvd_partialfc.run import speed
        speed.COMPILE_BACKEND = "eager"      # the plumbing without inductor's minutes of CPU compiling
        # The dry run's switches run channels_last on the CPU, where torch 2.13's oneDNN weight gradient of a 1x1
        # stride-2 convolution in that layout corrupts the heap on some CPUs (an AMD EPYC, AVX2: "free(): invalid
        # size", or a hang with 2 threads; fine with oneDNN off). A GPU never takes that path; the dry run checks
        # the script's plumbing, not the kernels.
        torch.backends.mkldnn.enabled = False
    os.makedirs(os.path.join(a.out, "speed"), exist_ok=True)
    result: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "budget_s": a.budget, "tiny": a.tiny,
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                              "torch": torch.__version__, "arcface_dir": arcface or None, "cells": []}
    if not arcface:
        print("speed: arcface_torch skipped: no ARCFACE_DIR given (ours alone in the comparisons)", flush=True)
    only = set(filter(None, a.only.split(",")))
    from scripts.gpu.speed_table import table   # the GPU speed table from speed.json

    def save() -> None:
        """speed.json and the table after every cell, here and in the call's $OUT (publish.py): a call
        cut inside a later cell brings back what is written here."""
        write_text(os.path.join(a.out, "speed.json"), json.dumps(result, indent=1, default=str))
        write_text(os.path.join(a.out, "speed_table.md"), table(result, a.out))
        publish_from_env()
    clock = CellClock(a.deadline)
    budget = math.inf if a.tiny else a.budget
    t0 = time.perf_counter()
    for name, cost, fn in plan(s, a.work, a.out, arcface, clock.left):
        if only and name not in only:
            continue
        reason = None if only else why_not_start(name, cost, time.perf_counter() - t0, budget, clock)
        if reason:
            cell = {"name": name, "status": "skipped", "reason": reason}
            print(f"speed: {name} skipped ({reason})", flush=True)
        else:
            cell = run_cell(name, cost, fn, clock)
            free_memory()                  # the cell's models and heads go before the next cell's
            print(f"speed: {name} {cell['status']} in {cell['seconds']:.0f} s", flush=True)
        result["cells"].append(cell)
        save()
    save()
    print(table(result, a.out), flush=True)
    ran = [c["status"] for c in result["cells"] if c["status"] != "skipped"]
    return 1 if ran and "ok" not in ran else 0      # nothing measured: the stage failed


if __name__ == "__main__":
    from hvd_partialfc.cli_support import freeze_at_exit
    try:
        raise SystemExit(main())
    finally:
        freeze_at_exit()      # the exit skips the shutdown's collections over torch's objects
