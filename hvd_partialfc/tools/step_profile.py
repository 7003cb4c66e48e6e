"""``hvd-partialfc profile``: where the trainer's step spends its time, on CPU or CUDA, under any launcher.

    hvd-partialfc profile --config configs/ms1mv3_r50.yaml --shards SHARDS --profile-out runs/prof
    torchrun --nproc-per-node 2 -m hvd_partialfc.cli profile ... --set train.device=cpu     # + the overlap
    horovodrun -np 2 hvd-partialfc profile ... [--torch-trace]

The run is the trainer's own (``run.startup.start_trainer``: the shards, the loader and its workers, the
parts, the step), driven step by step here instead of by ``Trainer.fit``: ``--warmup`` steps, then
``--profile-steps`` marked steps (tools/profile_marks.py: loader wait, host-to-device, backbone and head forward
and backward, gradient wait, the decision's host read, both optimizers, on the host clock and on CUDA's),
then, with ``--torch-trace``, a few steps under torch.profiler (its kernel trace: the GPU's busy share and
idle time, the top kernels, NCCL beside compute). Gradient averaging's intervals come from the torch
engine's bucket timeline, or Horovod's timeline file (rank 0), and their overlap with the backward is
worked out per step (tools/profile_trace.py ``overlap``). On CUDA, ``torch.cuda.set_sync_debug_mode`` counts
the host synchronisations CUDA sees during the marked steps.

Rank 0 writes ``PROFILE_OUT/profile.json`` (everything, per step too), ``step_trace.json`` (a Chrome trace:
host phases, GPU phases, all-reduces), ``torch_trace.json`` (``--torch-trace``) and, under Horovod,
``horovod_timeline.json``, and prints the table. The run folder is ``PROFILE_OUT/run`` (no checkpoint is
written). Figures: docs/evidence/benchmarks.md ("The step profile").
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from contextlib import nullcontext
from typing import Any, Dict, List

import torch

from ..atomic import write_text
from ..engine.select import choose_engine, start_engine
from .profile_marks import StepProfiler, step_windows
from .profile_trace import chrome_trace, format_table, gpu_summary, horovod_allreduces, overlap, phase_table
from ..run.startup import start_trainer

TORCH_TRACE_STEPS = 5


def add_arguments(p) -> None:
    p.add_argument("--profile-out", default="runs/profile", help="folder for profile.json and the traces")
    p.add_argument("--warmup", type=int, default=5, help="steps before the marked ones (cuDNN's search, the loader)")
    p.add_argument("--profile-steps", type=int, default=20, help="marked steps")
    p.add_argument("--torch-trace", action="store_true",
                   help=f"then {TORCH_TRACE_STEPS} steps under torch.profiler: its trace, the GPU's busy share, top kernels")


def run(cfg, args) -> int:
    """Profile ``cfg``'s training step (module docstring); 0 on success."""
    out = os.path.abspath(args.profile_out)
    traced = TORCH_TRACE_STEPS if args.torch_trace else 0
    engine, comm, trainer = _start(cfg, args, out, traced)
    parts, device = trainer.parts, trainer.step.device
    buckets = getattr(parts.backbone_opt, "timeline", "none")   # the torch engine's bucket timeline
    if buckets is None:
        parts.backbone_opt.timeline = buckets = []
    batches = iter(trainer.loader)
    timed = _marked_steps(trainer, batches, args.warmup, args.profile_steps)
    cuda = device.type == "cuda"
    trace_file = os.path.join(out, "torch_trace.json") if traced else None
    if traced:
        _torch_trace(trainer, batches, args.warmup + args.profile_steps, traced, trace_file, cuda)
    timed["peak"] = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None
    if engine == "horovod":    # its timeline's writer thread drops what is still queued at shutdown (Horovod
        time.sleep(0.5)        # 0.28, timeline.cc): the last step's events went missing in 1 run of 3 without this
    comm.shutdown()
    if not comm.is_main:
        return 0
    intervals, source = [], ""
    timeline = os.path.join(out, "horovod_timeline.json")
    if comm.size == 1:
        pass                                  # nothing is averaged at one rank (neither engine registers hooks)
    elif isinstance(buckets, list):
        intervals, source = [(a, b) for _, _, a, b in buckets if b is not None], "torch engine buckets, host clock"
    elif engine == "horovod" and os.path.exists(timeline):
        intervals, source = horovod_allreduces(timeline, timed["epoch_minus_perf"]), "Horovod timeline, rank 0"
    phases = timed["phases"]
    averaging = dict(overlap(step_windows(phases), intervals), source=source) if intervals else {
        "note": f"none at {comm.size} rank(s)" if comm.size == 1 else "no all-reduce intervals recorded"}
    result = _result(cfg, args, engine, comm, parts, device, timed, averaging, traced, trace_file)
    write_text(os.path.join(out, "profile.json"), json.dumps(result, indent=1))
    write_text(os.path.join(out, "step_trace.json"),
               json.dumps(chrome_trace(phases, intervals, comm.rank, min(r[0][1] for r in phases.values()))))
    print(format_table(result))
    print(f"wrote {out}/profile.json, step_trace.json" + (", torch_trace.json" if traced else ""), flush=True)
    return 0


def _start(cfg, args, out: str, traced: int):
    """The run the profile trains (its folder under ``out``, no checkpoints, no snapshots): (engine, comm,
    trainer). Under Horovod its timeline is asked for on every rank (``HOROVOD_TIMELINE``, read by hvd.init()):
    set on rank 0 alone, Horovod's start hung; rank 0 writes it."""
    cfg.out = os.path.join(out, "run")
    cfg.train.steps = args.warmup + args.profile_steps + traced
    cfg.checkpoint.every, cfg.checkpoint.memory_every = 0, 0
    engine = choose_engine(cfg.train.engine, os.environ)
    os.makedirs(out, exist_ok=True)
    if engine == "horovod":
        os.environ["HOROVOD_TIMELINE"] = os.path.join(out, "horovod_timeline.json")
    comm = start_engine(cfg.train.engine, os.environ, cfg.train.device, share_gpu=cfg.train.share_gpu,
                        collective_timeout_s=cfg.train.collective_timeout,
                        allow_host_allreduce=cfg.train.allow_host_allreduce)
    return engine, comm, start_trainer(cfg, comm)


def _marked_steps(trainer, batches, warmup: int, steps: int) -> Dict[str, Any]:
    """``warmup`` steps, then ``steps`` marked ones (StepProfiler): their phases, every step's wall time, the wall
    time of the marked ones, CUDA's host synchronisations in them, and the epoch's offset of the host clock."""
    device = trainer.step.device
    cuda = device.type == "cuda"
    profiler = StepProfiler(trainer.parts, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    epoch_minus_perf = time.time() - time.perf_counter()
    walls: List[float] = []
    syncs: List[Any] = []
    t_marked = 0.0
    with trainer.step.watched_by(profiler):
        for step in range(warmup + steps):
            marked = step >= warmup
            if step == warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                t_marked = time.perf_counter()
            t0 = time.perf_counter()
            with _counting_syncs(syncs) if marked and cuda else nullcontext():
                profiler.run_step(step, lambda: trainer.train_step(step, batches), marked)
            walls.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize(device)
    wall_marked = time.perf_counter() - t_marked
    phases = profiler.marks.phases()
    profiler.close()
    return {"phases": phases, "walls": walls, "wall_marked": wall_marked, "syncs": syncs,
            "epoch_minus_perf": epoch_minus_perf}


def _result(cfg, args, engine: str, comm, parts, device, timed: Dict[str, Any], averaging: Dict[str, Any],
            traced: int, trace_file) -> Dict[str, Any]:
    """profile.json's record."""
    cuda = device.type == "cuda"
    batch = cfg.data.batch_size * cfg.optim.backward_passes_per_step
    marked_walls, wall_marked, syncs = timed["walls"][args.warmup:], timed["wall_marked"], timed["syncs"]
    return {
        "what": "hvd-partialfc profile", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "cpus": os.cpu_count(), "engine": engine, "world_size": comm.size,
        "config": {"model": cfg.model.name, "batch": cfg.data.batch_size, "precision": cfg.train.precision,
                   "mode": cfg.head.mode, "sample_rate": cfg.head.sample_rate, "classes_this_rank": parts.head.width,
                   **vars(parts.fast), "device_decision": parts.device_skips is not None,   # auto resolved
                   "compile_mode": cfg.train.compile_mode, "compile_head": cfg.train.compile_head,
                   "classifier_kernel": cfg.optim.classifier_kernel, "data_decode": cfg.data.decode,
                   "workers": cfg.data.workers, "head_matmul": cfg.head.matmul},
        "warmup": args.warmup, "steps": args.profile_steps, "compile": parts.compiled,
        "step_ms": {"median": 1e3 * statistics.median(marked_walls), "mean_wall": 1e3 * wall_marked / len(marked_walls)},
        "samples_per_s": batch * len(marked_walls) / wall_marked, "first_step_ms": 1e3 * timed["walls"][0],
        "phases": phase_table(timed["phases"]), "averaging": averaging,
        "gpu": gpu_summary(trace_file) if trace_file and cuda else {},
        "host_syncs_per_step": len(syncs) / len(marked_walls) if cuda else None,
        "host_sync_samples": [str(w.message)[:160] for w in syncs[:3]],
        "peak_gib": timed["peak"], "files": {"trace": "step_trace.json",
                                             "torch_trace": "torch_trace.json" if traced else None,
                                             "horovod_timeline": "horovod_timeline.json" if engine == "horovod" else None}}


class _counting_syncs:
    """CUDA's own count of the host synchronisations inside (``set_sync_debug_mode("warn")``), appended to
    ``into`` as the warnings it gives."""

    def __init__(self, into: List[Any]):
        self.into = into

    def __enter__(self):
        self.catch = warnings.catch_warnings(record=True)
        self.caught = self.catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self.catch.__exit__(*exc)
        self.into += [w for w in self.caught if "synchroniz" in str(w.message)]


def _torch_trace(trainer, batches, first: int, steps: int, path: str, cuda: bool) -> None:
    """``steps`` more steps under torch.profiler (after the marked ones: its own overhead stays out of them)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for step in range(first, first + steps):
            with record_function(f"ProfilerStep#{step}"):   # the step's span in the trace (profile_trace.gpu_summary)
                trainer.train_step(step, batches)
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
