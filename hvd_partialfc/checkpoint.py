"""Checkpoints: the backbone once, one classifier file per rank, atomic writes, keep-last-k, resume.

Layout of a run folder::

    RUN/config.yaml, RUN/metrics.jsonl
    RUN/checkpoints/step-00000020/
        backbone.pt                       backbone state (after buffer averaging) + its optimizer state
        classifier-00000-of-00002.pt      rank 0's rows [start, end), their optimizer state, its RNG and
        classifier-00001-of-00002.pt      loader position, its backbone digest
        meta.json                         step, world size, label slices, every rank's digest, config,
                                          the shard manifest's sha256
    RUN/checkpoints/latest                name of the newest complete checkpoint (moved last)

Atomicity: ranks write into ``step-XXXXXXXX.partial/`` (each file: temporary name, fsync, rename), agree
that all succeeded, then rank 0 writes ``meta.json``, renames the folder and moves ``latest``. A crash at
any point leaves the previous checkpoint and ``latest`` untouched. The run folder must be on a file system
all ranks share (as with any multi-node checkpoint).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from . import faults

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def classifier_file(rank: int, world_size: int) -> str:
    return f"classifier-{rank:05d}-of-{world_size:05d}.pt"


def atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_dict_digest(state_dict: Dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict (names, dtypes, shapes, bytes) in sorted-name order.

    The identity check of the backbones across ranks (DESIGN §1.7) compares these digests; a saved
    backbone file can be checked against them without Horovod.
    """
    h = hashlib.sha256()
    for k, v in sorted(state_dict.items()):
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(module: torch.nn.Module) -> str:
    return state_dict_digest(module.state_dict())


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder from a run folder (its latest), a checkpoints folder, or the folder itself."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    for base in (os.path.join(path, CHECKPOINTS), path):
        latest = os.path.join(base, LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                d = os.path.join(base, f.read().strip())
            if os.path.isfile(os.path.join(d, "meta.json")):
                return d
    raise FileNotFoundError(f"{path}: no complete checkpoint (no meta.json, no {CHECKPOINTS}/{LATEST})")


def read_meta(ckpt_dir: str) -> Dict[str, Any]:
    with open(os.path.join(ckpt_dir, "meta.json")) as f:
        return json.load(f)


def list_checkpoints(run_dir: str) -> List[str]:
    base = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(base):
        return []
    return sorted(d for d in os.listdir(base)
                  if d.startswith("step-") and not d.endswith(".partial")
                  and os.path.isfile(os.path.join(base, d, "meta.json")))


class Checkpointer:
    """Owns the checkpoint interval, keep-last-k and the atomic write protocol.

    ``maybe_save(step, trainer)`` decides by itself whether ``step`` is a checkpoint step. The trainer
    supplies the states; the collectives (buffer averaging, digests, agreement) go through its Comm.
    """

    def __init__(self, run_dir: str, every: int, keep: int, comm):
        self.run_dir, self.every, self.keep, self.comm = run_dir, every, max(1, keep), comm
        self.base = os.path.join(run_dir, CHECKPOINTS)

    def due(self, step: int, final: bool) -> bool:
        return final or (self.every > 0 and step % self.every == 0)

    def maybe_save(self, step: int, trainer, final: bool = False) -> Optional[str]:
        return self.save(step, trainer) if self.due(step, final) else None

    def save(self, step: int, trainer) -> str:
        comm = self.comm
        # BatchNorm statistics differ per rank: average them so the saved backbone is every rank's.
        comm.average_buffers(trainer.backbone, name=f"ckpt.{step}")
        digests = comm.backbone_digests(trainer.backbone, name=f"ckpt.{step}")
        identical = len(set(digests)) == 1
        final_dir = os.path.join(self.base, step_dir_name(step))
        partial = final_dir + ".partial"
        error = None
        try:
            os.makedirs(partial, exist_ok=True)
            atomic_torch_save(trainer.rank_state(digests[comm.rank]),
                              os.path.join(partial, classifier_file(comm.rank, comm.size)))
            if comm.is_main or not identical:
                # The backbone once; every rank's own copy only when they differ (kept for inspection).
                name = "backbone.pt" if comm.is_main else None
                if not identical:
                    atomic_torch_save(trainer.backbone_state(), os.path.join(partial, f"backbone-rank-{comm.rank:05d}.pt"))
                if name:
                    atomic_torch_save(trainer.backbone_state(), os.path.join(partial, name))
        except OSError as e:
            error = f"checkpoint write failed: {e}"
        comm.agree(error, name=f"ckpt.write.{step}")
        faults.pause("pause-in-ckpt", step, comm.rank)
        if comm.is_main:
            meta = trainer.checkpoint_meta(step)
            meta.update({"digests": digests, "identical": identical, "time": time.time()})
            atomic_write_text(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1))
            _fsync_dir(partial)
            if os.path.exists(final_dir):
                shutil.rmtree(final_dir)
            os.rename(partial, final_dir)
            atomic_write_text(os.path.join(self.base, LATEST), step_dir_name(step) + "\n")
            self._prune()
        comm.agree(None, name=f"ckpt.done.{step}")
        faults.pause("pause-after-ckpt", step, comm.rank)
        if not identical:
            from .comm import RankFailure
            raise RankFailure(f"backbones differ across ranks at step {step}: "
                              + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
                              + f"; each rank's copy is saved in {final_dir}")
        return final_dir

    def _prune(self) -> None:
        names = list_checkpoints(self.run_dir)
        for old in names[:-self.keep]:
            shutil.rmtree(os.path.join(self.base, old), ignore_errors=True)


# --- re-sharding: classifier rows to another world size -------------------------------------------------

def _row_sliced(value: Any, width: int, dim: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 2 and value.shape == (width, dim)


def gather_classifier_rows(ckpt_dir: str, meta: Dict[str, Any], start: int, end: int) -> Dict[str, Any]:
    """Classifier rows ``[start, end)`` and their optimizer state, cut from the old ranks' files.

    Rows of the new slice may come from several old files (fewer ranks) or from part of one (more
    ranks). Per-row optimizer state (SGD momentum, Adam moments: tensors shaped like the weight) is cut
    the same way; per-parameter scalars (Adam's step) are equal on all old ranks and taken from the first.
    """
    weights, states, scalars, groups = [], [], {}, None
    for (old_start, old_end), name in zip(meta["slices"], meta["classifier_files"]):
        lo, hi = max(start, old_start), min(end, old_end)
        if lo >= hi:
            continue
        f = torch.load(os.path.join(ckpt_dir, name), map_location="cpu", weights_only=False)
        if (f["label_start"], f["label_end"]) != (old_start, old_end):
            raise ValueError(f"{name} covers [{f['label_start']}, {f['label_end']}), meta says [{old_start}, {old_end})")
        w = f["weight"]
        weights.append(w[lo - old_start:hi - old_start])
        opt = f["optimizer"]
        groups = groups or opt["param_groups"]
        st = opt["state"].get(0, {})
        states.append({k: v[lo - old_start:hi - old_start] for k, v in st.items() if _row_sliced(v, *w.shape)})
        for k, v in st.items():
            if not _row_sliced(v, *w.shape):
                scalars.setdefault(k, v)
    if not weights or sum(w.shape[0] for w in weights) != end - start:
        raise ValueError(f"the checkpoint's classifier files do not cover labels [{start}, {end})")
    state = {}
    if states and states[0]:
        state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
    state.update(scalars)
    return {"weight": torch.cat(weights), "optimizer": {"state": {0: state} if state else {}, "param_groups": groups}}


def reshard_checkpoint(src: str, out: str, world_size: int) -> str:
    """Write a copy of checkpoint ``src`` for ``world_size`` ranks (``hvd-partialfc reshard``).

    The backbone is copied; classifier rows and their optimizer state are redistributed to the label
    slices that the shard set gives ``world_size`` ranks (from the shard ranges recorded in meta.json).
    RNG states do not carry over (each new rank is seeded from the run's seed, its rank and the step).
    """
    from .partition import LabelSlice, group_slices
    src = resolve_checkpoint(src)
    meta = read_meta(src)
    shard_slices = [LabelSlice(i, a, b) for i, (a, b) in enumerate(meta["shard_slices"])]
    slices = group_slices(shard_slices, world_size)
    if os.path.exists(out):
        raise FileExistsError(f"{out} already exists")
    tmp = out.rstrip("/") + ".partial"
    os.makedirs(tmp, exist_ok=True)
    shutil.copyfile(os.path.join(src, "backbone.pt"), os.path.join(tmp, "backbone.pt"))
    digest = meta["digests"][0]
    for s in slices:
        rows = gather_classifier_rows(src, meta, s.start, s.end)
        rows.update({"rank": s.index, "world_size": world_size, "label_start": s.start, "label_end": s.end,
                     "rng": None, "resharded_from": meta["world_size"], "backbone_digest": digest,
                     "loss_scale": None, "skipped_steps": 0})
        atomic_torch_save(rows, os.path.join(tmp, classifier_file(s.index, world_size)))
    new = dict(meta)
    new.update({"world_size": world_size, "slices": [[s.start, s.end] for s in slices],
                "classifier_files": [classifier_file(r, world_size) for r in range(world_size)],
                "digests": [digest] * world_size, "resharded_from": meta["world_size"]})
    atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(new, indent=1))
    os.rename(tmp, out)
    return out
