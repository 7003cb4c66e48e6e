"""Which device a rank trains on, and the check that no two ranks share a GPU. The engines call
``agreed_device`` at their start, with their own all-gather of host objects (never NCCL's).

The rule (``select_device``), for ``train.device`` = ``cuda``, or ``auto`` with a GPU visible:

* **one GPU visible: cuda:0.** Slurm's ``--gpus-per-task=1`` and Kubernetes give each process its own GPU,
  which it sees as device 0 whatever its local rank: ``cuda:local_rank`` is then an invalid ordinal on
  every rank but the first of a node.
* **several visible: cuda:local_rank** (one process per GPU, all GPUs of the node visible to each: horovodrun,
  mpirun, torchrun). A local rank without a GPU of that number is a ``ConfigError`` naming the rank and
  what to do.

Two ranks that end up on one GPU (np = 2 on a one-GPU node; two processes given the same GPU by
``CUDA_VISIBLE_DEVICES``) are refused: NCCL fails at its first collective ("Duplicate GPU detected"), deep in a
traceback, and two ranks would compete for the GPU's memory. ``train.share_gpu: true`` allows it (small
tests and debugging; the torch engine's collectives then run over Gloo, through host memory). A GPU is named by its
host and UUID: the ordinal cannot tell, since two processes of one node may each call a different GPU cuda:0.
"""
from __future__ import annotations

import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import ConfigError

GpuId = Tuple[str, str]          # (host name, GPU UUID)


def uses_cuda(want: str) -> bool:
    """Whether ``train.device=want`` trains on a GPU (``auto``: when torch sees one). Not a collective."""
    return want == "cuda" or (want == "auto" and torch.cuda.is_available())


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (a run on a GPU has, before it draws, saves or restores a random
    state). Not merely available: a CPU run on a GPU node must not start a CUDA context to save nothing."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def cuda_ordinal(rank: int, local_rank: int, visible: int) -> int:
    """The CUDA ordinal of a rank that sees ``visible`` GPUs (the module's rule); ConfigError if it has none."""
    if visible == 1:
        return 0
    if visible == 0:
        raise ConfigError(f"rank {rank} (local rank {local_rank}): train.device=cuda, but no GPU is visible "
                          "(a CPU build of torch, CUDA_VISIBLE_DEVICES empty, or no driver); use "
                          "train.device=cpu or auto")
    if local_rank >= visible:
        raise ConfigError(f"rank {rank} (local rank {local_rank}) has no GPU: {visible} visible on this host; "
                          f"start at most {visible} ranks per node (one per GPU), or give each rank its own "
                          "GPU (Slurm --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank), or "
                          "train.device=cpu")
    return local_rank


def select_device(want: str, rank: int, local_rank: int) -> torch.device:
    """This rank's device for ``train.device=want``, made the current CUDA device when it is a GPU. The one
    place that picks it: both engines at their start (before any collective on a GPU) and the trainer."""
    if not uses_cuda(want):
        return torch.device("cpu")
    index = cuda_ordinal(rank, local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_identity(device: torch.device) -> Optional[GpuId]:
    """(host name, UUID) of ``device``, or None for the CPU. The PCI address stands in where torch gives
    no UUID (it is unique on a host too)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        uuid = "pci:{}:{}:{}".format(*(getattr(props, k, "?") for k in ("pci_domain_id", "pci_bus_id",
                                                                          "pci_device_id")))
    return socket.gethostname(), str(uuid)


def shared_gpus(identities: Sequence[Optional[GpuId]]) -> List[Tuple[GpuId, List[int]]]:
    """The GPUs used by more than one rank, each with its ranks (``identities``: every rank's, in rank order)."""
    ranks: Dict[GpuId, List[int]] = {}
    for r, gpu in enumerate(identities):
        if gpu is not None:
            ranks.setdefault(tuple(gpu), []).append(r)
    return [(gpu, rs) for gpu, rs in ranks.items() if len(rs) > 1]


def sharing_error(identities: Sequence[Optional[GpuId]], allow: bool) -> Optional[str]:
    """The error every rank raises when ranks share a GPU and ``train.share_gpu`` does not allow it, else
    None. Every rank computes it from the same gathered list, so all agree without another collective."""
    shared = shared_gpus(identities)
    if not shared or allow:
        return None
    where = "; ".join(f"ranks {', '.join(map(str, rs))} on host {host}, GPU {uuid}" for (host, uuid), rs in shared)
    return (f"ranks share a GPU ({where}): NCCL refuses two ranks on one GPU and they would compete for its "
            "memory; start one rank per GPU, or set train.share_gpu=true to allow it (docs/gpu.md)")


def agreed_device(want: str, rank: int, local_rank: int, size: int, share_gpu: bool,
                  allgather: Callable[[Any], List[Any]]) -> Tuple[torch.device, bool]:
    """This rank's device (``select_device``) and whether ranks share a GPU, checked against every rank's:
    the same ConfigError on every rank when a rank has no GPU, or when ranks share one and ``share_gpu``
    (``train.share_gpu``) does not allow it. ``allgather(obj)``: every rank's ``obj`` in rank order, over
    a host path (an NCCL collective among ranks on one GPU fails before any message). A collective on a GPU
    with ``size`` > 1; on the CPU, or alone, nothing is gathered."""
    if not uses_cuda(want) or size == 1:
        return select_device(want, rank, local_rank), False
    where: Optional[torch.device] = None
    try:
        where = select_device(want, rank, local_rank)
        mine: Tuple[Optional[str], Optional[GpuId]] = (None, gpu_identity(where))
    except ConfigError as e:
        mine = (str(e), None)
    gathered = allgather(mine)
    errors = [e for e, _ in gathered if e]
    if errors:
        more = f" (and {len(errors) - 1} more ranks without a GPU)" if len(errors) > 1 else ""
        raise ConfigError(errors[0] + more)
    identities = [gpu for _, gpu in gathered]
    error = sharing_error(identities, share_gpu)
    if error:
        raise ConfigError(error)
    assert where is not None
    return where, bool(shared_gpus(identities))
