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

Names, reading and finding live in ../run_files.py, the RNG codec in checkpoint_files.py, re-sharding in
reshard.py, the format upgrade in upgrade.py. This module does not import Horovod: the collectives go through the ``comm`` it is given.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from ... import atomic
from ...engine.base import RankFailure, mark_agreed
from ..watch import faults
from ...run_files import (CHECKPOINTS, FORMAT, FORMAT_VERSION, LATEST, CheckpointError, classifier_file,
                         list_checkpoints, load_file, parse_step, read_meta, step_dir_name)
from .checkpoint_files import rng_state, room_report, set_rng_state
from ...engine.vote import Slot
from .reshard import gather_classifier_rows

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

    def rank_file(self, digest: str, buffers: Dict[str, torch.Tensor] = None) -> Dict[str, Any]:
        """This rank's file. ``buffers``: the backbone buffers this rank trains on (default: the module's);
        restored by a resume at the same world size (``load``)."""
        own = buffers if buffers is not None else dict(self.backbone.named_buffers())
        return {"rank": self.rank, "world_size": self.world_size,
                "buffers": {k: v.detach().cpu() for k, v in own.items()},
                "label_start": self.label_slice[0], "label_end": self.label_slice[1],
                "weight": self.head.weight.detach().cpu(), "optimizer": self.head_opt.state_dict(),
                "rng": rng_state(), "counters": dict(self.counters), "backbone_digest": digest,
                "head_state": self.head.extra_state_for_checkpoint()}


def not_written(step: int, detail: str) -> CheckpointError:
    """A checkpoint every rank failed to write (the same error on every rank: ``_agree_written``). ``detail``
    (an attribute): each failing rank's error, the folder, its free space and the previous checkpoint's size.
    ``latest`` and the earlier checkpoints are untouched, so a scheduled checkpoint's failure need not end the
    run: the loop says it and goes on (trainer.py); a checkpoint the run cannot do without (the last step's, a
    stop's) raises it, with what to do. A CheckpointError (not a subclass): users read that name."""
    e = CheckpointError(f"checkpoint of step {step} not written: {detail}. The previous checkpoint and {LATEST} "
                        "are untouched: make room (or move the run folder) and resume with --resume auto")
    e.detail = detail
    return e


class Checkpointer:
    """Owns when a checkpoint is due (every ``every`` steps, the last step, and every ``every_minutes`` of rank
    0's clock), keep-last-k, the folder's order and the atomic write protocol.

    The clock rides in the loop's per-step vote (engine/vote.py: the slot ``time_due``, rank 0's), so every
    rank writes the time-based checkpoint at the same step; the clock restarts at every checkpoint written.
    ``run_info``: what meta.json records about the run besides the state (num_classes, shard_slices,
    manifest_sha256, data_sha256, config, embedding_dim). The collectives (buffer averaging, digests,
    agreement) go through ``comm``.
    """

    slots = (Slot("time_due"),)

    def __init__(self, run_dir: str, every: int, keep: int, comm, run_info: Dict[str, Any],
                 every_minutes: float = 0.0):
        self.run_dir, self.every, self.keep, self.comm = run_dir, every, max(1, keep), comm
        self.base = os.path.join(run_dir, CHECKPOINTS)
        self.run_info = run_info
        self.every_s = 60.0 * every_minutes
        self.last_save, self.time_due = time.monotonic(), False

    def scheduled(self, step: int, final: bool) -> bool:
        """A checkpoint every ``every`` steps and at the last one (the buffers are averaged for it)."""
        return final or (self.every > 0 and step % self.every == 0)

    def cast(self, ballot, done: int) -> None:
        """Rank 0's clock: ``every_minutes`` since the last checkpoint."""
        ballot.put("time_due", self.comm.is_main and self.every_s > 0
                   and time.monotonic() - self.last_save >= self.every_s)

    def heard(self, agreed, done: int) -> None:
        self.time_due = agreed.flag("time_due")

    def due(self, step: int, final: bool) -> bool:
        """Scheduled, or due by rank 0's clock (an unscheduled checkpoint: trainer.py)."""
        return self.scheduled(step, final) or self.time_due

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

    def save(self, step: int, state: TrainingState, length, own_buffers=None) -> str:
        """Average the BatchNorm statistics (they differ per rank: the saved backbone must be every rank's),
        then `write` (a collective); ``own_buffers``: the rank's buffers before that, kept in its file."""
        self.comm.average_buffers(state.backbone, name=f"ckpt.{step}")
        return self.write(step, state, length, own_buffers)

    def write(self, step: int, state: TrainingState, length, own_buffers=None) -> str:
        """Write the checkpoint of ``step`` (a collective), the buffers averaged already (the trainer averages
        them once a step for its checkpoint and its evaluation: averaging again is not the identity at a
        world size that is not a power of two, so the run would go on with other buffers than it saved).
        Backbones that differ across ranks are written to ``diverged-step-<N>/`` for inspection, ``latest``
        and the other checkpoints stay untouched, and every rank raises."""
        comm = self.comm
        digests = comm.backbone_digests(state.backbone, name=f"ckpt.{step}")
        identical = len(set(digests)) == 1
        final_dir = os.path.join(self.base, step_dir_name(step))
        partial = final_dir + ".partial"
        error = None
        try:
            os.makedirs(partial, exist_ok=True)
            atomic.torch_save(state.rank_file(digests[comm.rank], own_buffers),
                              os.path.join(partial, classifier_file(comm.rank, comm.size)))
            if comm.is_main:
                atomic.torch_save(state.backbone_file(), os.path.join(partial, "backbone.pt"))
            if not identical:  # every rank's own copy, for inspection
                atomic.torch_save(state.backbone_file(), os.path.join(partial, f"backbone-rank-{comm.rank:05d}.pt"))
        except Exception as e:  # noqa: BLE001 (said on every rank by the agreement below)
            error = _write_error(e)
        self._agree_written(error, partial, step, "write")
        faults.pause("pause-in-ckpt", step, comm.rank)
        if comm.is_main:
            try:
                meta = self.meta(step, state, length, digests, identical)
                atomic.write_text(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1))
                atomic.fsync_dir(partial)
                if identical:
                    self._commit(partial, final_dir, step)
                else:
                    aside = os.path.join(self.base, f"diverged-{step_dir_name(step)}")
                    if os.path.exists(aside):
                        shutil.rmtree(aside)
                    os.rename(partial, aside)
            except Exception as e:  # noqa: BLE001
                error = _write_error(e)
        self._agree_written(error, partial, step, "done")
        faults.pause("pause-after-ckpt", step, comm.rank)
        self.last_save, self.time_due = time.monotonic(), False
        if not identical:
            raise mark_agreed(CheckpointError(
                f"backbones differ across ranks at step {step}: "
                + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
                + f"; each rank's copy is in {os.path.join(self.base, 'diverged-' + step_dir_name(step))}; "
                f"{LATEST} and the earlier checkpoints are untouched"))
        return final_dir

    def _agree_written(self, error, partial: str, step: int, stage: str) -> None:
        """Every rank learns whether every write of this stage succeeded (a collective). On a failure rank 0
        removes the ``.partial`` folder (its files would keep a full disk full), and then every rank raises
        the same CheckpointError: each failing rank's error, the folder, its free space and the previous
        checkpoint's size (``room_report``). ``latest`` and the earlier checkpoints are untouched, as a
        commit happens only after both stages agreed; a ``latest`` that could not be moved still names the
        previous one (the new folder, then newer than it, is set aside at the next start)."""
        try:
            self.comm.agree(error, name=f"ckpt.{stage}.{step}")
        except RankFailure as failure:
            if self.comm.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            self.comm.agree(None, name=f"ckpt.{stage}.{step}.removed")  # every rank measures after that
            # the clock starts again: a time-based retry waits its interval (not every step on a full disk)
            self.last_save, self.time_due = time.monotonic(), False
            raise mark_agreed(not_written(step, f"{failure}\n{room_report(self.base)}")) from None

    def meta(self, step: int, state: TrainingState, length, digests: List[str],
             identical: bool) -> Dict[str, Any]:
        """meta.json of ``step`` (a memory snapshot's too); ``length``: the run's ``progress.RunLength``."""
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "total_steps": length.total_steps,
                "length": length.record(step),
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


def restore_buffers(backbone: nn.Module, saved) -> None:
    """This rank's own buffers from its file (``load``'s ``own_buffers``: a resume at the same world size),
    over backbone.pt's averaged ones: they differ after an unscheduled checkpoint (trainer.save_checkpoint).
    Files written before they were kept have none: the averaged ones stay. Called after start-up's backbone
    broadcast and identity check, which compare every rank's copy of the same file."""
    if not saved:
        return
    with torch.no_grad():
        for k, b in backbone.named_buffers():
            if k in saved:
                b.copy_(saved[k])


def _write_error(e: BaseException) -> str:
    """One rank's failed checkpoint write, as said to every rank. Not only OSError: on a full disk
    ``torch.save`` raises RuntimeError (``[enforce fail at inline_container.cc:672] . unexpected pos 704 vs
    598``, torch 2.13, measured on a full tmpfs), ``open``/``fsync``/``os.replace`` and h5py raise OSError
    (errno 28); whatever it is, it must reach the agreement, or the other ranks wait in it."""
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def load(path: str, state: TrainingState) -> Dict[str, Any]:
    """Restore the backbone, this rank's classifier rows, the optimizer states, RNG and counters from the
    checkpoint folder ``path``; returns its meta.json. Not a collective.

    Same world size: each rank reads its own file (bitwise resume). Another world size (re-sharding, any
    N up to the shard count, blocks of unequal size included): each rank cuts its new slice's rows and their
    optimizer state out of the old files, wherever the old and new boundaries fall; RNG streams cannot be
    mapped and are re-seeded by the caller (``rng`` is then None).
    """
    meta = read_meta(path)
    if len(set(meta["digests"])) != 1:
        raise CheckpointError(f"{path}: the checkpoint's backbones differ across ranks; there is no single "
                              "state to resume")
    bb = load_file(os.path.join(path, "backbone.pt"), "backbone checkpoint")
    state.backbone.load_state_dict(bb["state_dict"])
    state.backbone_opt.load_state_dict(bb["optimizer"])
    start, end = state.label_slice
    # the same slices, not only the same size: at a world size that does not divide the shard count, a
    # shard set with other sample counts (checkpoint.allow_other_data) balances other blocks
    same_size = meta["world_size"] == state.world_size and \
        [list(s) for s in meta["slices"]] == [list(s) for s in state.slices]
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
    # this rank's own buffers (same world size), for restore_buffers once the start-up broadcast is done
    meta["own_buffers"] = mine.get("buffers") if same_size else None
    return meta
