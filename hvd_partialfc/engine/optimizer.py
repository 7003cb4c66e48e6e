"""The averaging optimizer of the engines that have none of their own: the simulator's (sim.py), whose
``average_gradients`` is its collective, and the no-communication engine's (local.py), which averages
nothing. The same interface as Horovod's ``DistributedOptimizer``: ``synchronize``, ``skip_synchronize``,
``step``, ``zero_grad``, ``param_groups``, ``state_dict``. Not a collective to import; no Horovod."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, List

import torch


class AveragingOptimizer:
    """Horovod's DistributedOptimizer, as the trainer uses it, over any engine's ``average_gradients``.

    ``synchronize()`` replaces every gradient by its mean over ranks (a parameter without a gradient
    sends zeros, as Horovod does); ``step()`` synchronizes first unless inside ``skip_synchronize()``;
    ``zero_grad``, ``param_groups``, ``state``, ``state_dict`` and ``load_state_dict`` are the wrapped
    optimizer's (the same state-dict format as Horovod's, whose optimizer is the same class). Gradients are
    accumulated locally over ``backward_passes_per_step`` passes and averaged once, as Horovod's hooks do.
    At one rank nothing is averaged (Horovod registers no hooks there either).
    """

    def __init__(self, comm, optimizer: torch.optim.Optimizer, named_params, fp16_compression: bool,
                 backward_passes_per_step: int):
        self._comm, self._opt = comm, optimizer
        self._params = [p for _, p in named_params if p.requires_grad]
        self._fp16 = bool(fp16_compression)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._should_synchronize = True

    @property
    def param_groups(self):
        return self._opt.param_groups

    @property
    def state(self):
        return self._opt.state

    @property
    def found_inf(self):
        return getattr(self._opt, "found_inf", None)

    @found_inf.setter
    def found_inf(self, flag) -> None:
        """torch's fused kernels skip their update where this (1,) tensor is non-zero (train.skip_decision=device),
        read by the wrapped optimizer's ``step`` as ``GradScaler`` sets it."""
        self._opt.found_inf = flag

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._opt.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        if self._comm.size == 1:
            return
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                raise RuntimeError("sparse gradients are not averaged by the simulator")
        grads = [p.grad for p in self._params]
        avg = self._comm.average_gradients(grads, "backbone.gradients", self._fp16)
        with torch.no_grad():
            torch._foreach_copy_(grads, avg)

    @contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            self.synchronize()
        return self._opt.step(closure)

    def state_dict(self) -> Dict[str, Any]:
        return self._opt.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._opt.load_state_dict(state)


def by_dtype(tensors: List[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    """The indices of ``tensors`` by dtype (a collective runs on one dtype at a time)."""
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def plan_buckets(params: List[torch.Tensor], cap_bytes: int) -> List[List[torch.Tensor]]:
    """Parameters in reverse order (autograd reaches the last layers first), cut into buckets of at most
    ``cap_bytes`` (a larger parameter gets a bucket of its own), one dtype and device a bucket."""
    buckets: List[List[torch.Tensor]] = []
    size, key = 0, None
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or (p.dtype, p.device) != key or size + nbytes > cap_bytes:
            buckets.append([])
            size, key = 0, (p.dtype, p.device)
        buckets[-1].append(p)
        size += nbytes
    return buckets
