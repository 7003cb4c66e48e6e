"""Where rank 0's log records go: ``OUT/metrics.jsonl`` (the source of truth), and TensorBoard when asked.

Contract:
* ``MetricsLog(out, tensorboard)``: ``write(record)`` appends one JSON line to ``metrics.jsonl`` and
  flushes it; with ``tensorboard`` it also writes every number of the record as a TensorBoard scalar in
  ``OUT/tensorboard`` at the record's ``step`` and wall time, so the two never disagree (the event files
  hold float32, the JSON float64):
  - a training record: ``train/<key>`` for each number (loss, lr, grad_norm, samples_per_s, data_time,
    step_time, ...; not ``step`` and ``time``, which are its step and wall time);
  - a verification record ``{"eval": {"set": NAME, ...}, "step": S}``: ``eval/NAME/<key>`` for each number
    (acc, auc, tar@far=..., ...);
  - a straggler event ``{"straggler": {"line": ..., ...}, "step": S}`` (run/watch/stragglers.py): its line as the text
    ``stragglers`` (training records carry its numbers: ``train/straggler_ratio``, ``train/stragglers``).
* ``LoaderWatch``: the one-line warning, once per run, when the trainer waits for data more than
  ``LOADER_BOUND_FRACTION`` of its step time.
* TensorBoard is an optional install (``pip install hvd_partialfc[tensorboard]``); ``tensorboard_missing``
  says why it cannot be used, so config validation fails before anything starts rather than mid-run.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, Optional, Tuple

TENSORBOARD_PIN = "tensorboard==2.21.0"
# Above one half of the step spent waiting for the next batch, the loader, not the device, sets the pace:
# another worker speeds the run up by more than anything done on the device could (the device's share is
# already the smaller one). Below it, prefetching workers hide the decode behind the step.
LOADER_BOUND_FRACTION = 0.5


def tensorboard_missing() -> Optional[str]:
    """None if TensorBoard's event writer can be imported, else what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
    except ImportError as e:
        return (f"TensorBoard is not installed ({e}); pip install '{TENSORBOARD_PIN}' "
                f"(or the extra: pip install 'hvd_partialfc[tensorboard]'), or set train.tensorboard=false")
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars(record: Dict[str, Any]) -> Iterator[Tuple[str, float]]:
    """The (tag, value) pairs a record becomes in TensorBoard (see the module's contract)."""
    if "eval" in record:
        rec = record["eval"]
        for k, v in rec.items():
            if k != "step" and _number(v):
                yield f"eval/{rec.get('set', 'pairs')}/{k}", float(v)
        return
    for k, v in record.items():
        if k not in ("step", "time") and _number(v):
            yield f"train/{k}", float(v)


class MetricsLog:
    """Rank 0's record writer: ``metrics.jsonl`` plus the optional TensorBoard events."""

    def __init__(self, out: str, tensorboard: bool = False):
        os.makedirs(out, exist_ok=True)
        self.file = open(os.path.join(out, "metrics.jsonl"), "a")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))

    def write(self, record: Dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for tag, value in scalars(record):
                self.writer.add_scalar(tag, value, int(record["step"]), walltime=record.get("time"))
            if isinstance(record.get("straggler"), dict):      # a straggler event: its line, as text
                self.writer.add_text("stragglers", record["straggler"]["line"], int(record["step"]),
                                     walltime=record.get("time"))
            self.writer.flush()

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


class LoaderWatch:
    """Warns once per run when a log interval's mean data time exceeds ``fraction`` of its step time."""

    def __init__(self, workers: int, fraction: float = LOADER_BOUND_FRACTION):
        self.workers, self.fraction, self.said = workers, fraction, False

    def check(self, step: int, data_time: float, step_time: float, first: bool = False) -> Optional[str]:
        """The warning to print at ``step``, or None. ``first``: the first interval after a (re)start,
        which includes the workers' start-up and the first fetches, never warns."""
        if self.said or first or data_time <= self.fraction * step_time:
            return None
        self.said = True
        return (f"step {step}: loader-bound: rank 0 waited {data_time:.3f} s for data per {step_time:.3f} s step "
                f"(> {self.fraction:.0%}); raise data.workers (now {self.workers}) or drop data.augment entries "
                f"(docs/data.md, \"Faces: the loader\"). Said once per run; metrics.jsonl has data_time")
