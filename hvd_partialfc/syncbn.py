"""Synchronised BatchNorm (``model.sync_batchnorm``): training-mode statistics over the *global* batch.

A rank's batch holds only its own classes (its slice), and at a fixed global batch it shrinks as N grows:
the scale study's per-rank batch is 16 at N = 64 and 4 at N = 256. Plain BatchNorm normalises each rank's
batch by its own mean and variance, so N changes what the backbone computes even in exact ``global`` mode
(docs/accuracy.md, "At 64-256 ranks": exact softmax's held-out TAR@1e-3 fell from 0.912 at N = 8 to 0.889 at
N = 64 with nothing else depending on N). With this option every rank normalises by the statistics of the
union of all ranks' batches, as one process on the global batch would.

How: per layer and step, each rank allreduces (sum, sum of squares, count) of its batch per channel through
``comm.allreduce_with_grad``, whose backward allreduces the gradient too. The statistics are therefore
differentiable across ranks, and after the DistributedOptimizer's average every backbone gradient is that
of the global batch's mean loss (tested against one process on the concatenated batch, tests/test_syncbn.py).
Running statistics are updated from the global ones, so they are identical on every rank. Cost: two
allreduces of 2 C + 1 floats per layer, whatever N (an all-gather would receive N times that): for
iresnet50's 79 layers 38,223 floats each, 0.6 MB sent plus received per step, 0.18% of its gradient's
(Horovod fuses them, but they are 2 x 79 small collectives in the step's critical path). Evaluation
(``eval()``) is plain BatchNorm with the running statistics: no collective.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm1d/2d/3d whose training statistics are those of all ranks' batches together. Same parameters
    and buffers (names, shapes) as the layer it replaces, so checkpoints and exports are unchanged."""

    def __init__(self, num_features: int, eps: float, momentum: float, affine: bool, comm, name: str):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.comm, self.layer = comm, name

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        xf = x.float()
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])                     # (2C + 1,)
        total = self.comm.allreduce_with_grad(stats, f"syncbn.{self.layer}")              # over ranks
        c = x.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)                              # biased
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1).clamp_min(1)), alpha=m)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def convert_sync_batchnorm(module: nn.Module, comm) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` (in place, keeping its parameters and buffers) by a
    ``SyncBatchNorm`` over ``comm``; returns ``module``. Layers are named by their path (the collective's
    name, the same on every rank)."""
    for path, child in list(module.named_modules()):
        for name, bn in list(child.named_children()):
            if isinstance(bn, nn.modules.batchnorm._BatchNorm) and not isinstance(bn, SyncBatchNorm):
                if not bn.track_running_stats:
                    raise ValueError(f"{path}.{name}: sync BatchNorm needs track_running_stats")
                sync = SyncBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, comm,
                                     f"{path}.{name}" if path else name)
                sync.load_state_dict(bn.state_dict())
                sync.train(bn.training)
                setattr(child, name, sync.to(bn.running_mean.device))
    return module
