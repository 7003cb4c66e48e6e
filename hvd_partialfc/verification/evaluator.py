"""The training-loop component: verification on held-out pair sets every ``eval.every`` steps.

Contract: the trainer builds one `Evaluator` on *every* rank, with the run's comm, and calls
`Evaluator.maybe_run` after every step on every rank. The evaluator decides whether it is due (from the
config alone, so every rank gives the same answer), averages the BatchNorm buffers across ranks through
the comm (a collective every rank must join: each rank's running statistics come from its own classes),
and evaluates on the main rank only, which alone reads the pair sets. The trainer, which averages the
buffers once a step for its checkpoint and its evaluation, calls `Evaluator.evaluate` instead.

An evaluation that fails on the main rank (an exception in `run`: a GPU out of memory while training's
memory is held, `metrics.check_scores` refusing the scores of non-finite embeddings) is agreed across ranks
(``failures``), recorded in ``eval.jsonl`` as ``{"step", "error", "sets", "time"}`` and raised on every
rank as `EvaluationError`, so every rank takes the same turn (the trainer's ``eval.on_error``).

Horovod is not imported here: the comm is any object with ``is_main``, ``average_buffers(module, name)`` and
``failures(error, name)`` (`hvd_partialfc.engine.base.CommBase`); without one (``comm=None``) the evaluator
is a single process's, that averages nothing.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..data.pair_files import read_pairs
from .metrics import FARS, N_FOLDS, check_scores, far_key
from .verify_pairs import check_names, evaluate_backbone


class EvaluationError(RuntimeError):
    """An evaluation failed on the main rank: raised on every rank, with the same message, once the failure
    is agreed and recorded in eval.jsonl."""

    agreed_by_every_rank = True     # what engine/base.py's ``agreed`` reads: the heartbeat says goodbye


class Evaluator:
    """Verification during training: decides when (`due`), averages buffers and evaluates (`maybe_run`).

    The pair sets are read and checked once, here, on the main rank, so a bad path fails before training
    rather than at the first evaluation. `run` (main rank only) changes nothing in the backbone (see
    `embedding.embed`) and appends one JSON line per set to ``out_dir/eval.jsonl``.
    """

    def __init__(self, pairs_paths: List[str], every: int, flip: bool = False, batch_size: int = 256,
                 out_dir: str = ".", fars: Sequence[float] = FARS, comm: Any = None):
        if every < 0:
            raise ValueError(f"eval every must be >= 0 (0: only at the end), got {every}")
        self.comm = comm
        self.is_main = comm is None or comm.is_main
        self.pairs_paths = list(pairs_paths)
        self.sets = [read_pairs(p) for p in pairs_paths] if self.is_main else []
        check_names(self.sets, pairs_paths)
        for s in self.sets:
            check_scores(np.zeros(s.num_pairs), s.same)      # both classes present
            if s.num_pairs < N_FOLDS:
                raise ValueError(f"pair set {s.name!r}: {s.num_pairs} pairs, the 10-fold protocol needs >= 10")
        self.every, self.flip, self.batch_size, self.fars = every, flip, batch_size, tuple(fars)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "eval.jsonl")

    @classmethod
    def from_config(cls, eval_cfg, out_dir: str, comm: Any = None) -> "Evaluator":
        """From the ``eval`` config section (``pairs``, ``every``, ``flip``, ``batch_size``)."""
        return cls(list(eval_cfg.pairs), eval_cfg.every, eval_cfg.flip, eval_cfg.batch_size, out_dir, comm=comm)

    def due(self, step: int, final: bool) -> bool:
        """True every ``every`` steps and at the final step (never without pair sets); the same answer on
        every rank (it depends on the config only)."""
        return bool(self.pairs_paths) and (final or (self.every > 0 and step % self.every == 0))

    def maybe_run(self, step: int, final: bool, backbone: nn.Module) -> Optional[Dict[str, Dict[str, Any]]]:
        """On every rank: when due, average the backbone's buffers across ranks (collective, named
        ``buffers.eval.<step>``), then `evaluate`; returns the main rank's records, else None. The averaged
        buffers stay in the backbone."""
        if not self.due(step, final):
            return None
        if self.comm is not None:
            self.comm.average_buffers(backbone, name=f"eval.{step}")
        return self.evaluate(step, backbone)

    def evaluate(self, step: int, backbone: nn.Module) -> Optional[Dict[str, Dict[str, Any]]]:
        """On every rank, the buffers averaged already: the main rank runs `run`; its failure is agreed
        (collective ``agree.eval.<step>``), recorded and raised as `EvaluationError` on every rank. Returns
        the main rank's records, else None."""
        records, error = None, None
        if self.is_main:
            try:
                records = self.run(step, backbone)
            except Exception as e:   # noqa: BLE001 (any failure of an evaluation is agreed, see the module)
                error = f"{type(e).__name__}: {e}"
            if error is not None:    # after the except block, which freed the failed frames' tensors
                release_cached_device_memory()
                error = self.record_error(step, error)
        failed = self.comm.failures(error, name=f"eval.{step}") if self.comm is not None else \
            ([(0, error)] if error is not None else [])
        if failed:
            reason = "; ".join(e for _, e in failed)     # the main rank alone evaluates
            raise EvaluationError(f"evaluation at step {step} failed: {reason}")
        return records

    def record_error(self, step: int, reason: str) -> str:
        """Append the failed evaluation's record to eval.jsonl (its sets, no figures); returns the reason,
        which says so when the record could not be written either (a full disk must not end the run here)."""
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": int(step), "error": reason, "sets": [s.name for s in self.sets],
                                    "time": time.time()}) + "\n")
        except OSError as e:
            return f"{reason} (not recorded in {self.path}: {e})"
        return reason

    def run(self, step: int, backbone: nn.Module) -> Dict[str, Dict[str, Any]]:
        """Evaluate ``backbone`` on every set; returns ``{set name: record}`` and appends the records."""
        records = {}
        for s in self.sets:
            m = evaluate_backbone(backbone, s, self.batch_size, self.flip, self.fars, roc=False)
            rec = {"step": int(step), "set": s.name, "acc": m["acc"], "acc_std": m["acc_std"], "auc": m["auc"]}
            rec.update({far_key(f): m[far_key(f)] for f in self.fars})
            rec.update({"best_threshold": m["best_threshold"], "pairs": m["pairs"], "time_s": m["time_s"]})
            records[s.name] = rec
        os.makedirs(self.out_dir, exist_ok=True)
        with open(self.path, "a") as f:
            for rec in records.values():
                f.write(json.dumps(rec) + "\n")
        return records

    @staticmethod
    def summary(records: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
        """Short progress-bar fields: ``{"<set>_acc": "0.912", "<set>_tar@1e-3": "0.55"}``."""
        out = {}
        for name, r in records.items():
            out[f"{name}_acc"] = f"{r['acc']:.3f}"
            if r.get("tar@far=1e-3") is not None:
                out[f"{name}_tar@1e-3"] = f"{r['tar@far=1e-3']:.3f}"
        return out


def release_cached_device_memory() -> None:
    """After a failed evaluation (on a GPU most likely out of memory): the blocks the evaluation's batches
    left in PyTorch's CUDA cache go back, so the next training step finds the memory it had. Nothing on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
