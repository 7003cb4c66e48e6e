"""Checkpoints of a run as training uses them: the RNG codec, what a failed write says about its disk, and
agreeing on one checkpoint to resume from (a collective). Imports no Horovod.

Names, the safe loader and finding a checkpoint are hvd_partialfc/run_files.py's (every layer reads them);
the layout of a run folder and the write protocol are checkpoint.py's.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Any, Dict, Optional

import numpy as np
import torch

from ...engine.base import mark_agreed
from ...engine.device import cuda_in_use
from ...run_files import CheckpointError, find_resume, folder_bytes, meta_digest, read_latest, read_meta
from ...sizes import human


# --- RNG states as tensors and plain types (weights_only-loadable) ---------------------------------------

def rng_state() -> Dict[str, Any]:
    """torch, CUDA, numpy and Python generator states, as tensors, ints, floats and tuples. CUDA's: this
    rank's current device only, and only when this process uses CUDA (``get_rng_state_all`` would start a
    CUDA context on every visible GPU, and tie the file to how many this node shows)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "python": random.getstate()}
    if cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore ``rng_state()``'s generators; CUDA's onto the current device (when this process uses CUDA)."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(_as_tuples(state["python"]))
    cuda = state.get("cuda")
    if cuda is not None and cuda_in_use():
        device = torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):
            # Checkpoints written before 2026-12 hold every visible device's state (get_rng_state_all),
            # and their rank trained on cuda:local_rank: the current device's entry is that one when the
            # node shows the same GPUs. Otherwise (one GPU per process now, or fewer GPUs) the current
            # device's entry or else the first: the run goes on, but its CUDA stream may differ from the
            # uninterrupted run's.
            cuda = cuda[device] if device < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, device)


def _as_tuples(x: Any) -> Any:
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def room_report(base: str) -> str:
    """What a failed checkpoint write says about its disk: the folder, its free space, and how much the
    previous checkpoint (``latest``'s, else the newest complete one) takes, i.e. what the next one needs."""
    try:
        free = f"{human(shutil.disk_usage(base).free)} free"
    except OSError as e:
        free = f"free space unknown ({e.strerror})"
    try:
        previous = read_latest(base) or find_resume(os.path.dirname(base))
    except CheckpointError:
        previous = None
    size = (f"the previous checkpoint {os.path.basename(previous)} takes {human(folder_bytes(previous))}"
            if previous else "no previous checkpoint")
    return f"{base}: {free}; {size}"


def agree_on_resume(comm, path: Optional[str]) -> Optional[str]:
    """Every rank's chosen checkpoint (path, step, meta.json digest) must be the same; a collective.

    Ranks that resolve different checkpoints (node-local run folders, a stale network file system) would
    train different step counts and hang at the end; here they all stop, naming each rank's choice.
    """
    try:
        mine = (path, read_meta(path, check_version=False)["step"], meta_digest(path)) if path else (None, 0, None)
    except (CheckpointError, OSError, KeyError) as e:  # said below, on every rank: no rank waits alone
        mine = (path, -1, f"unreadable: {e}")
    everyone = comm.allgather_object(mine, name="resume.choice")
    if len({(step, digest) for _, step, digest in everyone}) > 1 or any(s < 0 for _, s, _ in everyone):
        lines = "; ".join(f"rank {r}: {p or 'no checkpoint'} (step {s}, meta {(d or '-')[:12]})"
                          for r, (p, s, d) in enumerate(everyone))
        raise mark_agreed(CheckpointError(   # every rank sees the same gathered choices
            "ranks resolved different checkpoints to resume from: " + lines
            + ". The run folder must be one shared file system for all ranks"))
    return path
