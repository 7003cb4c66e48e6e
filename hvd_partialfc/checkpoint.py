"""Checkpoints: save and load in one place, atomic writes, keep-last-k, resume, re-sharding, upgrade.

Layout of a run folder::

    RUN/config.yaml, RUN/metrics.jsonl
    RUN/checkpoints/step-00000020/
        backbone.pt                       backbone state (after buffer averaging) + its optimizer state
        classifier-00000-of-00002.pt      rank 0's rows [start, end), their optimizer state, its RNG and
        classifier-00001-of-00002.pt      loss scale, its backbone digest
        meta.json                         format version, step, world size, label slices, every rank's
                                          digest, config, the shard manifest's sha256
    RUN/checkpoints/latest                name of the newest complete checkpoint (moved last)
    RUN/checkpoints/superseded-<time>/    checkpoints newer than the one a run restarted from, moved aside
    RUN/checkpoints/diverged-step-<N>/    a checkpoint whose ranks' backbones differed, kept for inspection

Atomicity: ranks write into ``step-XXXXXXXX.partial/`` (each file through ``atomic.py``), agree that all
succeeded and that the backbones are identical, then rank 0 writes ``meta.json``, renames the folder and
moves ``latest``. A crash at any point leaves the previous checkpoint and ``latest`` untouched. The run
folder must be on a file system all ranks share (as with any multi-node checkpoint); ranks that resolve
different checkpoints stop before training (`agree_on_resume`).

Order: when a run starts, every checkpoint of its folder with a higher step than the one it starts from is
moved aside (``superseded-<time>``, said on rank 0), so inside ``checkpoints/`` step order is write order
and keep-last-k never deletes the checkpoint a run restarted from; ``latest``'s target is never pruned.

Loading runs no code: every file is read with ``torch.load(weights_only=True)`` (tensors and plain
types only; RNG states are stored as tensors and tuples). Files of format 1 (before this rule) are
converted once by ``hvd-partialfc upgrade RUN``, the one place that unpickles freely, and only on
request. This module does not import Horovod: the collectives go through the ``comm`` it is given.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn

from . import atomic, faults

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
    """torch, CUDA, numpy and Python generator states, as tensors, ints, floats and tuples."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        raise CheckpointError("ranks resolved different checkpoints to resume from: " + lines
                              + ". The run folder must be one shared file system for all ranks")
    return path


# --- what a checkpoint holds --------------------------------------------------------------------------

@dataclass
class TrainingState:
    """The explicit inputs of save / load: what a rank trains, and the plain counters that go with it.

    ``counters`` holds plain values (loss scale, skipped steps, ...) saved in every rank's file and in
    meta.json, and restored into the same dict.
    """
    backbone: nn.Module
    backbone_opt: Any
    head: nn.Module                   # .weight (W, D) and extra_state_for_checkpoint / load_extra_state
    head_opt: Any
    label_slice: Tuple[int, int]      # this rank's [start, end)
    slices: List[Tuple[int, int]]     # every rank's
    rank: int
    world_size: int
    model_args: Dict[str, Any]
    replicated: bool = False          # every rank's head holds all C rows; its optimizer state is the backbone's
    counters: Dict[str, Any] = field(default_factory=dict)

    def backbone_file(self) -> Dict[str, Any]:
        return {"format": "hvd_partialfc.backbone", "model": self.model_args,
                "state_dict": {k: v.detach().cpu() for k, v in self.backbone.state_dict().items()},
                "optimizer": self.backbone_opt.state_dict()}

    def rank_file(self, digest: str) -> Dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size,
                "label_start": self.label_slice[0], "label_end": self.label_slice[1],
                "weight": self.head.weight.detach().cpu(), "optimizer": self.head_opt.state_dict(),
                "rng": rng_state(), "counters": dict(self.counters), "backbone_digest": digest,
                "head_state": self.head.extra_state_for_checkpoint()}


class Checkpointer:
    """Owns the checkpoint interval, keep-last-k, the folder's order and the atomic write protocol.

    ``run_info``: what meta.json records about the run besides the state (num_classes, shard_slices,
    manifest_sha256, data_sha256, config, embedding_dim). The collectives (buffer averaging, digests,
    agreement) go through ``comm``.
    """

    def __init__(self, run_dir: str, every: int, keep: int, comm, run_info: Dict[str, Any]):
        self.run_dir, self.every, self.keep, self.comm = run_dir, every, max(1, keep), comm
        self.base = os.path.join(run_dir, CHECKPOINTS)
        self.run_info = run_info

    def due(self, step: int, final: bool) -> bool:
        return final or (self.every > 0 and step % self.every == 0)

    def prepare(self, start_step: int, log=print) -> List[str]:
        """Before the first step (a collective): rank 0 moves every checkpoint of this run folder with a
        higher step than ``start_step`` into ``superseded-<time>/`` (``latest`` too, if it named one), and
        removes unfinished ``.partial`` folders. Returns what was moved."""
        moved, error = [], None
        if self.comm.is_main and os.path.isdir(self.base):
            try:
                moved = self._set_aside(start_step)
            except OSError as e:
                error = f"cannot tidy {self.base}: {e}"
            if moved:
                log(f"checkpoints: {', '.join(moved)} are newer than step {start_step}, where this run "
                    f"starts; moved to {os.path.join(self.base, self._aside)} (nothing deleted)")
        self.comm.agree(error, name="ckpt.prepare")
        return moved

    def _set_aside(self, start_step: int) -> List[str]:
        for d in sorted(os.listdir(self.base)):
            if d.endswith(".partial") and parse_step(d[:-len(".partial")]) is not None:
                shutil.rmtree(os.path.join(self.base, d), ignore_errors=True)
            if d.endswith(".old") and parse_step(d[:-len(".old")]) is not None:   # a crash in commit_folder
                atomic.recover_folder(os.path.join(self.base, d[:-len(".old")]))
        entries = sorted(os.listdir(self.base))
        newer = [d for d in entries if parse_step(d) is not None and parse_step(d) > start_step]
        if not newer:
            return []
        stamp = "superseded-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self._aside, n = stamp, 1
        while os.path.exists(os.path.join(self.base, self._aside)):  # two starts within one second
            self._aside, n = f"{stamp}-{n}", n + 1
        aside = os.path.join(self.base, self._aside)
        os.makedirs(aside)
        latest = os.path.join(self.base, LATEST)
        pointed = open(latest).read().strip() if os.path.isfile(latest) else None
        for d in newer:
            os.rename(os.path.join(self.base, d), os.path.join(aside, d))
        if pointed in newer:
            os.replace(latest, os.path.join(aside, LATEST))
            keep = list_checkpoints(self.run_dir)
            if keep:  # the newest one left is where this run restarted from
                atomic.write_text(latest, keep[-1] + "\n")
        atomic.fsync_dir(self.base)
        return newer

    def save(self, step: int, state: TrainingState, total_steps: int) -> str:
        """Write the checkpoint of ``step`` (a collective). Backbones that differ across ranks are written
        to ``diverged-step-<N>/`` for inspection, ``latest`` and the other checkpoints stay untouched, and
        every rank raises."""
        comm = self.comm
        # BatchNorm statistics differ per rank: average them so the saved backbone is every rank's.
        comm.average_buffers(state.backbone, name=f"ckpt.{step}")
        digests = comm.backbone_digests(state.backbone, name=f"ckpt.{step}")
        identical = len(set(digests)) == 1
        final_dir = os.path.join(self.base, step_dir_name(step))
        partial = final_dir + ".partial"
        error = None
        try:
            os.makedirs(partial, exist_ok=True)
            atomic.torch_save(state.rank_file(digests[comm.rank]),
                              os.path.join(partial, classifier_file(comm.rank, comm.size)))
            if comm.is_main:
                atomic.torch_save(state.backbone_file(), os.path.join(partial, "backbone.pt"))
            if not identical:  # every rank's own copy, for inspection
                atomic.torch_save(state.backbone_file(), os.path.join(partial, f"backbone-rank-{comm.rank:05d}.pt"))
        except OSError as e:
            error = f"checkpoint write failed: {e}"
        comm.agree(error, name=f"ckpt.write.{step}")
        faults.pause("pause-in-ckpt", step, comm.rank)
        if comm.is_main:
            meta = self._meta(step, state, total_steps, digests, identical)
            atomic.write_text(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1))
            atomic.fsync_dir(partial)
            if identical:
                self._commit(partial, final_dir, step)
            else:
                aside = os.path.join(self.base, f"diverged-{step_dir_name(step)}")
                if os.path.exists(aside):
                    shutil.rmtree(aside)
                os.rename(partial, aside)
        comm.agree(None, name=f"ckpt.done.{step}")
        faults.pause("pause-after-ckpt", step, comm.rank)
        if not identical:
            raise CheckpointError(
                f"backbones differ across ranks at step {step}: "
                + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
                + f"; each rank's copy is in {os.path.join(self.base, 'diverged-' + step_dir_name(step))}; "
                f"{LATEST} and the earlier checkpoints are untouched")
        return final_dir

    def _meta(self, step: int, state: TrainingState, total_steps: int, digests: List[str],
              identical: bool) -> Dict[str, Any]:
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "total_steps": total_steps,
                "world_size": state.world_size, "slices": [list(s) for s in state.slices],
                "classifier_files": [classifier_file(r, state.world_size) for r in range(state.world_size)],
                "model": state.model_args, "replicated": state.replicated}
        meta.update(self.run_info)
        meta.update(state.counters)
        meta.update({"digests": digests, "identical": identical, "time": time.time()})
        return meta

    def _commit(self, partial: str, final_dir: str, step: int) -> None:
        """Rank 0: the folder takes its final name (``atomic.commit_folder``: the same step written again
        replaces the old folder only once the new one is in place), then ``latest`` moves to it, then old
        ones go."""
        atomic.commit_folder(partial, final_dir)
        atomic.write_text(os.path.join(self.base, LATEST), step_dir_name(step) + "\n")
        self._prune(keep_name=step_dir_name(step))

    def _prune(self, keep_name: str) -> None:
        """Keep the newest ``keep`` (step order is write order inside ``checkpoints/``, see ``prepare``);
        the one ``latest`` names is never removed."""
        names = list_checkpoints(self.run_dir)
        for old in names[:-self.keep]:
            if old != keep_name:
                shutil.rmtree(os.path.join(self.base, old), ignore_errors=True)


def load(path: str, state: TrainingState) -> Dict[str, Any]:
    """Restore the backbone, this rank's classifier rows, the optimizer states, RNG and counters from the
    checkpoint folder ``path``; returns its meta.json. Not a collective.

    Same world size: each rank reads its own file (bitwise resume). Another world size (re-sharding, when
    the shard count allows it): each rank cuts its new slice's rows and their optimizer state out of the
    old files; RNG streams cannot be mapped and are re-seeded by the caller (``rng`` is then None).
    """
    meta = read_meta(path)
    if len(set(meta["digests"])) != 1:
        raise CheckpointError(f"{path}: the checkpoint's backbones differ across ranks; there is no single "
                              "state to resume")
    bb = load_file(os.path.join(path, "backbone.pt"), "backbone checkpoint")
    state.backbone.load_state_dict(bb["state_dict"])
    state.backbone_opt.load_state_dict(bb["optimizer"])
    start, end = state.label_slice
    same_size = meta["world_size"] == state.world_size
    if same_size:
        name = os.path.join(path, classifier_file(state.rank, state.world_size))
        mine = load_file(name, "classifier checkpoint")
        if (mine["label_start"], mine["label_end"]) != (start, end):
            raise CheckpointError(f"{name} covers [{mine['label_start']}, {mine['label_end']}), this rank "
                                  f"(rank {state.rank}) owns [{start}, {end})")
    elif state.replicated:
        # every rank's file holds the same full C x D matrix (its momentum lives in backbone.pt)
        mine = load_file(os.path.join(path, meta["classifier_files"][0]), "classifier checkpoint")
        mine["rng"] = None
    else:
        mine = gather_classifier_rows(path, meta, start, end)
        mine["rng"] = None
    with torch.no_grad():
        state.head.weight.copy_(mine["weight"])
    state.head_opt.load_state_dict(mine["optimizer"])
    if same_size:  # other ranks' centres mean nothing at another world size
        state.head.load_extra_state(mine.get("head_state") or {})
    if mine.get("rng") is not None:
        set_rng_state(mine["rng"])
    for k in state.counters:
        if k in (mine.get("counters") or {}):
            state.counters[k] = mine["counters"][k]
        elif k in meta:
            state.counters[k] = meta[k]
    meta["rng_restored"] = mine.get("rng") is not None
    return meta


# --- re-sharding: classifier rows to another world size -------------------------------------------------

def _row_sliced(value: Any, width: int, dim: int) -> bool:
    """Per-row optimizer state: shaped like the weight (W, D) (momentum, moments), or a (W,) vector (the
    sampled-rows AdamW's per-row step count, rowsparse.py)."""
    return torch.is_tensor(value) and tuple(value.shape) in ((width, dim), (width,))


def gather_classifier_rows(ckpt_dir: str, meta: Dict[str, Any], start: int, end: int) -> Dict[str, Any]:
    """Classifier rows ``[start, end)`` and their optimizer state, cut from the old ranks' files.

    Rows of the new slice may come from several old files (fewer ranks) or from part of one (more
    ranks). Per-row optimizer state (SGD momentum, Adam moments: tensors shaped like the weight; the
    sampled-rows AdamW's (W,) per-row step) is cut the same way; per-parameter scalars (Adam's step) are
    equal on all old ranks and taken from the first.
    """
    weights, states, scalars, groups = [], [], {}, None
    for (old_start, old_end), name in zip(meta["slices"], meta["classifier_files"]):
        lo, hi = max(start, old_start), min(end, old_end)
        if lo >= hi:
            continue
        path = os.path.join(ckpt_dir, name)
        f = load_file(path, "classifier checkpoint")
        if (f["label_start"], f["label_end"]) != (old_start, old_end):
            raise CheckpointError(f"{path} covers [{f['label_start']}, {f['label_end']}), meta.json says "
                                  f"[{old_start}, {old_end})")
        w = f["weight"]
        weights.append(w[lo - old_start:hi - old_start])
        opt = f["optimizer"]
        groups = groups or opt.get("param_groups")
        st = opt.get("state", {}).get(0, {})
        states.append({k: v[lo - old_start:hi - old_start] for k, v in st.items() if _row_sliced(v, *w.shape)})
        for k, v in st.items():
            if not _row_sliced(v, *w.shape):
                scalars.setdefault(k, v)
    if not weights or sum(w.shape[0] for w in weights) != end - start:
        raise CheckpointError(f"{ckpt_dir}: the classifier files do not cover labels [{start}, {end})")
    state = {}
    if states and states[0]:
        state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    state.update(scalars)
    return {"weight": torch.cat(weights),
            "optimizer": {"state": {0: state} if state else {}, "param_groups": groups or []}}


def reshard_checkpoint(src: str, out: str, world_size: int) -> str:
    """Write a copy of checkpoint ``src`` for ``world_size`` ranks (``hvd-partialfc reshard``).

    The backbone is copied; classifier rows and their optimizer state are redistributed to the label
    slices that the shard set gives ``world_size`` ranks (from the shard ranges recorded in meta.json);
    in ``replicated`` mode every rank's file holds the full classifier (its optimizer state is the
    backbone's), so each new rank gets a copy. RNG states do not carry over (each new rank is seeded from
    the run's seed, its rank and the step).
    """
    from .layout import RankLayout
    from .modes import get_mode
    from .partition import LabelSlice
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    shard_slices = [LabelSlice(i, a, b) for i, (a, b) in enumerate(meta["shard_slices"])]
    slices = RankLayout.from_shards(shard_slices, world_size).slices
    replicated = meta.get("replicated") or get_mode(meta.get("config", {}).get("head", {}).get("mode", "local")).replicated_rows
    if os.path.exists(out):
        raise FileExistsError(f"{out} already exists")
    tmp = out.rstrip("/") + ".partial"
    os.makedirs(tmp, exist_ok=True)
    shutil.copyfile(os.path.join(src, "backbone.pt"), os.path.join(tmp, "backbone.pt"))
    digest = meta["digests"][0]
    full = load_file(os.path.join(src, meta["classifier_files"][0]), "classifier checkpoint") if replicated else None
    for s in slices:
        if replicated:
            rows = {"weight": full["weight"], "optimizer": full["optimizer"]}
        else:
            rows = gather_classifier_rows(src, meta, s.start, s.end)
        rows.update({"rank": s.index, "world_size": world_size, "label_start": s.start, "label_end": s.end,
                     "rng": None, "resharded_from": meta["world_size"], "backbone_digest": digest,
                     "counters": {}})
        atomic.torch_save(rows, os.path.join(tmp, classifier_file(s.index, world_size)))
    new = dict(meta)
    new.update({"world_size": world_size, "slices": [[s.start, s.end] for s in slices],
                "classifier_files": [classifier_file(r, world_size) for r in range(world_size)],
                "digests": [digest] * world_size, "resharded_from": meta["world_size"]})
    atomic.write_text(os.path.join(tmp, "meta.json"), json.dumps(new, indent=1))
    atomic.commit_folder(tmp, out)
    return out


# --- upgrade: format 1 -> 2, on request only -----------------------------------------------------------

def _upgrade_rng(rng: Any) -> Any:
    if rng is None or not isinstance(rng.get("numpy"), tuple):
        return rng
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    out = dict(rng)
    out["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    return out


def upgrade_checkpoint(ckpt_dir: str) -> bool:
    """Rewrite one format-1 checkpoint folder as format 2 (files loadable with weights_only=True).

    This is the one place that unpickles freely: run it only on checkpoints you wrote. Each file is
    rewritten atomically, meta.json last, so an interrupted upgrade can simply be run again. Returns
    False when the folder is already format 2.
    """
    meta = read_meta(ckpt_dir, check_version=False)
    if meta.get("format_version", 1) >= FORMAT_VERSION:
        return False
    for name in ["backbone.pt"] + list(meta["classifier_files"]):
        path = os.path.join(ckpt_dir, name)
        obj = torch.load(path, map_location="cpu", weights_only=False)  # trusted by the user's request
        if "rng" in obj:
            obj["rng"] = _upgrade_rng(obj["rng"])
        if "counters" not in obj and name != "backbone.pt":
            obj["counters"] = {k: obj.pop(k) for k in ("loss_scale", "skipped_steps") if k in obj}
        atomic.torch_save(obj, path)
        load_file(path)  # proves the new file is weights_only-loadable
    meta["format_version"] = FORMAT_VERSION
    atomic.write_text(os.path.join(ckpt_dir, "meta.json"), json.dumps(meta, indent=1))
    return True


def upgrade_run(path: str) -> List[str]:
    """Upgrade a checkpoint folder, or every complete checkpoint of a run folder; returns those rewritten."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        folders = [path]
    else:
        base = os.path.join(path, CHECKPOINTS)
        folders = [os.path.join(base, d) for d in list_checkpoints(path)]
        if not folders:
            raise CheckpointError(f"{path}: no checkpoint folder (meta.json) and no {CHECKPOINTS}/step-*")
    return [d for d in folders if upgrade_checkpoint(d)]
