"""A run folder's files as they lie on disk: their names, the one safe loader, and finding a checkpoint.

Shared by every layer (the backbone loaders of models/, the evaluation of verification/, training's run/,
the tools): plain files and ``torch.load`` only, no collective, no engine. Loading runs no code: every file
is read with ``torch.load(weights_only=True)`` (tensors and plain types only). Files of format 1 (before
this rule) are converted once by ``hvd-partialfc upgrade RUN`` (run/ckpt/upgrade.py), the one place that
unpickles freely, and only on request. The layout of a run folder and the write protocol are
run/ckpt/checkpoint.py's.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from typing import Any, Dict, List, Optional

import torch

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


# --- reading ------------------------------------------------------------------------------------------

def load_file(path: str, what: str = "checkpoint file", fix: str = "") -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with errors that name the file and say what to do.

    A file that needs more than tensors and plain types (any pickled object, class or function) is refused
    before anything in it runs. ``fix``: the next step for a file that cannot be read, where "resume from an
    earlier checkpoint" (and, for pickled objects, ``hvd-partialfc upgrade``) is not: a file that no run of
    this package wrote (arcface_torch's rank files).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{path}: refused to load this {what}: it holds more than tensors and plain types "
            f"({first[-1] if first else 'weights_only'})" + (f": {fix}" if fix else (
                f". Files written by hvd_partialfc before checkpoint format {FORMAT_VERSION} are converted once by "
                "`hvd-partialfc upgrade RUN`; never upgrade a file you did not write yourself"))) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read this {what} ({type(e).__name__}: {str(e).strip()[:200]}); "
                              f"it is truncated or not a torch file: {fix or 'resume from an earlier checkpoint'}"
                              ) from None


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


def read_latest(base: str) -> Optional[str]:
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
        target = read_latest(base)
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
    target = read_latest(base)
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


