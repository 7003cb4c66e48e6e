"""The ``Comm`` interface of the engines: a few primitives, and the collectives built from them, once.

Three implementations provide the primitives: ``horovod.Comm`` (one process per rank), ``sim.SimComm``
(N virtual ranks in one process, the simulator) and ``local.LocalComm`` (one rank, no communication). A
second real engine implements the same primitives. What is built on them lives here, so all compute the
same thing: error agreement (`agree`, `failures`), backbone digests and their check, BatchNorm buffer
averaging (the pooled statistics), and the all-gather whose backward sums over ranks.

Primitives a subclass provides (each a collective: every rank calls it, in the same order, same name):
``allreduce_scalar``, ``allgather_object``, ``allreduce_tensor``, ``allgather_tensor``, ``grouped_average``
(elementwise mean of a list of tensors), ``vote_async``, ``broadcast_module``, ``distributed_optimizer``,
``shutdown``; ``step_synchronized`` steps what ``distributed_optimizer`` returned. ``wait_s`` counts the
seconds a rank waited in tensor collectives and in the averaging optimizer's ``synchronize``, under every
engine (a straggler is told by its own time, without them: run/watch/stragglers.py). Not a collective to
import; imports no Horovod.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..digest import state_digest


# train.collective_timeout's default, seconds: longer than rank 0's slowest work alone while the others wait in a
# collective. An IJB-C-sized set (469,375 images) at the 120-180 images/s measured on a 2-core machine
# (docs/evaluation.md) is 43-65 minutes, 87-130 with the flip; a lost peer is found by the heartbeat in
# seconds, so this only bounds a rank that is alive but never arrives (a bug)
DEFAULT_COLLECTIVE_TIMEOUT_S = 3 * 3600.0


class RankFailure(RuntimeError):
    """Raised on *every* rank when at least one rank reported an error in an agreement point.

    ``point`` names the agreement point and ``failures`` holds (rank, error text) of each failed rank, so
    the CLI can print an agreed error once (rank 0) and in one line when every rank failed alike.
    ``before_training``: raised by start-up's checks of the user's input (run/startup.py), an exit 2."""

    def __init__(self, message: str, point: str = "", failures: Sequence[Tuple[int, str]] = ()):
        super().__init__(message)
        self.point, self.failures = point, list(failures)
        self.before_training = False


def mark_agreed(err: BaseException) -> BaseException:
    """``err``, marked as raised by every rank at the same point (an agreement, or a decision every rank takes
    alike from identical values: the averaged gradient's norm, an agreed count): ``agreed`` then holds. The
    heartbeat says goodbye only for such errors (cli.py): after an error of one rank alone its neighbour
    must not stop watching it."""
    err.agreed_by_every_rank = True
    return err


def agreed(err: BaseException) -> bool:
    """``err`` is every rank's: ``mark_agreed``, or a RankFailure (raised on every rank by construction: an
    agreement point, the identity check of the backbones, the check of collective names)."""
    return bool(getattr(err, "agreed_by_every_rank", False)) or isinstance(err, RankFailure)


def backbone_params(optimizer: torch.optim.Optimizer, module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """``module``'s named parameters, checking that ``optimizer`` holds exactly those (not a collective).

    The averaging optimizer must hold the backbone's parameters and nothing else: the local classifier has
    its own plain optimizer and is never communicated.
    """
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = list(module.named_parameters())
    if held != {id(p) for _, p in named}:
        raise ValueError("the backbone optimizer must hold exactly the backbone's parameters")
    return named


@dataclass
class CommBase:
    """Rank/size of this rank, and the collectives built from the primitives."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    # Traffic of the tensor collectives (not of allreduce_scalar / objects): bytes of the tensors this rank
    # hands in, and seconds spent waiting in them. Read and reset by the benchmark.
    sent_bytes: int = 0
    wait_s: float = 0.0
    # Set by the straggler watch on the CPU (cpu_clock.read: the calling thread's CPU and run-queue seconds): that
    # clock's seconds inside the waits counted in wait_s, summed in wait_used. Horovod's wait spins (sched_yield
    # until the handle is done), so a rank that waits for the others spends CPU time and run-queue delay there.
    wait_clock: Optional[Callable[[], Tuple[float, float]]] = None
    wait_used: Tuple[float, float] = (0.0, 0.0)
    # Each rank is a process of its own, whose step times say how fast it is (run/watch/stragglers.py); not the
    # simulator's virtual ranks, which take turns in one process.
    times_ranks = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def regroup_refusal(self) -> Optional[str]:
        """Why this job cannot go on without one of its nodes (an evicted straggler, run/watch/stragglers.py); None
        when it can. Not a collective."""
        return "only elastic torchrun (--nnodes MIN:MAX, --max-restarts > 0) can go on without a node"

    # --- going on in this process after a peer is lost (cli_train.py; docs/reliability.md, "Going on in the same processes")
    def reformable(self) -> bool:
        """Whether the survivors of a lost peer can re-form the group in their own processes (an elastic
        launcher that re-forms it: Horovod's elastic mode). Not a collective."""
        return False

    def abort(self) -> None:
        """Leave the group now, from any thread: a collective this rank waits in raises (the heartbeat calls it
        when a peer is lost, engines that can re-form only). Not a collective."""

    def broken(self, error: BaseException) -> bool:
        """Whether ``error`` (or what caused it) is the group failing under this rank (a peer lost inside a
        collective), not an error of the run's own. Not a collective."""
        return False

    def hosts_changed(self) -> bool:
        """Whether the launcher said, since the last call, that hosts were added to the job or removed from it
        (horovodrun's elastic driver tells rank 0's process only; the loop's vote tells every rank). Not a
        collective."""
        return False

    def reform(self, failed: bool = True) -> Optional["CommBase"]:
        """The group re-formed by the survivors (new ranks and size, this process kept); None when this
        process is no longer part of the job. ``failed``: the group failed under the ranks (a peer lost), else
        every rank left it together (the launcher changed the hosts). A collective of the survivors."""
        raise NotImplementedError(type(self).__name__ + " cannot re-form its group in this process")

    def stop_agent(self) -> None:
        """This node leaves the job: its launcher's agent is told to stop without restarting it (the engines
        that can, ``regroup_refusal`` None). Not a collective."""

    def hosts_rendezvous(self) -> bool:
        """Whether this rank's node serves the launcher's rendezvous, which the job cannot lose (an evicted
        straggler's node never is: run/watch/stragglers.py). Not a collective."""
        return False

    def _timed(self, tensor: torch.Tensor, fn) -> torch.Tensor:
        """``fn(tensor)`` (a tensor collective), counted in ``sent_bytes`` and ``wait_s``."""
        self.sent_bytes += tensor.numel() * tensor.element_size()
        with self.waiting():
            return fn(tensor.detach())

    @contextmanager
    def waiting(self):
        """A wait for the other ranks (a tensor collective, the averaging optimizer's ``synchronize``): its seconds
        in ``wait_s``, and with a ``wait_clock`` that clock's in ``wait_used``."""
        t0, c0 = time.perf_counter(), self.wait_clock() if self.wait_clock else None
        yield
        self.wait_s += time.perf_counter() - t0
        if c0 is not None:
            c1 = self.wait_clock()
            self.wait_used = (self.wait_used[0] + c1[0] - c0[0], self.wait_used[1] + c1[1] - c0[1])

    def agree(self, error: Optional[str], name: str) -> None:
        """Raise RankFailure on every rank if any rank passes an error message (None = this rank is fine).

        Errors found before training (bad shards, bad config) go through here, so a rank whose input is
        fine does not wait forever in the first training collective for a rank that already died.
        """
        failed = self.failures(error, name)
        if failed:
            lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
            raise RankFailure(f"{len(failed)} of {self.size} ranks failed at '{name}':\n{lines}", name, failed)

    def failures(self, error: Optional[str], name: str) -> List[Tuple[int, str]]:
        """Every rank's error of an agreement point, as ``(rank, message)`` (empty: all fine), the same list
        on every rank; the collective `agree` raises on. For an error the run survives (an evaluation that
        failed on rank 0, `verification.evaluator`), where every rank must take the same turn."""
        errors = self.allgather_object(error, name=f"agree.{name}")
        return [(r, e) for r, e in enumerate(errors) if e is not None]

    def allgather_with_grad(self, tensor: torch.Tensor, name: str, grad_scale: float = 1.0) -> torch.Tensor:
        """(n_r, ...) on rank r -> (sum_r n_r, ...) on every rank, with the backward a model-parallel loss needs.

        Each rank's loss uses the *whole* gathered tensor, so the gradient of the total loss with respect
        to rank r's rows is the SUM over ranks of the incoming gradients' rows of r (a reduce-scatter).
        ``hvd.allgather``'s own autograd *averages* them instead (1/N of the right value). ``grad_scale``
        multiplies the result: pass the world size when the gradient then goes through an averaging
        DistributedOptimizer (InsightFace's PartialFC AllGatherFunc does the same ``*= world_size``).
        """
        return _AllGatherSum.apply(tensor, self, name, float(grad_scale))

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
        avg = self.grouped_average(tensors, name=f"buffers.{name}")
        k = len(bn_means)
        for i in range(k):
            mean, var, sq = avg[i], avg[k + i], avg[2 * k + i]
            bn_means[i].copy_(mean)
            bn_vars[i].copy_((var + sq - mean * mean).clamp_min(0))
        for b, a in zip(others, avg[3 * k:]):
            b.copy_(a)

    def step_synchronized(self, optimizer, step_fn=None) -> None:
        """Step an optimizer from ``distributed_optimizer`` whose gradients were already synchronized (and
        then checked and clipped): its ``skip_synchronize``. Not a collective."""
        with optimizer.skip_synchronize():
            (step_fn or optimizer.step)()

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


class _AllGatherSum(torch.autograd.Function):
    """Forward: allgather along dim 0. Backward: sum over ranks of the gradient, this rank's rows, x scale."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: CommBase, name: str, grad_scale: float) -> torch.Tensor:
        n = torch.tensor([tensor.shape[0]], dtype=torch.int64)
        counts = comm.allgather_tensor(n, f"{name}.rows")                          # (N,) rows per rank
        ctx.comm, ctx.name, ctx.grad_scale = comm, name, grad_scale
        ctx.counts = counts.tolist()                                               # one host read
        return comm.allgather_tensor(tensor.contiguous(), name)                    # (M, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm, counts = ctx.comm, ctx.counts
        # Allreduce the whole (M, ...) gradient and keep this rank's rows. Not a reduce-scatter: with
        # Horovod 0.28 + Gloo, once a reducescatter has run, every later collective of the process is
        # ~10-60x slower on this machine (the benchmark's `global` step at 10k classes, D=128: 860 ms
        # with it, 219 ms without; an allgather of 128 KB: 68 ms after one, 1-2 ms otherwise).
        total = comm.allreduce_tensor(grad.contiguous(), "sum", f"gather.{ctx.name}.grad")  # (M, ...)
        start = sum(counts[:comm.rank])
        mine = total[start:start + counts[comm.rank]]                              # (n_r, ...)
        if ctx.grad_scale != 1.0:
            mine = mine * ctx.grad_scale
        return mine, None, None, None


def gradient_bytes(params: Iterable[torch.nn.Parameter], fp16_compression: bool = False) -> int:
    """Bytes of one allreduce of these parameters' gradients as sent (compression halves fp32). Not a collective."""
    total = 0
    for p in params:
        itemsize = 2 if (fp16_compression and p.dtype == torch.float32) else p.element_size()
        total += p.numel() * itemsize
    return total
