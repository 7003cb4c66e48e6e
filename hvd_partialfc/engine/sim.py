"""The ``Comm`` interface for N virtual ranks in one process: the simulator's collectives. No Horovod.

One Python thread per virtual rank runs the unchanged trainer (startup.py, trainer.py); their collectives meet here.

The baton. Exactly one virtual rank runs at a time: it holds the baton, and gives it up only inside a
collective (the next rank in line takes it), so collectives that block inside autograd (``global`` mode's
all-gather in the forward AND the backward) work as under Horovod, and the process computes like one
process on the global batch (no oversubscription of the cores). Because one rank runs at a time, the process-global random generators (torch CPU,
numpy, Python ``random``; CUDA when used) are each rank's own: when the baton passes to another rank, the
states of the rank that ran are saved and the next rank's restored. So ``torch.manual_seed`` in
``parts.build_parts``, dropout, head sampling, and a checkpoint's save/restore of the RNG states act on
the rank's own streams, as in a process per rank.

The numbers. A collective is computed once, by the last rank to arrive, over the ranks' values in rank
order. Averages are Horovod's: the sum over ranks, then times 1/N (its ``Average`` is a ``Sum`` with a 1/N
post-scale). At N = 2 the sum a + b does not depend on the order, so a simulated run is bitwise the
``horovodrun -np 2`` run (tested); for N > 2 Gloo's ring adds in another order, and the parameters differ
at float32 round-off (docs/evidence/simulate.md has the figures).

Failures. A rank that raises (anywhere) marks the world failed and wakes every rank; a rank waiting in a
collective, or for the baton, then raises ``SimAbort``, so no rank waits forever (Horovod's launcher kills
the other processes instead). A rank calling another collective than the others (kind or name), or a rank
finishing while others wait in a collective, fails the world with a message that says so.
"""
from __future__ import annotations

import copy
import ctypes
import random
import threading
from collections import deque
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.nn as nn

from .base import CommBase, RankFailure, backbone_params
from .device import cuda_in_use
from .optimizer import AveragingOptimizer


class SimAbort(RankFailure):
    """Raised in a virtual rank that waits while another rank has failed (not the cause: see ``SimWorld.failure``)."""


class _Round:
    """One collective in progress: its kind and name, every rank's value, and the result once complete."""

    def __init__(self, kind: str, name: str, size: int):
        self.kind, self.name = kind, name
        self.values: List[Any] = [None] * size
        self.arrived = 0
        self.result: Any = None


_MT_STATE_BYTES = 624 * 4 + 4   # numpy's mt19937_state: uint32 key[624], int pos


def _numpy_fingerprint() -> bytes:
    """The raw Mersenne Twister state (key and position) of numpy's global generator, read through the bit
    generator's public ctypes interface: ~1 us, where ``np.random.get_state()`` takes ~45 us."""
    return ctypes.string_at(np.random.get_bit_generator().ctypes.state_address, _MT_STATE_BYTES)


class _Streams:
    """One virtual rank's process-global random streams: torch CPU, numpy, Python ``random`` (CUDA when used).

    ``save()`` when the baton leaves the rank, ``load()`` when it comes back. The baton passes N times per
    collective, and numpy's full get + set took ~95 us of the ~350 us a rank spent per collective (the
    rest: ~50 us Python ``random``, the threads' hand-over); at N = 256 with sync BatchNorm (38
    collectives a step for the demo backbone) that was 3 s of an 18 s step. numpy's state is therefore
    read and set only when it changed, which is exact: the process state is compared by its raw
    Mersenne Twister state (``_numpy_fingerprint``), and the one part of the legacy state outside it (the
    cached Gaussian of ``np.random.randn`` and the like) can only be consumed without a draw when one is
    cached, in which case the full state is read. (Setting, by ``np.random.set_state``, the very same key
    and position with another cached Gaussian would go unseen.)
    """

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.python = random.getstate()
        self.numpy = np.random.get_state()        # legacy tuple: (kind, key, pos, has_gauss, gauss)
        self.np_fingerprint = _numpy_fingerprint()
        self.cuda = torch.cuda.get_rng_state() if cuda_in_use() else None   # the current device's

    def save(self) -> None:
        """Record the process generators' states as this rank's."""
        self.torch = torch.get_rng_state()
        self.python = random.getstate()
        fingerprint = _numpy_fingerprint()
        if fingerprint != self.np_fingerprint or self.numpy[3]:
            self.numpy, self.np_fingerprint = np.random.get_state(), fingerprint
        if cuda_in_use():
            self.cuda = torch.cuda.get_rng_state()

    def load(self, current: Optional["_Streams"]) -> None:
        """Make this rank's states the process generators'; ``current``: the streams saved last (the process
        holds them now), or None (unknown: set everything)."""
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        if current is None or self.np_fingerprint != current.np_fingerprint or self.numpy[3:] != current.numpy[3:]:
            np.random.set_state(self.numpy)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


class SimWorld:
    """N virtual ranks: the baton, the rendezvous of their collectives, and the failure state.

    Threads call ``enter(rank)`` first (wait for the baton), then run; ``leave(rank)`` when done, or
    ``fail(rank, exc)`` on an error. The thread that created the world calls ``begin()`` once every rank
    thread is started. Every rank starts with the random generator states of the creating thread.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"ranks must be >= 1, got {size}")
        self.size = size
        self._lock = threading.Lock()
        self._wake = [_held_lock() for _ in range(size)]   # rank r waits on _wake[r]; released: its turn
        self._ready = deque(range(size))        # ranks waiting for the baton, in the order they get it
        self._round: Optional[_Round] = None
        self._finished: set = set()
        initial = _Streams()
        self._streams: List[_Streams] = [copy.deepcopy(initial) for _ in range(size)]
        self._streams_owner: Optional[int] = None  # whose streams the process generators hold now
        self.failure: Optional[BaseException] = None   # the first error of any rank (not a SimAbort)
        self.failed_rank: Optional[int] = None
        self.collectives = 0

    # --- the baton ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Hand the baton to the first rank (rank 0)."""
        self._pass()

    def enter(self, rank: int) -> None:
        """A rank thread's first call: wait for the baton."""
        self._wake[rank].acquire()
        self._resume(rank)

    def leave(self, rank: int) -> None:
        """A rank is done (its trainer returned): hand the baton on. Others still in a collective would wait
        forever: that fails the world."""
        with self._lock:
            self._finished.add(rank)
            pending = self._round
        if pending is not None and self.failure is None:
            waiting = [r for r, v in enumerate(pending.values) if v is not None]
            self.fail(rank, RankFailure(f"rank {rank} finished while ranks {waiting} wait in {pending.kind} "
                                        f"'{pending.name}'"))
            return
        self._pass()

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record the first real error and wake every rank (each raises SimAbort where it waits)."""
        with self._lock:
            self._finished.add(rank)
            if self.failure is None and not isinstance(exc, SimAbort):
                self.failure, self.failed_rank = exc, rank
            elif self.failure is None:
                return
        for lock in self._wake:
            try:
                lock.release()
            except RuntimeError:   # released already: that rank wakes anyway
                pass

    def _pass(self, me: Optional[int] = None) -> Optional[int]:
        """Give the baton to the next rank in line (None: nobody is waiting for it); ``me``, the calling
        rank, keeps it without a wake-up when it is next."""
        with self._lock:
            nxt = self._ready.popleft() if self._ready else None
        if nxt is not None and nxt != me:
            self._wake[nxt].release()
        return nxt

    def _resume(self, rank: int) -> None:
        """Called by a rank that was woken: raise if the world failed, else load its random streams."""
        if self.failure is not None:
            raise SimAbort(f"rank {rank}: stopped because rank {self.failed_rank} failed "
                           f"({type(self.failure).__name__}: {self.failure})")
        owner = self._streams_owner
        if owner != rank:
            if owner is not None:
                self._streams[owner].save()
            self._streams[rank].load(self._streams[owner] if owner is not None else None)
            self._streams_owner = rank

    # --- collectives ------------------------------------------------------------------------------------
    def meet(self, rank: int, kind: str, name: str, value: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """A collective: deposit ``value``; the last rank to arrive computes ``combine(values in rank order)``
        once; every rank returns that result, ranks resuming in rank order."""
        if self.failure is not None:
            self._resume(rank)   # raises
        r = self._round
        if self._finished:
            self._fail_here(rank, f"rank {rank} calls {kind} '{name}' after ranks {sorted(self._finished)} "
                                  f"finished")
        if r is None:
            r = self._round = _Round(kind, name, self.size)
        elif (r.kind, r.name) != (kind, name):
            self._fail_here(rank, f"collective mismatch: rank {rank} calls {kind} '{name}' while ranks "
                                  f"{[i for i, v in enumerate(r.values) if v is not None]} are in {r.kind} '{r.name}'")
        if value is None:
            value = _NONE
        r.values[rank] = value
        r.arrived += 1
        if r.arrived == self.size:
            self._round = None
            self.collectives += 1
            try:
                r.result = combine([None if v is _NONE else v for v in r.values])
            except Exception as e:
                self._fail_here(rank, f"{kind} '{name}': {type(e).__name__}: {e}")
            r.values = None
            with self._lock:
                self._ready.extend(range(self.size))
        nxt = self._pass(rank)
        if nxt != rank:
            if nxt is None:
                self._fail_here(rank, f"deadlock: no rank can run after rank {rank} entered {kind} '{name}'")
            self._wake[rank].acquire()
        self._resume(rank)
        return r.result

    def _fail_here(self, rank: int, message: str) -> None:
        exc = RankFailure(message)
        self.fail(rank, exc)
        raise exc


def _held_lock() -> threading.Lock:
    """A lock taken already: ``acquire()`` waits until another thread calls ``release()`` (a binary
    semaphore; the baton never signals a rank twice). threading.Semaphore is Python code over a Condition;
    a lock hands over in C (~50 us less per rank and collective here)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


_NONE = object()   # a rank's value None (allgather_object of "no error"), told apart from "not arrived"


def _sum(values: List[torch.Tensor]) -> torch.Tensor:
    """Sum over ranks in rank order (Horovod's reduction is a sum; at N = 2, a + b in any order)."""
    acc = values[0].clone()
    for v in values[1:]:
        acc.add_(v)
    return acc


def _average_lists(lists: List[List[torch.Tensor]]) -> List[torch.Tensor]:
    """Elementwise mean over ranks of each position of equal-length tensor lists: the sum, then x 1/N."""
    acc = [t.clone() for t in lists[0]]
    for other in lists[1:]:
        torch._foreach_add_(acc, other)
    if len(lists) > 1:
        torch._foreach_mul_(acc, 1.0 / len(lists))
    return acc


class SimComm(CommBase):
    """Virtual rank ``rank`` of ``world``, as if all ranks shared this host: ``local_size`` is N, so the
    trainer's default intra-op thread count is a real run's here (cores // N, at least 1). It matters: the
    convolutions round differently with 1 and 2 threads, and only the same count is bitwise a real run
    (``train.threads`` sets another). ``local_rank`` is 0: on a GPU host every virtual rank uses the first.
    """

    times_ranks = False     # virtual ranks take turns in one process: their step times name no straggler

    def __init__(self, world: SimWorld, rank: int):
        super().__init__(rank=rank, size=world.size, local_rank=0, local_size=world.size)
        self.world = world

    def regroup_refusal(self) -> Optional[str]:
        return "the simulator's ranks are one process"

    def _meet(self, kind: str, name: str, value: Any, combine) -> Any:
        return self.world.meet(self.rank, kind, name, value, combine)

    # --- small named collectives --------------------------------------------------------------------
    def allreduce_scalar(self, value: float, op: str, name: str) -> float:
        """min / max / sum / average of one number over ranks (float64, summed in rank order)."""
        def combine(vals):
            if op in ("min", "max"):
                return (min if op == "min" else max)(vals)
            total = 0.0
            for v in vals:
                total += v
            return total * (1.0 / len(vals)) if op == "average" else total
        if op not in ("min", "max", "sum", "average"):
            raise ValueError(f"unknown op {op!r}")
        return float(self._meet("scalar", name, float(value), combine))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order (each rank gets its own copy, as after unpickling)."""
        return copy.deepcopy(self._meet("object", name, obj, list))

    def vote_async(self, flags: List[float], name: str) -> "SimVote":
        """The flags' elementwise max over ranks, resolved when ``.result()`` is called (a collective there)."""
        return SimVote(self, [float(f) for f in flags], name)

    # --- tensor collectives --------------------------------------------------------------------------
    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """Elementwise max / sum of a tensor over ranks, out of place. No autograd."""
        if op == "sum":
            combine = _sum
        elif op == "max":
            def combine(vals):
                return torch.stack(vals).amax(dim=0)
        else:
            raise ValueError(f"unknown op {op!r}")
        return self._timed(tensor, lambda t: self._meet("tensor", name, t, combine).clone())

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order (row counts may differ)."""
        return self._timed(tensor, lambda t: self._meet("gather", name, t, torch.cat).clone())

    def grouped_average(self, tensors: List[torch.Tensor], name: str) -> List[torch.Tensor]:
        """Elementwise mean over ranks of each tensor, out of place."""
        out = self._meet("grouped", name, [t.detach() for t in tensors], _average_lists)
        return [t.clone() for t in out]

    # --- the backbone -------------------------------------------------------------------------------
    def broadcast_module(self, module: nn.Module, name: str, root_rank: int = 0) -> None:
        """Overwrite ``module``'s parameters *and* buffers with root's (identical starts)."""
        state = dict(module.named_parameters())
        state.update(dict(module.named_buffers()))
        root = self._meet("broadcast", name, state, lambda vals: vals[root_rank])
        if self.rank != root_rank:
            if list(root) != list(state):
                raise RankFailure(f"rank {self.rank}: '{name}' differs from rank {root_rank}'s module")
            with torch.no_grad():
                for k, v in state.items():
                    v.copy_(root[k])

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                              fp16_compression: bool = False,
                              backward_passes_per_step: int = 1) -> AveragingOptimizer:
        """Wrap the *backbone's* optimizer: its gradients are averaged over ranks before each step."""
        return AveragingOptimizer(self, optimizer, backbone_params(optimizer, module), fp16_compression,
                                  backward_passes_per_step)

    def average_gradients(self, grads: List[torch.Tensor], name: str, fp16: bool) -> List[torch.Tensor]:
        """The elementwise mean over ranks of each gradient (``fp16``: sent, summed and scaled in float16,
        as Horovod's fp16 compression does), in the gradients' dtype."""
        sent = [g.half() for g in grads] if fp16 else grads
        return self._meet("gradients", name, sent, _average_lists)

    def shutdown(self) -> None:
        pass


class SimVote:
    """A vote started by ``SimComm.vote_async``: the max over ranks is taken when ``result`` is called."""

    def __init__(self, comm: SimComm, flags: List[float], name: str):
        self.comm, self.flags, self.name = comm, flags, name

    def result(self) -> List[float]:
        t = torch.tensor(self.flags, dtype=torch.float64)                          # (K,)
        out = self.comm.world.meet(self.comm.rank, "vote", self.name, t, lambda v: torch.stack(v).amax(dim=0))
        return [float(v) for v in out]
