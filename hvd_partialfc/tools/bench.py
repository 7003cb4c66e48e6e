"""``hvd-partialfc bench``: the three classifier modes side by side, and the limit, on synthetic data.

    hvd-partialfc bench [--config configs/bench.yaml] [--classes 10000,100000,...] [--dims 128,512]
                        [--modes local,global,replicated] [--np 2] [--steps 5] [--warmup 2] [--out DIR] [--plot]
                        [--negatives-every K [--negatives-share S]] [--engines horovod,torch]
                        [--in-shape 112,112,3]

For every (classes, dim) point the driver (this process, no engine) launches one job per mode and engine
(``--engines``: ``horovod`` under ``horovodrun -np N --gloo``, ``torch`` under ``torchrun --nproc-per-node N
--standalone``, bench_engines.py; each point records its engine, and ``engine_ratios`` the torch / horovod
samples/s of the same run) and one *limit* job: the same backbone and the same local classifier work
(a slice of C / N classes) in a process that never initialises Horovod (its "optimizer" never
communicates): what ``local`` would cost with free communication. ``local`` is the bare method
(``head.negatives_every=0``); ``--negatives-every K`` adds a ``negatives`` job: ``local`` with cross-shard
negatives every K steps, ``--negatives-share`` centres per rank (0: the whole slice), so their memory is
measured against the estimator's figure for the same settings. Each job is a fresh process, so its
peak RSS is its own. Every job runs the trainer's own step (``step.Step``, one step for every mode)
on synthetic batches held in memory (no disk), with one torch thread per rank: feature vectors of
``--in-dim``, or ``--in-shape`` (H, W[, C]) images for the image backbones, as model input already.

The step time is split with hooks, without touching the loop: data (``train_step``'s own figure),
forward (backbone pre-hook to classifier post-hook), backward (to the gradient synchronisation), comm
wait (the averaging optimizer's ``synchronize`` plus the time inside the head's collectives), optimizer
(the rest of the step). Both engines start the gradient all-reduces from autograd hooks *during* the
backward pass (Horovod's DistributedOptimizer per tensor, fused each cycle; the torch engine's
``BucketAverager`` per ~25 MB bucket) and ``synchronize()`` waits for what is still in flight, then writes
the averages back. So under both, *comm* is the time the step is blocked on communication after backward
(plus the head's collectives, taken out of forward / backward), and communication that overlaps the
backward pass (launching, flattening a bucket, the engine's thread taking a core) shows up as a longer
*backward* than the limit's. Both engines also count ``synchronize``'s wait in ``comm.wait_s``: that part
lies inside ``synchronize`` and is counted once. Bytes per step are counted from the tensors handed to
collectives: the gradients of the parameters the averaging optimizer holds (Horovod's are computed
from the parameters; the torch engine counts its buckets in ``comm.sent_bytes`` itself), plus what
``Comm``'s tensor collectives counted.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..engine.base import gradient_bytes
from ..classifier.modes import get_mode, list_modes
from .bench_engines import ENGINES, NO_ENGINE, engine_ratios, launch
from .bench_table import PHASES, markdown, plot


# --- the worker: one rank of one job ----------------------------------------------------------------
def _peak_rss() -> int:
    """Peak RSS in bytes: VmHWM, reset at exec (ru_maxrss keeps a forking parent's peak across exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _synthetic_batches(batch: int, in_shape: Sequence[int], width: int, seed: int, pool: int = 4):
    """Endless batches from a small pool in memory: (features float32 (B, F), local labels (B,))."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, *in_shape, generator=g) for _ in range(pool)]
    ys = [torch.randint(0, width, (batch,), generator=g) for _ in range(pool)]
    i = 0
    while True:
        yield xs[i % pool], ys[i % pool]
        i += 1


class _Stamps:
    """The phase boundaries of the step, stamped into ``marks`` (seconds, and the engine's wait so far): forward
    hooks for the backbone and head, and a step watcher (step.py) for the gradient synchronisation."""

    def __init__(self, parts, comm):
        self.marks: Dict[str, float] = {}
        self.comm = comm
        parts.backbone.register_forward_pre_hook(lambda *a: self.mark("fwd0"))
        parts.head.register_forward_hook(lambda *a: self.mark("fwd1"))

    def mark(self, key: str) -> None:
        self.marks[key] = time.perf_counter()
        self.marks[key + ".wait"] = self.comm.wait_s


def _timed_steps(a, comm, step_fn, batches, marks: Dict[str, float]) -> Tuple[Any, float, Dict[str, float]]:
    """``a.warmup`` steps, then ``a.steps`` timed ones: (the last step's figures, their seconds, those seconds split
    by phase, each phase less the engine's waits inside it, which count as communication)."""
    split = {k: 0.0 for k in PHASES}
    total = 0.0
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            comm.sent_bytes = 0
        t0, w0 = time.perf_counter(), comm.wait_s
        out = step_fn(step, batches)
        t1 = time.perf_counter()
        if step < a.warmup:
            continue
        waits = {k: marks[k + ".wait"] for k in ("fwd0", "fwd1", "sync0", "sync1")}
        head_wait_fwd = waits["fwd1"] - waits["fwd0"]
        head_wait_bwd = waits["sync0"] - waits["fwd1"]
        sync_wait = waits["sync1"] - waits["sync0"]      # inside synchronize already
        split["data"] += out["data_time"]
        split["forward"] += marks["fwd1"] - marks["fwd0"] - head_wait_fwd
        split["backward"] += marks["sync0"] - marks["fwd1"] - head_wait_bwd
        split["comm"] += marks["sync1"] - marks["sync0"] + (comm.wait_s - w0 - sync_wait)
        split["optimizer"] += t1 - marks["sync1"]
        total += t1 - t0
    return out, total, split


def run_worker(a) -> Dict[str, Any]:
    """One rank of one job: build the trainer's components for ``a.mode``, run steps, measure."""
    torch.set_num_threads(1)
    from ..config_io import load_config
    from ..data.layout import RankLayout
    from ..engine.local import LocalComm
    from ..engine.select import start_engine
    from ..models import model_input_shape
    from ..run.parts import build_parts
    from ..run.step import Step
    limit = a.mode == "limit"
    # the limit: rank r of N alone, what `local` costs with free communication; else the launcher's engine
    comm = LocalComm(a.rank, a.np) if limit else start_engine(a.engine, os.environ, "cpu")
    # `negatives` is `local` with cross-shard negatives; every other job runs its mode bare
    every = a.negatives_every if a.mode == "negatives" else 0
    cfg = load_config(a.config or None, [*(a.set or []), "data.shards=synthetic", "train.device=cpu",
                                         f"head.mode={a.mode if a.mode in list_modes() else 'local'}",
                                         f"model.embedding_dim={a.dim}", f"data.batch_size={a.batch}",
                                         "train.threads=1", f"head.negatives_every={every}",
                                         f"head.negatives_share={a.negatives_share}", "head.negatives_pool=0"])
    rss_runtime = _peak_rss()
    in_shape = a.in_shape or [a.in_dim]
    # the trainer's own parts and step, without shards on disk; every rank's width (the negatives' shares)
    layout = RankLayout.even(a.classes, comm.size)
    parts = build_parts(cfg, comm, layout, in_shape, torch.device("cpu"))
    width = layout.slices[comm.rank].width
    grad_bytes = 0 if limit else gradient_bytes(parts.backbone_opt_params(), cfg.optim.fp16_compression)
    stamps = _Stamps(parts, comm)
    step_fn = Step(cfg, comm, parts, torch.device("cpu"), "features", a.warmup + a.steps, watchers=[stamps])
    batches = _synthetic_batches(a.batch, model_input_shape(in_shape), width, seed=comm.rank)
    out, total, split = _timed_steps(a, comm, step_fn, batches, stamps.marks)
    engine = NO_ENGINE if limit else a.engine
    # the torch engine counts the gradient buckets it sends in sent_bytes; Horovod's optimizer counts nothing
    sent = comm.sent_bytes / a.steps + (0 if engine == "torch" else grad_bytes)
    comm.shutdown()
    return {"logits_per_step": _logits_per_step(a.batch, comm.size, cfg, parts), "sample_rate": cfg.head.sample_rate,
            "mode": a.mode, "engine": engine, "rank": comm.rank, "np": comm.size, "classes": a.classes,
            "dim": a.dim, "batch": a.batch, "width": parts.head.width, "steps": a.steps,
            "step_s": total / a.steps, "samples_per_s": a.batch * a.steps / total,
            "split_s": {k: v / a.steps for k, v in split.items()}, "bytes_per_step": int(sent),
            "grad_bytes": grad_bytes, "peak_rss": _peak_rss(), "runtime_rss": rss_runtime,
            "backbone_params": sum(p.numel() for p in parts.backbone.parameters()),
            "loss": out["loss"]}


def _logits_per_step(batch: int, ranks: int, cfg, parts) -> int:
    """Logits one rank computes per step: its rows (B; the gathered B x N for ``global``) x its columns (the
    head's rows, or ``max(int(rate x W), positives)`` sampled ones, taken as rate x W; plus the frozen
    remote centres of ``negatives``)."""
    width = parts.head.width
    rate = cfg.head.sample_rate
    cols = max(1, int(rate * width)) if rate < 1.0 and parts.mode.samples else width
    remote = getattr(parts.head, "remote", None)
    cols += remote.shape[0] if remote is not None else 0
    return parts.mode.estimate_logit_rows(batch, ranks) * cols


# --- the driver ------------------------------------------------------------------------------------
def _summarise(recs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-job figures: mean over ranks of the per-rank figures (peak RSS: the largest rank's)."""
    n = len(recs)
    return {"mode": recs[0]["mode"], "engine": recs[0]["engine"], "classes": recs[0]["classes"],
            "dim": recs[0]["dim"], "ranks": n,
            "sample_rate": recs[0]["sample_rate"], "logits_per_step": recs[0]["logits_per_step"],
            "width": recs[0]["width"], "samples_per_s": sum(r["samples_per_s"] for r in recs) / n,
            "step_s": sum(r["step_s"] for r in recs) / n,
            "split_s": {k: sum(r["split_s"][k] for r in recs) / n for k in PHASES},
            "bytes_per_step": max(r["bytes_per_step"] for r in recs), "grad_bytes": recs[0]["grad_bytes"],
            "peak_rss": max(r["peak_rss"] for r in recs), "runtime_rss": max(r["runtime_rss"] for r in recs),
            "backbone_params": recs[0]["backbone_params"]}


def _point(a, cfg, bb, mode: str, engine: str, classes: int, dim: int, rate: float) -> Dict[str, Any]:
    """One job's figures (its ranks launched and summarised), or why it was skipped: a mode that does not sample
    at ``rate`` < 1, or an estimated memory over ``--max-memory-gb``."""
    from .estimate import estimate
    negatives = mode == "negatives"
    if rate < 1.0 and mode in list_modes() and not get_mode(mode).samples:
        return _skipped(mode, engine, classes, dim, rate, f"{mode} does not sample")
    est = estimate(classes, 1 if mode == "limit" else a.np, dim, a.batch, cfg.model.name,
                   mode if mode in list_modes() else "local", optimizer=_opt_kind(cfg),
                   sample_rate=rate, bb=bb,
                   negatives_every=a.negatives_every if negatives else 0,
                   negatives_share=a.negatives_share if negatives else 0)
    if mode == "limit":  # the limit holds a local slice of C / N classes
        est = estimate(-(-classes // a.np), 1, dim, a.batch, cfg.model.name, "local",
                       optimizer=_opt_kind(cfg), sample_rate=rate, bb=bb)
    jobs = a.limit_procs if mode == "limit" else a.np
    if est["memory_total"] * jobs > a.max_memory_gb * 2 ** 30:
        point = _skipped(mode, engine, classes, dim, rate, f"estimated "
                         f"{est['memory_total'] * jobs / 2 ** 30:.1f} GB > --max-memory-gb")
        print(f"skip {mode:>10} {engine:>7} C={classes:>9,} D={dim}: {point['skipped']}", flush=True)
        return point
    t0 = time.time()
    s = _summarise(launch(a, mode, engine, classes, dim, a.out, a.timeout, rate))
    s["estimate"] = est["memory_total"]
    s["estimate_err"] = est["memory_total"] / s["peak_rss"] - 1
    print(f"{mode:>10} {engine:>7} C={classes:>9,} D={dim} r={rate:g}: "
          f"{s['samples_per_s']:8.1f} samples/s/rank  step {s['step_s'] * 1e3:7.1f} ms  "
          f"{s['bytes_per_step'] / 2 ** 20:9.2f} MB/step  "
          f"peak RSS {s['peak_rss'] / 2 ** 20:7.0f} MB (estimate {s['estimate_err']:+.0%})  "
          f"[{time.time() - t0:.0f} s]", flush=True)
    return s


def run_bench(a) -> Dict[str, Any]:
    from .estimate import backbone_figures
    os.makedirs(a.out, exist_ok=True)
    load0 = os.getloadavg()
    cfg = _bench_config(a)
    modes = list(a.modes)
    if a.negatives_every > 0 and "negatives" not in modes:
        modes.insert(modes.index("local") + 1 if "local" in modes else len(modes), "negatives")
    if "negatives" in modes and a.negatives_every <= 0:
        raise ValueError("the negatives job needs --negatives-every K > 0")
    rates = a.sample_rates or [cfg.head.sample_rate]   # --set head.sample_rate=R alone: one rate, every job
    for engine in a.engines:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r} in --engines; known: {', '.join(ENGINES)}")
    points: List[Dict[str, Any]] = []
    for dim in a.dims:
        bb = backbone_figures(cfg.model.name, dim, a.batch, a.in_shape or [a.in_dim], cfg.model.kwargs)
        for classes in a.classes:
            # every mode's jobs under each engine back to back, so their ratio sees the same machine load
            for rate, mode, engine in _jobs(rates, modes, a.engines):
                points.append(_point(a, cfg, bb, mode, engine, classes, dim, rate))
    _ratios(points)
    ratios = engine_ratios(points)
    load = os.getloadavg()
    argv = sys.argv[1:] if sys.argv[1:2] == ["bench"] else ["bench"] + sys.argv[1:]   # also python -m ...bench
    result = {"command": " ".join(["hvd-partialfc"] + argv), "np": a.np, "batch": a.batch,
              "steps": a.steps, "warmup": a.warmup, "backbone": cfg.model.name, "in_dim": a.in_dim,
              "in_shape": a.in_shape or [a.in_dim], "engines": a.engines, "engine_ratios": ratios,
              "limit_procs": a.limit_procs, "cycle_time_ms": a.cycle_time_ms,
              "sample_rates": a.sample_rates, "negatives_every": a.negatives_every,
              "negatives_share": a.negatives_share, "load_average_before": load0,
              "load_average_after": load, "cpus": os.cpu_count(), "points": points}
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if a.plot:
        plot(result, os.path.join(a.out, "bench.png"))
    return result


def _jobs(rates: List[float], modes: List[str], engines: List[str]) -> List[Tuple[float, str, str]]:
    """(rate, mode, engine) of one point's jobs, in run order: per rate the limit (no engine), then each
    mode under every engine back to back."""
    return [(r, m, e) for r in rates for m in ["limit"] + modes for e in ([NO_ENGINE] if m == "limit" else engines)]


def _skipped(mode: str, engine: str, classes: int, dim: int, rate: float, why: str) -> Dict[str, Any]:
    return {"mode": mode, "engine": engine, "classes": classes, "dim": dim, "sample_rate": rate, "skipped": why}


def _opt_kind(cfg) -> str:
    if cfg.optim.name == "adamw":
        return "adamw"
    return "sgd" if cfg.optim.classifier_momentum > 0 else "sgd-nomomentum"


def _bench_config(a):
    from ..config_io import load_config
    return load_config(a.config or None, [*(a.set or []), "data.shards=synthetic"])


def _ratios(points: List[Dict[str, Any]]) -> None:
    """Each point against the limit of its (classes, dim, rate), and ``local`` of its engine against it."""
    by = {(p["mode"], p.get("engine", "horovod"), p["classes"], p["dim"], p.get("sample_rate", 1.0)): p
          for p in points if "skipped" not in p}
    for (mode, engine, *key), p in by.items():    # the same rate's limit, and local of the same engine
        lim, loc = by.get(("limit", NO_ENGINE, *key)), by.get(("local", engine, *key))
        p["vs_limit"] = p["samples_per_s"] / lim["samples_per_s"] if lim else None
        p["local_vs_this"] = loc["samples_per_s"] / p["samples_per_s"] if loc else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(float(x)) for x in s.split(",")]  # noqa: E731  ("1e6" is fine)
    p.add_argument("--config", default="configs/bench.yaml", help="backbone / head / optimizer settings")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--classes", type=ints, default=[10_000, 100_000, 200_000, 1_000_000])
    p.add_argument("--dims", type=ints, default=[128, 512])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["local", "global", "replicated"],
                   help="jobs besides the limit: local, global, replicated, negatives (local + cross-shard "
                        "negatives, added by --negatives-every)")
    p.add_argument("--np", type=int, default=2, help="ranks per job (horovodrun -np, torchrun --nproc-per-node)")
    p.add_argument("--engines", type=lambda s: s.split(","), default=["horovod"],
                   help="run every job under each: horovod (horovodrun --gloo), torch (torchrun --standalone); "
                        "with both, the table adds torch / horovod samples/s per (mode, classes, dim)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--in-dim", type=int, default=512, help="synthetic input feature size")
    p.add_argument("--in-shape", type=ints, default=None, metavar="H,W[,C]",
                   help="synthetic images of this sample shape instead (image backbones: --set model.name=...)")
    p.add_argument("--limit-procs", type=int, default=2,
                   help="the limit runs this many independent processes at once (1: one process alone; "
                        "--np: the same machine load as the Horovod jobs)")
    p.add_argument("--cycle-time-ms", type=float, default=10.0,
                   help="HOROVOD_CYCLE_TIME for the jobs (Horovod's default 1 ms wakes its background thread "
                        "often enough to slow the training threads when every core is busy; 0: leave as is)")
    p.add_argument("--negatives-every", type=int, default=0,
                   help="K > 0: also a `negatives` job, local with cross-shard negatives every K steps (the "
                        "first exchange is at step 0, in the warm-up; bytes/step counts the measured steps)")
    p.add_argument("--negatives-share", type=int, default=0,
                   help="centres each rank shares in the negatives job (0: its whole slice)")
    p.add_argument("--sample-rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="head.sample_rate of every job, one set of jobs (limit included) per rate, e.g. 0.1,0.3 "
                        "(replicated runs at 1 only); default: the config's (--set head.sample_rate=R)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per job")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--max-memory-gb", type=float, default=16.0,
                   help="skip a job whose estimated memory (all its ranks) exceeds this")
    p.add_argument("--timeout", type=int, default=600, help="seconds per job")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--plot", action="store_true", help="also write bench.png (needs matplotlib)")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_partialfc.tools.bench")
    add_arguments(p)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--engine", default=NO_ENGINE, help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.worker:
        run_bench(a)
        return 0
    a.mode, a.classes = a.worker, a.classes[0]
    rec = run_worker(a)
    with open(os.path.join(a.job, f"rank-{rec['rank']}.json"), "w") as f:
        json.dump(rec, f)
    # At exit one collection, then the rest frozen: the interpreter's shutdown no longer walks torch's ~300,000
    # objects (0.7-1 CPU-second a rank; hvd_partialfc/cli_support.py's freeze_at_exit, which tools/ may not import)
    import atexit
    import gc
    atexit.register(lambda: (gc.collect(), gc.freeze()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
