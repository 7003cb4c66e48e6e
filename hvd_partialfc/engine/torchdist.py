"""The torch.distributed engine: the ``Comm`` interface over ``torch.distributed`` (Gloo on CPU, NCCL on
GPU), for jobs launched by ``torchrun`` (one node, many nodes, elastic). Same numbers as Horovod's engine.

What it must reproduce, and how:

* **Averages as Horovod computes them**: the sum over ranks, then x 1/N in the tensor's dtype (Horovod's
  ``op=Average`` is a sum with a post-scale). DDP's default hook and its stock fp16 hook divide *before*
  the sum, which rounds differently. With ``fp16_compression`` a gradient is cast to float16, summed in
  float16, scaled by 1/N in float16 and cast back, as ``hvd.Compression.fp16`` does. At N = 2 a sum of two
  values and a x 0.5 are exact, so both engines give the same bits (tests/test_engines.py checks it).
* **The backbone's gradients only**, bucketed and overlapped with the backward pass: a post-accumulate hook
  per parameter counts its passes (``backward_passes_per_step``); when every parameter of a bucket has
  its last pass, the bucket (flattened, ~``BUCKET_MB``) starts an asynchronous all-reduce while autograd
  goes on. ``synchronize()`` waits, scales and writes the averages back into ``.grad``.
* **Buckets in one order on every rank**: torch.distributed pairs the k-th all-reduce of every rank, so bucket b
  starts only after buckets 0 .. b-1 (a ready bucket waits for its predecessors), and whatever never got ready
  starts at ``synchronize`` in the same order, a missing gradient as zeros (as Horovod sends). Before, buckets
  started as they got ready: a parameter with a gradient on some ranks only (a branch one rank skips) left
  its bucket to ``synchronize`` there while the others launched it from the hook, and the k-th all-reduces
  paired different buckets (wrong averages of equal-sized ones, or a hang). Horovod matches tensors by name. Not DDP: the
  step needs Horovod's ``synchronize`` / ``skip_synchronize`` (check the averaged norm, clip, skip on
  non-finite values, vote) and DDP would also wrap the module (its state-dict keys) and broadcast buffers.
* **Collective order**: Horovod matches collectives by name, torch.distributed by the order of calls, so
  a code path taken on one rank only hangs or, worse, pairs unrelated tensors. With
  ``HVD_PARTIALFC_CHECK_COLLECTIVES=1`` (the test suite sets it) every collective first all-gathers a hash
  of its name, and a mismatch raises ``RankFailure`` on every rank, naming each rank's collective. It
  costs one small all-gather per collective: a debug check, off by default.

Contract as ``horovod.py``'s: every function is a collective unless its docstring says otherwise, and
results come back on the device the input was on.
"""
from __future__ import annotations

import atexit
import gc
import hashlib
import os
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import torchrun_agent
from .base import DEFAULT_COLLECTIVE_TIMEOUT_S, CommBase, RankFailure, backbone_params
from .device import agreed_device, uses_cuda
from .optimizer import AveragingOptimizer, by_dtype, plan_buckets
from .round_store import agreed_prefix

CHECK_ENV = "HVD_PARTIALFC_CHECK_COLLECTIVES"
# Bucket size of the gradient all-reduce. 25 MB is DDP's default: large enough that a bucket's latency is
# small against its transfer, small enough that the first bucket starts early in the backward pass.
BUCKET_MB = 25.0
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchComm(CommBase):
    """Rank/size of this process, and the torch.distributed primitives under ``CommBase``'s collectives.
    ``device``: where collectives run (CPU for Gloo, this rank's GPU for NCCL)."""

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int, device: torch.device,
                 check_names: bool = False):
        super().__init__(rank=rank, size=size, local_rank=local_rank, local_size=local_size)
        self.device, self.check_names, self.calls = device, check_names, 0

    # --- the debug check of collective order ----------------------------------------------------------
    def check_name(self, name: str) -> None:
        """With the check on: RankFailure on every rank unless every rank's next collective is ``name``."""
        if not self.check_names or self.size == 1:
            return
        self.calls += 1
        h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")
        t = torch.tensor([h], dtype=torch.int64, device=self.device)              # (1,)
        got = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(got, t)
        if len({int(g) for g in got}) != 1:
            names: List[Any] = [None] * self.size
            dist.all_gather_object(names, name)
            detail = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            raise RankFailure(f"collective #{self.calls} differs across ranks ({detail}): a code path "
                              "taken on some ranks only")

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` on the collective's device (never the caller's storage)."""
        t = tensor.detach()
        return t.to(self.device, copy=True).contiguous() if t.device != self.device else t.clone().contiguous()

    # --- small named collectives --------------------------------------------------------------------
    def allreduce_scalar(self, value: float, op: str, name: str) -> float:
        """min / max / sum / average of one number over ranks (float64: exact for ints < 2^53)."""
        if op not in ("min", "max", "sum", "average"):
            raise ValueError(f"unknown op {op!r}")
        self.check_name(f"scalar.{name}")
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)  # (1,)
        dist.all_reduce(t, op=_OPS["sum" if op == "average" else op])
        total = float(t[0])
        return total * (1.0 / self.size) if op == "average" else total

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        self.check_name(f"object.{name}")
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def vote_async(self, flags: List[float], name: str) -> "TorchVote":
        """Start an elementwise max of a few flags over ranks; ``.result()`` waits for it. It runs in the
        background while the next step computes, as Horovod's vote rides in that step's cycle."""
        self.check_name(f"vote.{name}")
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=self.device)  # (K,)
        return TorchVote(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t)

    # --- tensor collectives for the baselines (classifier modes `global` / `replicated`) -------------
    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """Elementwise max / sum of a tensor over ranks, out of place. No autograd."""
        self.check_name(f"tensor.{name}")

        def reduce(t: torch.Tensor) -> torch.Tensor:
            out = self._on_device(t)
            dist.all_reduce(out, op=_OPS[op])
            return out.to(t.device)
        return self._timed(tensor, reduce)

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order (row counts may differ: they are
        gathered first, and rows padded to the largest count)."""
        self.check_name(f"gather.{name}")

        def gather(t: torch.Tensor) -> torch.Tensor:
            x = self._on_device(t)
            n = torch.tensor([x.shape[0]], dtype=torch.int64, device=self.device)  # (1,)
            counts = [torch.empty_like(n) for _ in range(self.size)]
            dist.all_gather(counts, n)
            rows = torch.cat(counts).tolist()          # one host read (NCCL: the counts are on the GPU)
            top = max(rows)
            if x.shape[0] < top:
                x = torch.cat([x, x.new_zeros((top - x.shape[0],) + tuple(x.shape[1:]))])
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
            return torch.cat([p[:r] for p, r in zip(parts, rows)]).to(t.device)
        return self._timed(tensor, gather)

    def grouped_average(self, tensors: List[torch.Tensor], name: str) -> List[torch.Tensor]:
        """Elementwise mean over ranks of each tensor (the sum, then x 1/N: Horovod's average), out of
        place; one all-reduce per dtype."""
        self.check_name(f"grouped.{name}")
        out: List[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for dtype, idx in by_dtype(tensors).items():
            flat = torch.cat([self._on_device(tensors[i]).reshape(-1) for i in idx])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.mul_(1.0 / self.size)
            for i, chunk in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                out[i] = chunk.view_as(tensors[i]).to(tensors[i].device)
        return out

    # --- the backbone -------------------------------------------------------------------------------
    def broadcast_module(self, module: nn.Module, name: str, root_rank: int = 0) -> None:
        """Overwrite ``module``'s parameters *and* buffers with root's (identical starts)."""
        state = dict(module.named_parameters())
        state.update(dict(module.named_buffers()))
        self.check_name(f"broadcast.{name}.{len(state)}")
        with torch.no_grad():
            for key in sorted(state):
                t = self._on_device(state[key])
                dist.broadcast(t, src=root_rank)
                state[key].copy_(t)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                              fp16_compression: bool = False,
                              backward_passes_per_step: int = 1) -> "BucketAverager":
        """Wrap the *backbone's* optimizer: its gradients are averaged over ranks before each step (see the
        module's docstring: bucketed, overlapped with the backward pass, Horovod's average)."""
        return BucketAverager(self, optimizer, backbone_params(optimizer, module), fp16_compression,
                              backward_passes_per_step)

    def regroup_refusal(self) -> Optional[str]:
        """None under elastic torchrun across nodes with restarts (the others' agents restart without a node that
        left), else why not."""
        if _restarts_across_nodes(os.environ):
            return None
        return ("the job goes on without a node only under elastic torchrun across nodes with restarts "
                "(--nnodes MIN:MAX, --max-restarts > 0)")

    def stop_agent(self) -> None:
        """This node leaves the elastic job (an evicted straggler): SIGTERM to its torchrun agent, from the node's
        first rank (torchrun_agent.py; anything but a torchrun agent is not signalled). An agent that ends normally
        closes the rendezvous and so ends the whole job; one stopped by a signal leaves it open (torch's launcher),
        so the other nodes' agents re-form the group without it. The agent stops its workers with SIGTERM: every
        rank of the node ignores it before this is called (stragglers.Eviction.part)."""
        if self.local_rank == 0:
            torchrun_agent.stop_agent()

    def hosts_rendezvous(self) -> bool:
        """Whether this rank's torchrun agent serves the job's rendezvous store (torchrun_agent.py). Not a
        collective."""
        return torchrun_agent.hosts_rendezvous()

    def shutdown(self) -> None:
        gc.collect()                   # the Work objects of the last steps, while their tensors can still go
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect_before_exit() -> None:
    """Free the garbage that holds collectives' Work objects while the interpreter is still whole.

    A Gloo Work holds tensors; the trainer's objects reference each other (optimizer hooks, the averager),
    so the last steps' Works are freed by the cyclic collector, and left to it they go at the interpreter's
    exit, where freeing a tensor takes the GIL of an interpreter being torn down: SIGABRT ("terminate called
    without an active exception"). Seen twice in ~100 torchrun launches of the test suite, after training
    had ended well (the mechanism is torch's, pytorch/pytorch#179291); not reproduced in 22 tries by hand,
    so this is a mitigation whose rate is not measured. atexit handlers run before that teardown.
    """
    gc.collect()


atexit.register(_collect_before_exit)


class TorchVote:
    """An all-reduce in flight (``TorchComm.vote_async``)."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def result(self) -> List[float]:
        self.work.wait()
        return [float(v) for v in self.tensor.cpu()]


class BucketAverager(AveragingOptimizer):
    """Horovod's DistributedOptimizer over torch.distributed: gradients averaged in buckets that start
    during the backward pass (``AveragingOptimizer`` gives the rest of the interface)."""

    def __init__(self, comm: TorchComm, optimizer, named_params, fp16_compression: bool,
                 backward_passes_per_step: int, bucket_mb: float = BUCKET_MB):
        super().__init__(comm, optimizer, named_params, fp16_compression, backward_passes_per_step)
        self.buckets = plan_buckets(self._params, int(bucket_mb * 2 ** 20))
        self._bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        # A list to fill (the step profile, tools/profile_marks.py), else None: [bucket, bytes, launched, done] of each
        # all-reduce, ``time.perf_counter`` seconds, done when its future completes (Gloo: the reduction has
        # finished; NCCL: when it is queued on the GPU, so a GPU's overlap comes from its kernel trace instead).
        self.timeline = None
        self._reset()
        if comm.size > 1:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self) -> None:
        self._passes: Dict[int, int] = {}
        self._waiting = [len(ps) for ps in self.buckets]
        self._next = 0                                               # the next bucket to launch, in order
        self._inflight: List[Tuple[int, Any, torch.Tensor]] = []     # (bucket, its all-reduce, its buffer)

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Autograd's hook after ``p.grad`` was accumulated: launch p's bucket after its last pass."""
        n = self._passes.get(id(p), 0) + 1
        self._passes[id(p)] = n
        if n == self.backward_passes_per_step:
            b = self._bucket_of[id(p)]
            self._waiting[b] -= 1
            while self._next < len(self.buckets) and self._waiting[self._next] == 0:   # in bucket order only
                self._launch(self._next)
                self._next += 1

    def _launch(self, b: int) -> None:
        comm: TorchComm = self._comm
        grads = []
        for p in self.buckets[b]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)      # a parameter without a gradient sends zeros, as Horovod's
            elif p.grad.is_sparse:
                raise RuntimeError("sparse backbone gradients are not averaged by the torch engine")
            grads.append(p.grad.detach().reshape(-1))
        flat = torch.cat(grads)
        if self._fp16 and flat.is_floating_point():
            flat = flat.half()
        flat = flat.to(comm.device)
        comm.check_name(f"gradients.backbone.bucket{b}")
        comm.sent_bytes += flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        if self.timeline is not None:
            rec = [b, flat.numel() * flat.element_size(), time.perf_counter(), None]
            self.timeline.append(rec)
            work.get_future().then(lambda _, rec=rec: rec.__setitem__(3, time.perf_counter()))
        self._inflight.append((b, work, flat))

    def synchronize(self) -> None:
        """Every backbone gradient replaced by its mean over ranks (buckets not launched by the hooks, e.g.
        fewer passes than ``backward_passes_per_step``, are launched here in bucket order)."""
        if self._comm.size == 1:
            return
        for b in range(self._next, len(self.buckets)):     # what never got ready, in the same order
            self._launch(b)
        self._next = len(self.buckets)
        scale = 1.0 / self._comm.size
        with torch.no_grad(), self._comm.waiting():
            for b, work, flat in self._inflight:
                work.wait()
                flat.mul_(scale)                  # Horovod's post-scale, in the sent dtype
                ps = self.buckets[b]
                for p, chunk in zip(ps, flat.split([p.numel() for p in ps])):
                    p.grad.copy_(chunk.view_as(p))
        self._reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._inflight:
            raise RuntimeError("zero_grad() with gradient all-reduces in flight: call synchronize() first")
        self._reset()
        super().zero_grad(set_to_none=set_to_none)


def _restarts_across_nodes(environ) -> bool:
    """torchrun may restart this job (``--max-restarts`` > 0) and it spans more than one agent."""
    return all(environ.get(k, "0").isdigit() for k in ("TORCHELASTIC_MAX_RESTARTS", "GROUP_WORLD_SIZE")) and \
        int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and int(environ.get("GROUP_WORLD_SIZE", "1")) > 1


def _round_store(rank: int, size: int, timeout: timedelta):
    """The torchrun agent's store (shared by every rendezvous round of the job), with the keys of this round
    only: the prefix every member of the round agreed on (round_store.py says why and how; keyed by
    ``TORCHELASTIC_RESTART_COUNT`` before, which agents count each on their own, so a node that joined back
    took another prefix than the rest and init_process_group hung)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(agreed_prefix(store, rank, size, timeout.total_seconds()), store)


def init(device: str = "auto", share_gpu: bool = False, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> TorchComm:
    """Join the torch.distributed group: under torchrun from its environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), alone as a group of one.

    On CPU the group is Gloo. On a GPU (``device`` as ``train.device``) it is NCCL for CUDA tensors and Gloo
    for host ones, and ``device.agreed_device`` then picks this rank's GPU and gathers every rank's over Gloo,
    before any NCCL collective: a rank without a GPU, or ranks sharing one, are one ConfigError on every
    rank (NCCL's own refusal, "Duplicate GPU detected", comes deep in a traceback at the first collective).
    The GPU is made current after the group is formed, which NCCL allows: it creates its communicators at
    the first collective. With ``share_gpu`` (``train.share_gpu``) sharing ranks are allowed, and then every
    rank's collectives run on host tensors over Gloo (one backend per collective on all ranks); without
    sharing, NCCL.

    ``timeout_s`` (``train.collective_timeout``): how long a rank waits in one collective, and for the group
    to form (the store's waits). torch's default is 30 minutes, and ranks waiting while rank 0 evaluated
    alone (a large verification set) died there; a lost peer is the heartbeat's to find, in seconds.
    """
    alone = "RANK" not in os.environ
    rank, size = (0, 1) if alone else (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    backend = "cpu:gloo,cuda:nccl" if uses_cuda(device) else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if alone:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_round_store(rank, size, timeout), rank=rank, world_size=size,
                                    timeout=timeout)
            if rank == 0 and _restarts_across_nodes(os.environ):
                print("note: torchrun shares its store across rounds (its default): a node that joins back "
                      "hangs torchrun's own rendezvous; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun "
                      "where nodes may join (docs/engines.md, Elastic)", flush=True)
        else:
            dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout)
    where, shared = agreed_device(device, rank, local_rank, size, share_gpu, _allgather_host)
    if shared:
        where = torch.device("cpu")                   # every rank's collectives on host tensors: Gloo
    return TorchComm(rank, size, local_rank, local_size, where,
                     check_names=os.environ.get(CHECK_ENV, "") not in ("", "0"))


def arcface_data_parallel(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` wrapped as arcface_torch's train_v2.py wraps its backbone (torch's DDP, 16 MB buckets, unused
    parameters searched, static graph, gradients all-reduced in fp16), in the group ``init`` made: for the
    side-by-side benchmark (tools/arcface_compare.py), whose arcface step must be that step, DDP included."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    ddp = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                              broadcast_buffers=False, bucket_cap_mb=16,
                                              find_unused_parameters=True, static_graph=True)
    ddp.register_comm_hook(None, fp16_compress_hook)
    return ddp


def _allgather_host(obj: Any) -> List[Any]:
    """Every rank's picklable ``obj``: over Gloo, since object collectives of a group with a ``cpu`` backend
    run on the host (torch.distributed's rule)."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
