"""One optimizer step, the same for every mode and engine (``Step``), and the learning-rate schedule.

Per step, on every rank:
  1. draw ``backward_passes_per_step`` batches of *this rank's* classes from its dedicated loader;
  2. backbone(x) -> features -> the mode's head (a local classifier as wide as the slice) -> margin loss;
  3. backward: gradients for the backbone and for the local classifier;
  4. the engine's averaging optimizer averages the backbone gradients across ranks; they are clipped /
     checked after that average, so every rank takes the same decision without another collective;
  5. the classifier's optimizer (plain torch) steps with the local gradient only;
  6. the learning rate of both follows one schedule (warmup, then cosine / poly), one step per step.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import torch

from ..data.loader import prepare_batch
from .progress import RunLength
from .speed import autocast_for
from ..classifier.rowsparse import grad_values
from .skips import account


def read_norms(norm: torch.Tensor, cls_norm: Optional[torch.Tensor]) -> Tuple[float, float]:
    """(backbone norm, classifier norm or nan) as Python floats, read from the device together: one host
    synchronisation instead of two. The values are the float32 norms' own (``float(norm)``'s)."""
    if cls_norm is None:
        return float(norm), math.nan
    both = torch.stack([norm, cls_norm.to(norm.device)]).tolist()
    return both[0], both[1]


class StepFigures(Mapping):
    """A step's figures by name; those given as device tensors are read on first access only: a read is a
    host synchronisation, and the loop reads ``loss`` at its log lines (``train.log_every``), not every step.
    ``settle``: called before the first such read (``train.skip_decision=device``: the books brought up to date)."""

    def __init__(self, on_device: Dict[str, torch.Tensor], settle: Optional[Callable[[], None]] = None,
                 **values: float):
        self._on_device, self._values, self._settle = dict(on_device), dict(values), settle

    def __getitem__(self, key: str) -> float:
        if key in self._on_device:
            if self._settle is not None:
                self._settle()
            self._values[key] = float(self._on_device.pop(key))
        return self._values[key]

    def __iter__(self):
        return iter(list(self._values) + list(self._on_device))

    def __len__(self) -> int:
        return len(self._values) + len(self._on_device)


def lr_factor(step: float, total: float, warmup: int, schedule: str, min_ratio: float, power: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based; a schedule position, fractional after a
    resume at another world size: progress.py) of ``total``: linear warmup, then decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        decay = 0.5 * (1 + math.cos(math.pi * progress))
    elif schedule == "poly":
        decay = (1 - progress) ** power
    else:
        decay = 1.0
    return min_ratio + (1 - min_ratio) * decay


def imported_factor(index: float, warmup: float, total: float, power: float) -> float:
    """Multiplier of the peak lr at scheduler step ``index`` of an imported run's own schedule
    (progress.ImportedSchedule): arcface_torch's poly with linear warm-up, ``index / warmup`` up to and at
    ``warmup``, then ``(1 - (index - warmup) / (total - warmup)) ** power``, 0 from ``total`` on (today's
    arcface_torch holds it there; the older one's square rose again, which no run reaches: the budget ends
    at ``total``)."""
    if warmup > 0 and index <= warmup:
        return index / warmup
    return (1 - min(1.0, (index - warmup) / max(1, total - warmup))) ** power


class Step:
    """The step of ``parts`` (parts.py) on batches of a shard set of ``kind``, for a run of ``length``
    (progress.RunLength; an int: that many steps at one world size).

    Watchers see the step from inside (``watchers``, or for a while ``watched_by``): each may have any of
    ``begin(step)``, ``mark(name)`` (``wanted`` / ``arrived`` around each wait for a batch, ``sync0`` / ``sync1``
    around the gradient average), ``batch(item)`` (every batch drawn) and ``end(step, figures)``. The straggler
    watch measures the rank's own time with them, the sample watch notes bad samples, the benchmark and the
    step profile time the phases.
    """

    def __init__(self, cfg, comm, parts, device: torch.device, kind: str, length: Union[int, RunLength],
                 watchers: Sequence = ()):
        self.cfg, self.comm, self.parts, self.device, self.kind = cfg, comm, parts, device, kind
        self.length = RunLength.fixed(length) if isinstance(length, int) else length
        self.total_steps = self.length.total_steps
        self.watchers = list(watchers)
        self.channels_last = parts.fast.channels_last and kind in ("images", "encoded")   # auto: resolved (speed.py)

    @contextmanager
    def watched_by(self, *watchers) -> Iterator[None]:
        """``watchers`` see every step inside the ``with`` block (then they are taken off)."""
        self.watchers += watchers
        try:
            yield
        finally:
            for w in watchers:
                self.watchers.remove(w)

    def _tell(self, hook: str, *args) -> None:
        for w in self.watchers:
            fn = getattr(w, hook, None)
            if fn is not None:
                fn(*args)

    def set_lr(self, step: int) -> float:
        o, imported = self.cfg.optim, self.length.schedule
        # by the samples consumed (progress.py): at the run's first world size exactly (step, total_steps)
        if imported is None:
            f = lr_factor(self.length.position(step), self.length.schedule_total, o.warmup_steps, o.schedule,
                          o.min_lr_ratio, o.poly_power)
        else:   # an imported run's own schedule; the import checked that the config's keys say the same
            f = imported_factor(imported.index(self.length.samples_at(step)), imported.warmup, imported.total,
                                imported.power)
        for opt, peak in ((self.parts.backbone_opt, o.backbone_lr), (self.parts.head_opt, o.classifier_lr)):
            for g in opt.param_groups:
                # lr_from: the classifier's group names its peak lr (it sits in backbone_opt when averaged)
                g["lr"] = (getattr(o, g["lr_from"]) if "lr_from" in g else peak) * f
        return f

    def _autocast(self):
        return autocast_for(self.cfg.train.precision, self.device)

    def __call__(self, step: int, batches: Iterator) -> Dict[str, float]:
        """One optimizer step over ``backward_passes_per_step`` local batches; returns its figures."""
        self._tell("begin", step)
        figures = self._run(step, batches)
        self._tell("end", step, figures)
        return figures

    def _next(self, batches: Iterator):
        self._tell("mark", "wanted")
        item = next(batches)
        self._tell("mark", "arrived")
        self._tell("batch", item)
        return item

    def _run(self, step: int, batches: Iterator) -> Dict[str, float]:
        parts, k = self.parts, self.cfg.optim.backward_passes_per_step
        summed = self.cfg.optim.accumulate == "sum"
        backbone, head, loss_scale = parts.backbone, parts.head, parts.loss_scale
        skips = parts.device_skips                 # train.skip_decision=device (skips.py), else None
        scale = skips.loss_scale_now() if skips else loss_scale.scale
        lr_f = self.set_lr(step)
        backbone.train(), head.train()
        parts.backbone_opt.zero_grad()  # Horovod: set_to_none is torch 2 default
        parts.head_opt.zero_grad(set_to_none=True)
        head.before_step(step)        # the head's periodic work (cross-shard negatives), a collective
        t0, data_time, loss_sum = time.perf_counter(), 0.0, None
        for _ in range(k):
            td = time.perf_counter()
            x, y = prepare_batch(*self._next(batches), self.device, self.kind)     # x: (B, ...), y: (B,) local
            data_time += time.perf_counter() - td
            if self.channels_last:                                                  # (B, C, H, W), NHWC in memory
                x = x.contiguous(memory_format=torch.channels_last)
            with self._autocast():
                features = backbone(x)                                              # (B, D)
            batch_loss = head(features.float(), y)                                  # the mode's loss
            loss = batch_loss / k                                   # its share of the step's mean (logged)
            # optim.accumulate: the mean's gradient, or the sum's (arcface_torch's gradient_acc)
            ((batch_loss if summed else loss) * scale).backward()
            # summed on the device in float64, as Python's float sum of .item()s did: read at log time
            loss_sum = loss.detach().double() if loss_sum is None else loss_sum + loss.detach().double()
        self._tell("mark", "sync0")
        parts.backbone_opt.synchronize()          # averaged grads are now the mean over ranks
        self._tell("mark", "sync1")
        # Averaged: the backbone's (and the classifier's when the mode averages it with the same optimizer):
        # identical on all ranks, so the finite check and the clipping decide the same everywhere.
        averaged = [p for p in parts.backbone_opt_params() if p.grad is not None]
        local = [p for p in parts.head_opt_params() if p.grad is not None]
        if loss_scale.enabled:   # one kernel launch for all of them (iresnet50: 237 tensors); div_'s numbers
            torch._foreach_div_([p.grad for p in averaged], scale)
        if loss_scale.enabled or parts.head_grad_scale != 1.0:
            for p in local:
                p.grad.mul_(parts.head_grad_scale / scale)
        norm_t = torch.nn.utils.get_total_norm([p.grad for p in averaged])  # identical on all ranks
        cls_t = torch.nn.utils.get_total_norm([grad_values(p.grad) for p in local]) if local else None
        if skips:   # no host read: decided in the fused kernels, the books kept one step late (skips.py)
            norm_t = skips.finish(step, averaged, local, norm_t, cls_t, loss_sum)
            return StepFigures({"loss": loss_sum, "grad_norm": norm_t}, skips.settle, lr_factor=lr_f,
                               data_time=data_time, step_time=time.perf_counter() - t0)
        grad_norm, cls_norm = read_norms(norm_t, cls_t)   # the step's one host synchronisation
        if math.isfinite(grad_norm):
            if self.cfg.optim.clip_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(averaged, self.cfg.optim.clip_grad_norm, norm_t)
            self.comm.step_synchronized(parts.backbone_opt)
        if account(self.cfg, self.comm, parts, step, grad_norm, cls_norm, bool(local), loss_sum):
            parts.head_opt.step()    # the counters, the loss scale and the stops: skips.account
        return StepFigures({"loss": loss_sum}, grad_norm=grad_norm, lr_factor=lr_f, data_time=data_time,
                           step_time=time.perf_counter() - t0)
