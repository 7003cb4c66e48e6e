"""The no-communication engine: the ``Comm`` interface for a rank that trains alone. No Horovod.

At one rank (``LocalComm()``) every collective is exact: a sum, a mean, a gather over one rank is that
rank's value. The benchmark's *limit* job also runs rank r of N here, to time what ``local`` would cost if
communication were free: its ``distributed_optimizer`` never averages, and any other collective across N
ranks is refused with an error rather than answered with one rank's value.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.nn as nn

from .base import CommBase, backbone_params
from .optimizer import AveragingOptimizer


class LocalComm(CommBase):
    """Rank ``rank`` of ``size``, without any communication (see the module's docstring)."""

    def __init__(self, rank: int = 0, size: int = 1):
        super().__init__(rank=rank, size=size, local_rank=rank, local_size=1)

    def _alone(self, what: str, name: str) -> None:
        if self.size > 1:
            raise RuntimeError(f"{what} '{name}' across {self.size} ranks: the no-communication engine "
                               "(engine/local.py) runs no collective; use a real engine or the simulator")

    def allreduce_scalar(self, value: float, op: str, name: str) -> float:
        self._alone("allreduce", name)
        return float(value)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        self._alone("allgather", name)
        return [obj]

    def vote_async(self, flags: List[float], name: str) -> "LocalVote":
        self._alone("vote", name)
        return LocalVote(flags)

    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        self._alone("allreduce", name)
        return self._timed(tensor, lambda t: t.clone())

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self._alone("allgather", name)
        return self._timed(tensor, lambda t: t.clone())

    def grouped_average(self, tensors: List[torch.Tensor], name: str) -> List[torch.Tensor]:
        self._alone("average", name)
        return [t.detach().clone() for t in tensors]

    def broadcast_module(self, module: nn.Module, name: str, root_rank: int = 0) -> None:
        self._alone("broadcast", name)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                              fp16_compression: bool = False,
                              backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
        """The optimizer itself, behind the interface's ``synchronize`` / ``skip_synchronize``: nothing is
        averaged, at any size."""
        return _Unaveraged(self, optimizer, backbone_params(optimizer, module), fp16_compression,
                           backward_passes_per_step)

    def shutdown(self) -> None:
        pass


class LocalVote:
    def __init__(self, flags: List[float]):
        self.flags = [float(f) for f in flags]

    def result(self) -> List[float]:
        return self.flags


class _Unaveraged(AveragingOptimizer):
    """The distributed optimizer's interface over a plain optimizer: ``synchronize`` does nothing."""

    def synchronize(self) -> None:
        pass
