"""Which engine a training process uses (``train.engine``): ``auto``, ``horovod`` or ``torch``. Not a collective.

``auto`` follows the launcher, read from the environment it sets:

=================  =======================================================================  =========
launcher           variables                                                                 engine
=================  =======================================================================  =========
torch_inprocess    ``HVD_PARTIALFC_GEN_STORE`` (launch/torch_inprocess.py; the group         torch
                   re-forms in the same processes: engine/generation.py)
torchrun           ``TORCHELASTIC_RUN_ID`` (any ``TORCHELASTIC_*``), or ``RANK``,            torch
                   ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` together
horovodrun         ``HOROVOD_RANK`` / ``HOROVOD_SIZE`` (its Gloo mode)                       horovod
mpirun, srun+PMI   ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``PMIX_RANK``                     horovod
none (one process) nothing of the above                                                     horovod if installed, else torch
=================  =======================================================================  =========

An explicit choice that does not fit the launcher (``torch`` under horovodrun/mpirun, ``horovod`` under
torchrun) is a ``ConfigError`` before any work: each engine would start a world of its own and train
alone. Alone, both engines run a world of one. The key is resume-free: checkpoints are the same files.

A Horovod built without NCCL on a CUDA run is also a ``ConfigError`` before any work
(``check_gpu_operations``), unless ``train.allow_host_allreduce`` says to go on.
"""
from __future__ import annotations

import importlib.util
from typing import Mapping

from ..config import ConfigError
from .base import DEFAULT_COLLECTIVE_TIMEOUT_S
from .gen_store import ENV as GEN_STORE_ENV

ENGINES = ("auto", "horovod", "torch")
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
_MPI = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def detect_launcher(env: Mapping[str, str]) -> str:
    """``torch_inprocess``, ``torchrun``, ``horovodrun``, ``mpirun`` or ``alone``, from a process's environment."""
    if env.get(GEN_STORE_ENV):
        return "torch_inprocess"
    if any(k.startswith("TORCHELASTIC_") for k in env) or all(k in env for k in _TORCHRUN):
        return "torchrun"
    if "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
        return "horovodrun"
    if any(k in env for k in _MPI):
        return "mpirun"
    return "alone"


def launcher_rank(env: Mapping[str, str]) -> int:
    """This process's rank as its launcher set it (0 when alone): torchrun's ``RANK``, horovodrun's
    ``HOROVOD_RANK``, MPI's / PMI's. Read before any engine starts, e.g. to report a config error once."""
    for key in ("RANK", "HOROVOD_RANK", *_MPI):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def horovod_installed() -> bool:
    try:
        return importlib.util.find_spec("horovod") is not None
    except ImportError:          # a finder that refuses it (an import hook, a broken install)
        return False


def choose_engine(want: str, env: Mapping[str, str]) -> str:
    """The engine (``horovod`` or ``torch``) for ``train.engine=want`` under the launcher of ``env``."""
    if want not in ENGINES:
        raise ConfigError(f"train.engine must be one of {', '.join(ENGINES)} (got {want!r})")
    launcher = detect_launcher(env)
    fits = {"torchrun": "torch", "torch_inprocess": "torch", "horovodrun": "horovod", "mpirun": "horovod"}.get(launcher)
    if want == "auto":
        want = fits or ("horovod" if horovod_installed() else "torch")
    elif fits and want != fits:
        raise ConfigError(f"train.engine={want} does not fit the launcher ({launcher} starts {fits} "
                          f"ranks): use train.engine={fits} or auto, or launch with "
                          f"{'torchrun' if want == 'torch' else 'horovodrun / mpirun'}")
    if want == "horovod" and not horovod_installed():
        raise ConfigError("train.engine=horovod: Horovod is not installed (pip install .[horovod], or "
                          "scripts/setup/install.sh without --no-horovod); the torch engine needs none (torchrun)")
    return want


def check_gpu_operations(device: str, cuda_available: bool, nccl_version: int, allow_host_allreduce: bool) -> None:
    """ConfigError when a Horovod without GPU operations (``hvd.nccl_built()`` is 0) would serve a CUDA run
    (``device`` as ``train.device``: ``cuda``, or ``auto`` with CUDA available), unless the user allowed it.

    Such a build copies every gradient bucket GPU -> host, reduces it with Gloo/MPI on the CPU, and copies
    it back: several times slower than NCCL, and nothing else would say so. Not a collective: every rank
    has the same build, so every rank stops alike."""
    cuda = device == "cuda" or (device == "auto" and cuda_available)
    if cuda and not nccl_version and not allow_host_allreduce:
        raise ConfigError("train.device is CUDA but this Horovod was built without NCCL (horovodrun --check-build: "
                          "[ ] NCCL), so every gradient would go through the host: rebuild it with NCCL "
                          "(scripts/setup/build_horovod.sh, docs/gpu.md), use train.engine=torch under torchrun, or "
                          "set train.allow_host_allreduce=true")


def start_engine(want: str, env: Mapping[str, str], device: str = "auto", share_gpu: bool = False,
                 allow_host_allreduce: bool = False, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
    """Choose (``choose_engine``) and start the engine; its ``Comm``. A collective across the launched ranks.
    ``device``, ``share_gpu``, ``allow_host_allreduce``, ``collective_timeout_s``: the ``train.*`` keys of those
    names (device.py: the GPU's choice, and ranks sharing one refused unless ``share_gpu``; Horovod without
    NCCL on a CUDA run refused unless ``allow_host_allreduce``; how long a rank waits in one collective)."""
    if choose_engine(want, env) == "torch":
        if env.get(GEN_STORE_ENV):
            from . import generation
            return generation.init(device, share_gpu, timeout_s=collective_timeout_s)
        from . import torchdist
        return torchdist.init(device, share_gpu, timeout_s=collective_timeout_s)
    import torch
    from . import horovod
    check_gpu_operations(device, torch.cuda.is_available(), horovod.nccl_version(), allow_host_allreduce)
    return horovod.init(device, share_gpu)     # no collective timeout in Horovod (horovod.init says why)
