"""Checkpoint folders as files: their names, the RNG codec, reading, finding, and agreeing on one. Not a
collective, but for ``agree_on_resume``; imports no Horovod.

The layout of a run folder and the write protocol are checkpoint.py's. Loading runs no code: every file is
read with ``torch.load(weights_only=True)`` (tensors and plain types only; RNG states are stored as tensors
and tuples). Files of format 1 (before this rule) are converted once by ``hvd-partialfc upgrade RUN``
(upgrade.py), the one place that unpickles freely, and only on request.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..engine.base import mark_agreed
from ..engine.device import cuda_in_use

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT = "hvd_partialfc.checkpoint"
FORMAT_VERSION = 2          # 2: weights_only-loadable files (RNG as tensors), meta.json carries the version
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint file or folder that cannot be used; the message names it and says what to do."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def classifier_file(rank: int, world_size: int) -> str:
    return f"classifier-{rank:05d}-of-{world_size:05d}.pt"


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


# --- reading ------------------------------------------------------------------------------------------

def load_file(path: str, what: str = "checkpoint file") -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with errors that name the file and say what to do.

    A file that needs more than tensors and plain types (any pickled object, class or function) is refused
    before anything in it runs.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{path}: refused to load this {what}: it holds more than tensors and plain types "
            f"({first[-1] if first else 'weights_only'}). Files written by hvd_partialfc before checkpoint "
            f"format {FORMAT_VERSION} are converted once by `hvd-partialfc upgrade RUN`; never upgrade a file "
            "you did not write yourself") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read this {what} ({type(e).__name__}: {str(e).strip()[:200]}); "
                              "it is truncated or not a torch file: resume from an earlier checkpoint") from None


def read_meta(ckpt_dir: str, check_version: bool = True) -> Dict[str, Any]:
    path = os.path.join(ckpt_dir, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {ckpt_dir} is not a complete checkpoint") from None
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); resume from an earlier checkpoint") from None
    if check_version:
        version = meta.get("format_version", 1)
        if version < FORMAT_VERSION:
            raise CheckpointError(
                f"{ckpt_dir}: checkpoint format {version}, written by an older hvd_partialfc; convert it once "
                f"with `hvd-partialfc upgrade {ckpt_dir}` (it loads the old files with full unpickling: only "
                "for checkpoints you wrote yourself)")
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{ckpt_dir}: checkpoint format {version} is newer than this hvd_partialfc "
                                  f"reads ({FORMAT_VERSION}); update the package")
    return meta


def meta_digest(ckpt_dir: str) -> str:
    """sha256 of a checkpoint's meta.json bytes: what ranks compare to agree on where they resume."""
    with open(os.path.join(ckpt_dir, "meta.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def parse_step(name: str) -> Optional[int]:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str) -> List[str]:
    """Complete checkpoints (``step-*`` with meta.json) of a run folder, by step."""
    base = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(base):
        return []
    names = [d for d in os.listdir(base)
             if parse_step(d) is not None and os.path.isfile(os.path.join(base, d, "meta.json"))]
    return sorted(names, key=parse_step)


def _read_latest(base: str) -> Optional[str]:
    path = os.path.join(base, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    target = os.path.join(base, name)
    if not name or not os.path.isfile(os.path.join(target, "meta.json")):
        raise CheckpointError(f"{path} names {name!r}, which is not a complete checkpoint (no "
                              f"{os.path.join(target, 'meta.json')}); refusing to guess. Resume explicitly "
                              f"with --resume {base}/step-XXXXXXXX, or remove {path} to start afresh")
    return target


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder from a run folder (its latest), a checkpoints folder, or the folder itself."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    for base in (os.path.join(path, CHECKPOINTS), path):
        target = _read_latest(base)
        if target:
            return target
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such run or checkpoint folder; give the --out of a training run, or "
                              f"one of its {CHECKPOINTS}/step-* folders")
    raise CheckpointError(f"{path}: no complete checkpoint (no meta.json, no {CHECKPOINTS}/{LATEST})")


def find_resume(run_dir: str) -> Optional[str]:
    """``--resume auto``: the run's latest; None when the run has no checkpoint yet.

    A ``latest`` that names no complete checkpoint is an error (never a silent fresh start). Complete
    checkpoints without ``latest`` (a crash between the folder's rename and the move of ``latest``): the
    highest step, which is the newest (newer ones are moved aside at every start).
    """
    base = os.path.join(run_dir, CHECKPOINTS)
    target = _read_latest(base)
    if target:
        return target
    names = list_checkpoints(run_dir)
    return os.path.join(base, names[-1]) if names else None


def folder_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def room_report(base: str) -> str:
    """What a failed checkpoint write says about its disk: the folder, its free space, and how much the
    previous checkpoint (``latest``'s, else the newest complete one) takes, i.e. what the next one needs."""
    from ..tools.estimate import human
    try:
        free = f"{human(shutil.disk_usage(base).free)} free"
    except OSError as e:
        free = f"free space unknown ({e.strerror})"
    try:
        previous = _read_latest(base) or find_resume(os.path.dirname(base))
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
