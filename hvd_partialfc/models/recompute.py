"""Activation checkpointing for backbones, with BatchNorm running statistics updated once per step.

``torch.utils.checkpoint`` frees a segment's activations after the forward and runs the segment again
during backward. A BatchNorm in training mode updates its running mean / variance and its
``num_batches_tracked`` on every call, so the recomputation would count each batch twice (measured on
iresnet18: ``num_batches_tracked`` 2 after one step, running means moved by two momentum updates).
``run_segment`` therefore snapshots the segment's BatchNorm buffers when the recomputation starts and
puts them back when it ends. The recomputation itself runs the very same ops (a BatchNorm without
running buffers, ``track_running_stats = False``, would save fewer tensors for backward, which the
checkpoint refuses: "a different number of tensors was saved"); in training mode the backward does not
read the running buffers, so restoring them changes no gradient. On CPU the outputs, the gradients and the
buffers are bitwise those of the plain forward (tests/test_face_backbones.py, iresnet18 and
mobilefacenet); plain ``torch.utils.checkpoint`` leaves ``num_batches_tracked`` at 2 after one step.

The non-reentrant checkpoint is used (torch's recommended one): it accepts inputs without gradient (the
stem's image) and saves and restores the RNG state, so dropout inside a segment draws the same mask.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@contextmanager
def batchnorm_stats_restored(module: nn.Module) -> Iterator[None]:
    """On exit, the running statistics and counters of ``module``'s BatchNorms are those of the entry."""
    norms = [m for m in module.modules() if isinstance(m, _BATCHNORMS) and m.running_mean is not None]
    saved = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(norms, saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


def run_segment(module: nn.Module, x: torch.Tensor, enabled: bool) -> torch.Tensor:
    """``module(x)``; checkpointed when ``enabled`` and the call trains (training mode, autograd on)."""
    if not (enabled and module.training and torch.is_grad_enabled()):
        return module(x)
    return checkpoint(module, x, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), batchnorm_stats_restored(module)))


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> nn.Module:
    """Turn checkpointing on or off for a backbone that supports it (``checkpoint_activations``)."""
    if not hasattr(model, "checkpoint_activations"):
        raise ValueError(f"{type(model).__name__} does not support model.checkpoint_activations "
                         "(the iresnet*, mobilefacenet and vit_* backbones do)")
    model.checkpoint_activations = bool(enabled)
    return model
