"""The one module that touches Horovod: init, broadcast, the backbone's DistributedOptimizer, buffer
averaging, digests, error agreement, and small named collectives.

Contract:
* every function here is a collective unless its docstring says otherwise: every rank calls it, in the
  same order (Horovod matches operations by name, so names are explicit and stable);
* nothing else in the package imports horovod, so the rest can be read, tested and reused without it;
* tensors may live on CPU (Gloo/MPI) or CUDA (NCCL, with ``HOROVOD_GPU_OPERATIONS=NCCL`` at build time);
  results come back on the device they were given on.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.nn as nn

import horovod.torch as hvd

from .digest import state_digest


class RankFailure(RuntimeError):
    """Raised on *every* rank when at least one rank reported an error in an agreement point."""


@dataclass
class Comm:
    """Rank/size of this process, and the collectives the trainer needs."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    # Traffic of the tensor collectives below (not of allreduce_scalar / objects): bytes of the tensors
    # this rank hands in, and seconds spent waiting in them. Read and reset by the benchmark.
    sent_bytes: int = 0
    wait_s: float = 0.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- small named collectives --------------------------------------------------------------------
    def allreduce_scalar(self, value: float, op: str, name: str) -> float:
        """min / max / sum / average of one number over ranks (float64 on CPU: exact for ints < 2^53)."""
        ops = {"min": hvd.Min, "max": hvd.Max, "sum": hvd.Sum, "average": hvd.Average}
        t = torch.tensor([float(value)], dtype=torch.float64)  # (1,)
        return float(hvd.allreduce(t, op=ops[op], name=f"scalar.{name}")[0])

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        return hvd.allgather_object(obj, name=f"object.{name}")

    def agree(self, error: Optional[str], name: str) -> None:
        """Raise RankFailure on every rank if any rank passes an error message (None = this rank is fine).

        Errors found before training (bad shards, bad config) go through here, so a rank whose input is
        fine does not wait forever in the first training collective for a rank that already died.
        """
        errors = self.allgather_object(error, name=f"agree.{name}")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
            raise RankFailure(f"{len(failed)} of {self.size} ranks failed at '{name}':\n{lines}")

    def vote_async(self, flags: List[float], name: str) -> "Vote":
        """Start an elementwise max of a few flags over ranks; ``.result()`` waits for it (a collective).

        The trainer starts one after each step and reads it after the next one (stop on SIGTERM, the
        time-based checkpoint): the allreduce rides in the same Horovod cycle as that step's gradients, so
        the agreement costs no round trip of its own, where a synchronous scalar allreduce per step would
        wait up to one cycle (HOROVOD_CYCLE_TIME, 10 ms on CPU here). Measured at np=2 (resnet width 16,
        batch 32, 300 steps, three interleaved runs each): 413 / 330 / 347 samples/s with the vote, 392 /
        363 / 338 without it: no difference above the run-to-run noise.
        """
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64)  # (K,)
        return Vote(hvd.allreduce_async(t, op=hvd.Max, name=f"vote.{name}"))

    # --- tensor collectives for the baselines (classifier modes `global` / `replicated`) -------------
    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """Elementwise max / sum of a tensor over ranks, out of place. No autograd (callers that need a
        gradient write their own backward, see ``modes.py``)."""
        ops = {"max": hvd.Max, "sum": hvd.Sum}
        return self._timed(tensor, lambda t: hvd.allreduce(t, op=ops[op], name=f"tensor.{name}"))

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order (row counts may differ).
        No autograd; see ``allgather_with_grad`` for features."""
        return self._timed(tensor, lambda t: hvd.allgather(t, name=f"gather.{name}"))

    def allgather_with_grad(self, tensor: torch.Tensor, name: str, grad_scale: float = 1.0) -> torch.Tensor:
        """(n_r, ...) on rank r -> (sum_r n_r, ...) on every rank, with the backward a model-parallel loss needs.

        Each rank's loss uses the *whole* gathered tensor, so the gradient of the total loss with respect
        to rank r's rows is the SUM over ranks of the incoming gradients' rows of r (a reduce-scatter).
        ``hvd.allgather``'s own autograd *averages* them instead (1/N of the right value). ``grad_scale``
        multiplies the result: pass the world size when the gradient then goes through an averaging
        DistributedOptimizer (InsightFace's PartialFC AllGatherFunc does the same ``*= world_size``).
        """
        return _AllGatherSum.apply(tensor, self, name, float(grad_scale))

    def _timed(self, tensor: torch.Tensor, fn) -> torch.Tensor:
        self.sent_bytes += tensor.numel() * tensor.element_size()
        t0 = time.perf_counter()
        out = fn(tensor.detach())
        self.wait_s += time.perf_counter() - t0
        return out

    # --- the backbone -------------------------------------------------------------------------------
    def broadcast_module(self, module: nn.Module, name: str, root_rank: int = 0) -> None:
        """Overwrite ``module``'s parameters *and* buffers with root's (identical starts, DESIGN §1.6)."""
        state = {f"{name}.{k}": v for k, v in _named_state(module).items()}  # names match across ranks
        hvd.broadcast_parameters(state, root_rank=root_rank)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                              fp16_compression: bool = False,
                              backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
        """Wrap the *backbone's* optimizer: its gradients are averaged over ranks before each step.

        ``named_parameters`` are the backbone's only; the optimizer must hold nothing else (the local
        classifier has its own plain optimizer and is never communicated).
        """
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = list(module.named_parameters())
        if held != {id(p) for _, p in named}:
            raise ValueError("the backbone optimizer must hold exactly the backbone's parameters")
        compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none
        return hvd.DistributedOptimizer(optimizer, named_parameters=[("backbone." + n, p) for n, p in named],
                                        compression=compression,
                                        backward_passes_per_step=backward_passes_per_step, op=hvd.Average)

    def average_buffers(self, module: nn.Module, name: str) -> None:
        """Make BatchNorm running statistics (and other float buffers) equal on all ranks.

        Each rank's statistics come from its own classes only. For BatchNorm the pooled statistics of
        the union are used: mean = avg(mean_r), var = avg(var_r) + avg(mean_r^2) - mean^2 (the law of
        total variance with equal counts per rank, which holds since all ranks run the same steps with
        the same batch size). Integer buffers (num_batches_tracked) are equal already.
        """
        bn_means, bn_vars, bn_sq, others = [], [], [], []
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats \
                    and m.running_mean is not None:
                bn_means.append(m.running_mean)
                bn_vars.append(m.running_var)
                bn_sq.append(m.running_mean * m.running_mean)
        bn_ids = {id(t) for t in bn_means + bn_vars}
        for _, b in module.named_buffers():
            if b.is_floating_point() and id(b) not in bn_ids:
                others.append(b)
        tensors = bn_means + bn_vars + bn_sq + others
        if not tensors:
            return
        avg = hvd.grouped_allreduce(tensors, op=hvd.Average, name=f"buffers.{name}")
        k = len(bn_means)
        for i in range(k):
            mean, var, sq = avg[i], avg[k + i], avg[2 * k + i]
            bn_means[i].copy_(mean)
            bn_vars[i].copy_((var + sq - mean * mean).clamp_min(0))
        for b, a in zip(others, avg[3 * k:]):
            b.copy_(a)

    def backbone_digests(self, module: nn.Module, name: str) -> List[str]:
        """Every rank's sha256 of the backbone state (parameters and buffers), in rank order."""
        return self.allgather_object(state_digest(module), name=f"digest.{name}")

    def check_identical(self, module: nn.Module, name: str) -> List[str]:
        """Raise RankFailure on every rank unless all ranks' backbones are bitwise identical."""
        digests = self.backbone_digests(module, name)
        if len(set(digests)) != 1:
            detail = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
            raise RankFailure(f"backbones differ across ranks at '{name}' ({detail})")
        return digests

    def shutdown(self) -> None:
        hvd.shutdown()


# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms (default 1). On a CPU-only host the
# ranks' compute threads share the cores with it, and a 1 ms cycle costs them: the demo model at np=2 on
# 2 cores trains at 645 samples/s with 1 ms and 917 with 10 ms (docs/benchmarks.md has the same finding
# for the classifier benchmark). GPU hosts keep Horovod's default (latency matters there, cores do not).
CPU_CYCLE_TIME_MS = "10"


def init() -> Comm:
    """Start Horovod (once per process). Works under horovodrun/mpirun, and alone (size 1).

    Without CUDA, and unless the user set it, HOROVOD_CYCLE_TIME becomes ``CPU_CYCLE_TIME_MS``.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("HOROVOD_CYCLE_TIME", CPU_CYCLE_TIME_MS)
    hvd.init()
    return Comm(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size())


def step_synchronized(optimizer: torch.optim.Optimizer, step_fn=None) -> None:
    """Step an optimizer whose gradients were already synchronized (Horovod's skip_synchronize)."""
    with optimizer.skip_synchronize():
        (step_fn or optimizer.step)()


class Vote:
    """An allreduce in flight (``Comm.vote_async``)."""

    def __init__(self, handle):
        self.handle = handle

    def result(self) -> List[float]:
        return [float(v) for v in hvd.synchronize(self.handle)]


def _named_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Parameters and buffers by name (Horovod broadcasts them in place)."""
    out = dict(module.named_parameters())
    out.update({k: v for k, v in module.named_buffers()})
    return out


def gradient_bytes(params: Iterable[torch.nn.Parameter], fp16_compression: bool = False) -> int:
    """Bytes of one allreduce of these parameters' gradients as sent (compression halves fp32). Not a collective."""
    total = 0
    for p in params:
        itemsize = 2 if (fp16_compression and p.dtype == torch.float32) else p.element_size()
        total += p.numel() * itemsize
    return total


class _AllGatherSum(torch.autograd.Function):
    """Forward: allgather along dim 0. Backward: sum over ranks of the gradient, this rank's rows, x scale."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: "Comm", name: str, grad_scale: float) -> torch.Tensor:
        n = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        counts = comm._timed(n, lambda t: hvd.allgather(t, name=f"gather.{name}.rows"))  # (N,) rows per rank
        ctx.comm, ctx.name, ctx.grad_scale = comm, name, grad_scale
        ctx.counts = [int(c) for c in counts]
        return comm._timed(tensor, lambda t: hvd.allgather(t.contiguous(), name=f"gather.{name}"))  # (M, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, counts = ctx.comm, ctx.counts
        grad = grad.contiguous()                                                  # (M, ...)
        # Allreduce the whole (M, ...) gradient and keep this rank's rows. Not hvd.reducescatter: with
        # Horovod 0.28 + Gloo, once a reducescatter has run, every later collective of the process is
        # ~10-60x slower on this machine (the benchmark's `global` step at 10k classes, D=128: 860 ms
        # with it, 219 ms without; an allgather of 128 KB: 68 ms after one, 1-2 ms otherwise).
        total = comm._timed(grad, lambda g: hvd.allreduce(g, op=hvd.Sum, name=f"gather.{ctx.name}.grad"))
        start = sum(counts[:comm.rank])
        mine = total[start:start + counts[comm.rank]]                              # (n_r, ...)
        if ctx.grad_scale != 1.0:
            mine = mine * ctx.grad_scale
        return mine, None, None, None
