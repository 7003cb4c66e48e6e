"""The run's voice (``TrainLog``): rank 0's progress bar, its metrics.jsonl (metrics_log.py) and the log line every
``train.log_every`` steps, whose figures every rank agrees on.

* ``write(line)`` says a line on this rank (each rank names its own bad samples, its own stop); ``say(line)`` on
  rank 0 only; ``record(rec)`` appends to rank 0's metrics.jsonl (other ranks have none).
* ``step(done, figures, final)`` after every step: the step's data and step seconds summed since the last line,
  the bar moved on, and at a log step the line (collectives: the mean loss, the classifier's skips over ranks,
  the bad samples over ranks under ``data.on_bad_sample: skip``), its record, and the loader-bound warning.
  The record holds the interval's means per step; the first interval after a (re)start, which includes the
  workers' start-up, never warns. Figures added with ``add_figures`` (the straggler watch: ``record()``,
  ``postfix()``) add their fields to the record and the bar.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from tqdm import tqdm

from .metrics_log import LoaderWatch, MetricsLog


class TrainLog:
    """Opened for one ``fit`` (a context manager: the bar and the metrics file closed on every way out)."""

    def __init__(self, cfg, comm, parts, start_step: int, total_steps: int, samples):
        self.cfg, self.comm, self.parts, self.samples = cfg, comm, parts, samples
        self.figures: List[Any] = []
        self.start_step = start_step
        self.metrics: Optional[MetricsLog] = MetricsLog(cfg.out, cfg.train.tensorboard) if comm.is_main else None
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not comm.is_main, dynamic_ncols=True,
                        desc=f"train np={comm.size}")
        self.samples_per_step = cfg.data.batch_size * cfg.optim.backward_passes_per_step * comm.size
        self.loader_watch = LoaderWatch(cfg.data.workers)
        self.interval = {"data_time": 0.0, "step_time": 0.0}   # seconds summed since the last log line
        self.last_log, self.last_t = start_step, time.perf_counter()

    def __enter__(self) -> "TrainLog":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
        if self.metrics:
            self.metrics.close()

    def add_figures(self, part) -> None:
        """``part``'s ``record()`` and ``postfix()`` join every log line from now on."""
        self.figures.append(part)

    def write(self, line: str) -> None:
        """A line on this rank (tqdm.write ignores the bar's ``disable``)."""
        self.bar.write(line)

    def say(self, line: str) -> None:
        """A line on rank 0 only."""
        if self.comm.is_main:
            self.bar.write(line)

    def record(self, rec: Dict[str, Any]) -> None:
        """A record in rank 0's metrics.jsonl (nothing elsewhere)."""
        if self.metrics:
            self.metrics.write(rec)

    def step(self, done: int, out, final: bool) -> None:
        """After step ``done`` (``out``: its figures, step.py); the log line when due (a collective)."""
        for key in self.interval:
            self.interval[key] += out[key]
        if done % self.cfg.train.log_every == 0 or final:
            self._line(done, out)
        self.bar.update(1)

    def _line(self, done: int, out) -> None:
        cfg, comm, parts = self.cfg, self.comm, self.parts
        mean_loss = comm.allreduce_scalar(out["loss"], "average", name="log.loss")
        cls_skips = int(comm.allreduce_scalar(parts.counters.classifier_skipped_steps, "sum", name="log.cls_skips"))
        bad = self.samples.agree(comm) if self.samples.active else {}   # data.on_bad_sample=skip
        now = time.perf_counter()
        sps = self.samples_per_step * (done - self.last_log) / max(now - self.last_t, 1e-9)
        lr = cfg.optim.backbone_lr * out["lr_factor"]
        data_t, step_t = (self.interval[k] / max(1, done - self.last_log) for k in ("data_time", "step_time"))
        self.interval.update(data_time=0.0, step_time=0.0)
        if self.metrics:
            rec = {"step": done, "world_size": comm.size, "loss": mean_loss, "rank0_loss": out["loss"], "lr": lr,
                   "grad_norm": out["grad_norm"], "samples_per_s": sps, "skipped_steps": parts.counters.skipped_steps,
                   "classifier_skipped_steps": cls_skips, "data_time": data_t, "step_time": step_t,
                   "time": time.time()}
            if parts.loss_scale.enabled:
                rec["loss_scale"] = parts.loss_scale.scale
            rec.update(bad)
            for f in self.figures:
                rec.update(f.record())
            self.metrics.write(rec)
        postfix = {}
        for f in self.figures:
            postfix.update(f.postfix())
        self.bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.4g}", sps=f"{sps:.0f}",
                             data=f"{data_t:.3f}/{step_t:.3f}s", **postfix)
        warning = self.loader_watch.check(done, data_t, step_t, first=self.last_log == self.start_step)
        if warning:   # rank 0's figures, said by rank 0
            self.say(warning)
        self.last_log, self.last_t = done, now
