"""Where a training step's time goes: the phases of the trainer's own step, marked by hooks on its parts and as
one of the step's watchers (step.py's marks around each batch and the gradient average), on the host clock and,
on CUDA, on the GPU's (an event per mark).

A *mark* starts a phase; a phase lasts to the next mark. Per backward pass: ``loader`` (waiting for the
batch), ``to device`` (the host-to-device copy and the layout change, up to the backbone), ``backbone
forward``, ``head forward`` (the mode's head and loss), ``head backward`` (up to the gradient of the
features), ``backbone backward``; then ``gradient wait`` (the averaging optimizer's ``synchronize``: what
the backward did not hide), ``norms and decision`` (unscale, the norms, the skip decision: the host read),
``backbone optimizer``, ``books`` (the decision's counters), ``head optimizer``, ``step end`` (the figures,
back to the loop); ``step start`` (lr, zero_grad, the head's periodic collective) opens each step.

On CUDA the host marks time the *launches*: the host runs ahead of the GPU until something waits, so a
host phase may be short while its kernels run long. The CUDA events recorded at the same marks time the
GPU's side: the span between two events is the GPU work queued between the marks (plus the GPU's idle
time there, which the kernel trace of ``profile_trace.gpu_summary`` separates).

Gradient averaging and its overlap with the backward: every all-reduce of the backbone gradient as an
interval on the host clock, from the torch engine's ``BucketAverager.timeline`` (launch, and the
completion of its future) or from Horovod's own timeline file (``HOROVOD_TIMELINE``, rank 0, its
``ALLREDUCE`` activities; epoch micro-seconds, put on this clock through one pair of readings). Then per
step: busy = the union of the intervals; overlapped = busy within the last backward pass (from the head's
backward to ``synchronize``); exposed = ``gradient wait``. ``profile_trace.overlap`` computes them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


class StepMarks:
    """The marks of one or more steps: ``(step, name, host seconds, CUDA event or None)`` in order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: List[Tuple[int, str, float, Optional[torch.cuda.Event]]] = []
        self.step = -1
        self.active = False

    def mark(self, name: str) -> None:
        if not self.active:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((self.step, name, time.perf_counter(), event))

    def phases(self) -> Dict[int, List[Tuple[str, float, float, Optional[float]]]]:
        """Per step: (phase, host start, host seconds, GPU seconds or None), in order; the step's last mark
        (``end``) closes it. Waits for the GPU (events) once."""
        if self.cuda:
            torch.cuda.synchronize()
        out: Dict[int, List[Tuple[str, float, float, Optional[float]]]] = {}
        for (step, name, t, ev), (step2, _, t2, ev2) in zip(self.marks, self.marks[1:]):
            if step != step2:
                continue
            gpu = ev.elapsed_time(ev2) / 1000.0 if ev is not None and ev2 is not None else None
            out.setdefault(step, []).append((name, t, t2 - t, gpu))
        return out


class StepProfiler:
    """Hooks on a trainer's parts that mark its step's phases (module docstring), and a watcher of its step
    (``step_fn.watched_by(profiler)``: ``mark``); ``run_step(step, ...)`` brackets one step. ``close()`` takes
    every hook off."""

    STEP_MARKS = {"wanted": "loader", "arrived": "to device", "sync0": "gradient wait", "sync1": "norms and decision"}

    def __init__(self, parts, device: torch.device):
        self.marks = StepMarks(device)
        self.parts = parts
        self.handles: List[Any] = []
        backbone_ids = {id(p) for p in parts.backbone_opt_params()}
        head_ids = {id(p) for p in parts.head_opt_params()}
        m = self.marks.mark

        def which(opt) -> str:
            first = next((id(p) for g in opt.param_groups for p in g["params"]), None)
            return "backbone" if first in backbone_ids else "head" if first in head_ids else ""

        def pre(opt, args, kwargs):
            name = which(opt)
            if name:
                m(f"{name} optimizer")

        def post(opt, args, kwargs):
            name = which(opt)
            if name:
                m("books" if name == "backbone" else "step end")

        def features_out(module, args, out):
            m("head forward")
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda g: m("backbone backward"))

        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self.handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post),
                         parts.backbone.register_forward_pre_hook(lambda *a: m("backbone forward")),
                         parts.backbone.register_forward_hook(features_out),
                         parts.head.register_forward_hook(lambda *a: m("head backward"))]

    def mark(self, name: str) -> None:
        """The step's own marks (step.py): each wait for a batch (``loader``, then ``to device``) and the gradient
        average (``gradient wait``, then ``norms and decision``)."""
        self.marks.mark(self.STEP_MARKS[name])

    def run_step(self, step: int, call: Callable[[], Any], profiled: bool) -> Any:
        """``call()`` (one training step), its phases marked when ``profiled``."""
        self.marks.step, self.marks.active = step, profiled
        self.marks.mark("step start")
        try:
            return call()
        finally:
            self.marks.mark("end")
            self.marks.active = False

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def step_windows(phases: Dict[int, List[Tuple[str, float, float, Optional[float]]]]) -> Dict[int, Dict[str, float]]:
    """Per step, the host times the overlap needs: its start and end, the last backward pass's start (the
    head's backward) and the gradient wait's start and end."""
    out = {}
    for step, rows in phases.items():
        start = rows[0][1]
        end = rows[-1][1] + rows[-1][2]
        bwd = [t for name, t, _, _ in rows if name == "head backward"]
        wait = [(t, t + d) for name, t, d, _ in rows if name == "gradient wait"]
        out[step] = {"start": start, "end": end, "backward": bwd[-1] if bwd else start,
                     "wait_start": wait[0][0] if wait else end, "wait_end": wait[0][1] if wait else end}
    return out
