"""Synchronised BatchNorm (``model.sync_batchnorm``): training-mode statistics over the *global* batch.

A rank's batch holds only its own classes (its slice), and at a fixed global batch it shrinks as N grows:
the scale study's per-rank batch is 16 at N = 64 and 4 at N = 256. Plain BatchNorm normalises each rank's
batch by its own mean and variance, so N changes what the backbone computes even in exact ``global`` mode
(docs/evidence/accuracy.md, "At 64-256 ranks": exact softmax's held-out TAR@1e-3 fell from 0.912 at N = 8
to 0.889 at N = 64 with nothing else depending on N). With this option every rank normalises by the
statistics of the union of all ranks' batches, as one process on the global batch would.

How: per layer and step, each rank allreduces (sum, sum of squares, count) of its batch per channel
(``comm.allreduce_tensor``) and normalises by the global mean and variance. The backward is written out
(``_SyncBatchNormFn``): the gradient through the statistics needs the global sums of the incoming gradient
g = dL/dx_hat and of g * x_hat, one more allreduce of 2 C floats, and then
dx = invstd * (g - (sum g + x_hat * sum g x_hat) / n), the gradient of the *total* loss (all ranks'), so
after the DistributedOptimizer's average every backbone gradient is that of the global batch's mean loss
(tested against one process on the concatenated batch, tests/test_syncbn.py). Written out rather than left
to autograd over the forward's ~15 small operations, which at small per-rank batches cost more than the
layer's arithmetic (figures in ``_SyncBatchNormFn``'s docstring). Running statistics are updated
from the global ones, so they are identical on every rank. Cost: two allreduces of 2 C (+ 1) floats per
layer, whatever N (an all-gather would receive N times that): for iresnet50's 79 layers 38,223 floats each,
0.6 MB sent plus received per step, 0.18% of its gradient's (Horovod fuses them, but they are 2 x 79 small
collectives in the step's critical path). Evaluation (``eval()``) is plain BatchNorm with the running
statistics: no collective.
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
        return _SyncBatchNormFn.apply(x, self.weight, self.bias, self)

    def update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        """Running statistics from the global batch's ``mean`` and biased ``var`` over ``n`` values."""
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.mul_(1 - m).add_(mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var * (n / (n - 1).clamp_min(1)), alpha=m)


class _SyncBatchNormFn(torch.autograd.Function):
    """Training-mode sync BatchNorm of one layer: forward over the global statistics, backward written out.

    Both directions compute in float32 (an fp16 input is cast, the output cast back) and use PyTorch's
    fused eval-mode kernels for the elementwise work (``F.batch_norm`` with the global mean and variance
    as its running statistics; its backward gives dL/dx_hat * invstd and the local sums of dy and
    dy * x_hat in one pass), so a layer adds a handful of per-channel operations to plain BatchNorm.
    Measured on the demo backbone (19 layers, one thread, the scale study's per-rank batch of 4, forward +
    backward, one virtual rank, best of 5 x 20 with another process on the second core): 15.0 ms with
    plain BatchNorm, 32.2 ms with autograd over the forward's operations (the implementation before this
    one), 25.0 ms with this Function; at batch 16: 34.9, 62.7 and 48.4 ms.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, bias, layer: SyncBatchNorm) -> torch.Tensor:
        dims = [0] + list(range(2, x.dim()))
        c = x.shape[1]
        xf = x.float()
        count = torch.full((1,), x.numel() / c, dtype=torch.float32, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])                     # (2C + 1,)
        total = layer.comm.allreduce_tensor(stats, "sum", f"syncbn.{layer.layer}")         # over ranks
        n = total[2 * c]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0)                              # biased
        layer.update_running_stats(mean, var, n)
        y = F.batch_norm(xf, mean, var, weight, bias, False, 0.0, layer.eps)
        ctx.save_for_backward(xf, mean, var, weight, n)
        ctx.comm, ctx.name, ctx.eps = layer.comm, f"syncbn.{layer.layer}.grad", layer.eps
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        xf, mean, var, weight, n = ctx.saved_tensors
        c = xf.shape[1]
        shape = [1, c] + [1] * (xf.dim() - 2)
        # eval-mode backward: gx = g * invstd with g = dL/dx_hat = dy * weight, and the local sums
        # sum(dy * x_hat), sum(dy) (the parameters' gradients)
        gx, dweight, dbias = torch.ops.aten.native_batch_norm_backward(
            dy.float().contiguous(), xf, weight, mean, var, None, None, False, ctx.eps, [True, True, True])
        w = weight if weight is not None else torch.ones_like(mean)
        # The statistics are every rank's: their gradient needs the global sums of g and g * x_hat.
        sums = ctx.comm.allreduce_tensor(torch.cat([dbias * w, dweight * w]), "sum", ctx.name)   # (2C,)
        invstd = torch.rsqrt(var + ctx.eps)
        # dx = invstd * (g - (sum g + x_hat * sum g x_hat) / n), x_hat = (x - mean) * invstd:
        # = gx - (x * a + b) with per-channel a = invstd^2 * sum(g x_hat) / n, b = invstd * sum(g) / n - mean * a
        a = invstd * invstd * sums[c:] / n
        b = invstd * sums[:c] / n - mean * a
        dx = gx - torch.addcmul(b.view(shape), xf, a.view(shape))
        needs = ctx.needs_input_grad
        return (dx.to(dy.dtype), dweight if weight is not None and needs[1] else None,
                dbias if weight is not None and needs[2] else None, None)


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
