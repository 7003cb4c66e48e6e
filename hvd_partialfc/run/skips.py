"""A step's decision on non-finite gradients, and its bookkeeping, on the host or on the device.

The decision: the averaged backbone gradient's norm is identical on every rank, so every rank skips (or
steps) together, and the fp16 loss scale follows it; the classifier's own norm decides its step alone (its
gradient is local). ``account`` keeps the books of one decision (the counters, the loss scale, the errors
that stop a run) from the two norms as host numbers; the step (step.py) calls it after reading them, the
one host synchronisation of a ``local`` step (``train.skip_decision=host``, the default).

``train.skip_decision=device`` (``DeviceSkips``) takes that read out of the step. The skip itself happens
inside torch's fused optimizer kernels (their ``found_inf``, as ``torch.amp.GradScaler`` uses it), the fp16
loss scale lives on the device, and the books are kept one step late: the two norms go to pinned host memory
by a non-blocking copy, and the next step (or a read of the step's figures at a log line, or a checkpoint's
state) waits for that copy alone, not for the queue of work behind it. So the host keeps the GPU's queue
full across steps. Its costs, said in docs/gpu.md: a stop on a non-finite gradient (``train.on_nonfinite:
stop``) or on too many skips is raised one step later, naming the step it is about (the skipped step itself
changed nothing on the device); under Horovod, ``synchronize()`` still waits on the host (torch engine: no).
Same numbers as the host decision with the same fused kernels (tests/test_fast_paths.py, bitwise on CPU).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Optional, Tuple

import torch

from ..engine.base import mark_agreed


class NonFiniteError(RuntimeError):
    pass


class SkippedStepsError(NonFiniteError):
    """Too many steps in a row skipped (``train.max_consecutive_skips``): the run is no longer training."""


def account(cfg, comm, parts, step: int, grad_norm: float, cls_norm: float, has_local: bool, loss_sum) -> bool:
    """The books of step ``step``'s decision from its norms (host floats; ``cls_norm`` nan without a local
    classifier): the loss scale, the skip counters, and the errors that stop the run. Returns whether the
    classifier's local optimizer steps (its norm is finite and the backbone's step was taken)."""
    counters, loss_scale = parts.counters, parts.loss_scale
    finite = math.isfinite(grad_norm)
    loss_scale.update(finite)
    if finite:
        counters.consecutive_skips = 0
        if not has_local:
            return False
        if math.isfinite(cls_norm):  # local decision: the classifier is local
            counters.classifier_consecutive_skips = 0
            return True
        counters.classifier_skipped_steps += 1
        counters.classifier_consecutive_skips += 1
        check_skips(cfg, comm, parts, counters.classifier_consecutive_skips, step, "this rank's classifier gradient",
                    every_rank=False)
        return False
    if loss_scale.enabled or cfg.train.on_nonfinite == "skip":
        counters.skipped_steps += 1      # every rank skips: the averaged norm is the same everywhere
        counters.consecutive_skips += 1
        check_skips(cfg, comm, parts, counters.consecutive_skips, step, "the averaged gradient")
        return False
    raise mark_agreed(NonFiniteError(   # the averaged norm: every rank decides alike
        f"rank {comm.rank}: non-finite backbone gradient at step {step} (local loss {float(loss_sum)}); "
        "set train.on_nonfinite=skip to skip such steps"))


def check_skips(cfg, comm, parts, consecutive: int, step: int, what: str, every_rank: bool = True) -> None:
    """SkippedStepsError after ``train.max_consecutive_skips`` skips in a row; ``every_rank``: the skips
    were every rank's (the averaged gradient), so is the error (engine/base.py, mark_agreed)."""
    limit = cfg.train.max_consecutive_skips
    if limit and consecutive >= limit:
        ls = parts.loss_scale
        scale = f"; fp16 loss scale now {ls.scale:g}" if ls.enabled else ""
        err = SkippedStepsError(
            f"rank {comm.rank}: {consecutive} steps in a row skipped up to step {step}: {what} is not "
            f"finite{scale}. The run is not training; stopping (train.max_consecutive_skips="
            f"{limit}). Lower the learning rate, check the data, or resume from an earlier checkpoint")
        raise mark_agreed(err) if every_rank else err


class DeviceSkips:
    """``train.skip_decision=device`` for ``parts`` (see the module's docstring). Built with the parts
    (parts.py); the step calls ``loss_scale_now`` and ``finish``; ``settle`` brings the books up to date."""

    def __init__(self, cfg, comm, parts, device: torch.device):
        self.cfg, self.comm, self.parts, self.device = cfg, comm, parts, device
        self.pending: Deque[Tuple[int, torch.Tensor, Optional[torch.cuda.Event], torch.Tensor, bool]] = deque()
        self.scale_t: Optional[torch.Tensor] = None     # the fp16 loss scale and its good steps (0-d), on the device
        self.good_t: Optional[torch.Tensor] = None
        self.primed = False

    def loss_scale_now(self):
        """The loss scale this step multiplies by: a 0-d device tensor under fp16 (first taken from the books,
        which a resume restored), else the books' 1.0."""
        ls = self.parts.loss_scale
        if not ls.enabled:
            return ls.scale
        if self.scale_t is None:
            self.scale_t = torch.tensor(ls.scale, dtype=torch.float32, device=self.device)
            self.good_t = torch.tensor(ls.good_steps, dtype=torch.int64, device=self.device)
        return self.scale_t

    def _prime(self) -> None:
        """SGD's momentum buffers as zeros where none exists yet: torch's fused SGD makes them *empty* at its
        first step and, when that step is skipped (``found_inf``), later steps would read them. A zero buffer's
        first update is the gradient itself, bitwise what the first step writes."""
        for opt in (self.parts.backbone_opt, self.parts.head_opt):
            for g in opt.param_groups:
                if g.get("momentum", 0):
                    for p in g["params"]:
                        if "momentum_buffer" not in opt.state[p]:
                            opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        self.primed = True

    def finish(self, step: int, averaged, local, norm_t: torch.Tensor, cls_t: Optional[torch.Tensor], loss_sum):
        """After the norms: clip, both optimizers step unless their norm is not finite (decided in the fused
        kernels), the loss scale updated on the device, the norms sent to the host; the books of the previous
        step kept. Returns the backbone norm (a device tensor: the figures read it at log lines)."""
        parts, o = self.parts, self.cfg.optim
        if not self.primed:
            self._prime()
        bad = (~torch.isfinite(norm_t)).reshape(1).float()                        # (1,) found_inf of the backbone
        if o.clip_grad_norm > 0:   # a non-finite norm makes the gradients nan, which the skipped step never reads
            torch.nn.utils.clip_grads_with_norm_(averaged, o.clip_grad_norm, norm_t)
        parts.backbone_opt.found_inf = bad
        self.comm.step_synchronized(parts.backbone_opt)
        if local:   # the classifier steps when both norms are finite (host: it is not stepped after a skip)
            parts.head_opt.found_inf = torch.maximum(bad, (~torch.isfinite(cls_t)).reshape(1).float().to(bad.device))
            parts.head_opt.step()
        if self.scale_t is not None:
            self._update_scale(bad)
        cls = cls_t.to(norm_t.device).float() if cls_t is not None else torch.full_like(norm_t, math.nan, dtype=torch.float32)
        norms = torch.stack([norm_t.float(), cls])                                 # (2,)
        host = torch.empty(2, dtype=torch.float32, pin_memory=norms.is_cuda)
        host.copy_(norms, non_blocking=True)
        event = None
        if norms.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.settle()               # the previous step's books: its copy finished while this step was queued
        self.pending.append((step, host, event, loss_sum, bool(local)))
        return norm_t

    def _update_scale(self, bad: torch.Tensor) -> None:
        """``LossScale.update`` on the device: x2 after ``loss_scale_growth`` finite steps in a row, /2 (at least
        1) after a non-finite one."""
        ls, finite = self.parts.loss_scale, (bad == 0).reshape(())
        self.good_t = torch.where(finite, self.good_t + 1, torch.zeros_like(self.good_t))
        grow = finite & (self.good_t % ls.growth_interval == 0)
        self.scale_t = torch.where(grow, self.scale_t * 2.0,
                                   torch.where(finite, self.scale_t, (self.scale_t / 2.0).clamp_min(1.0)))

    def settle(self) -> None:
        """Keep the books of the steps whose norms were sent, in order: waits for those copies only. Raises
        what the host decision would have raised at that step."""
        while self.pending:
            step, host, event, loss_sum, has_local = self.pending.popleft()
            if event is not None:
                event.synchronize()
            grad_norm, cls_norm = (float(v) for v in host.numpy())   # host memory: no device read
            account(self.cfg, self.comm, self.parts, step, grad_norm, cls_norm, has_local, loss_sum)
