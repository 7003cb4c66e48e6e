"""The loop: train to the last step, log, checkpoint, evaluate, stop on a signal. One loop for every mode
and engine; the parts it trains and the step it runs are built once, before it (startup.py).

Per step: the step (step.py); the names of the bad samples it replaced (sample_watch.py); the stop vote
started after the previous step is read (any rank's SIGTERM, rank 0's time-based checkpoint; every rank's
own time of the step and an eviction rank 0 decided: stragglers.py), so every rank stops at the same step;
the log line (its figures agreed across ranks); the BatchNorm buffers averaged once when a checkpoint or an
evaluation is due; the checkpoint when due, stopped, voted, or before stopping on too many bad samples; then
evaluation on its schedule, so a failing evaluation never costs the step's checkpoint; an agreed eviction's
snapshot. A failed evaluation is agreed across ranks (verification/evaluator.py) and, with
``eval.on_error=log``, recorded and survived; with ``stop`` the run ends after a checkpoint of that step.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from . import faults
from ..engine.base import gradient_bytes, mark_agreed
from ..config_io import dump_config
from .metrics_log import LoaderWatch, MetricsLog
from .preempt import StopSignals
from .sample_watch import SampleWatch
from .stragglers import Stragglers
from ..data.loader import named_stalls
from ..data.shards import ShardError
from ..verification.evaluator import EvaluationError


@dataclass
class RunData:
    """The run's data as built once (startup.py): the manifest, the rank layout, this rank's dataset, the
    data's identity (resume.DataIdentity) and this rank's batches per epoch."""

    manifest: Any
    layout: Any
    dataset: Any
    identity: Any
    local_batches: int


class Trainer:
    """Holds the step and the loop over the parts built for it (``startup.start_trainer`` builds it)."""

    def __init__(self, cfg, comm, parts, step, data: RunData, loader, checkpointer, evaluator,
                 start_step: int = 0, resumed_from: Optional[Dict[str, Any]] = None, memory=None):
        self.cfg, self.comm, self.parts, self.step, self.data = cfg, comm, parts, step, data
        self.memory = memory   # memory.MemorySnapshots, or None (checkpoint.memory_every: 0)
        self.layout, self.manifest = data.layout, data.manifest
        self.label_slice = data.layout.slices[comm.rank]
        self.loader, self.checkpointer, self.evaluator = loader, checkpointer, evaluator
        self.start_step, self.resumed_from = start_step, resumed_from
        self.total_steps = step.total_steps
        self.stopped_by: Optional[str] = None   # the signal that stopped fit(), if one did
        self.eviction = None   # stragglers.Eviction: the node fit() stopped for, to go on without it (cli.py)
        self.stragglers: Optional[Stragglers] = None   # built in fit() (a collective)
        self.eval_failures: List[Tuple[int, str]] = []   # (step, reason) of each failed evaluation (on_error=log)
        self.loader_watch = LoaderWatch(cfg.data.workers)
        self.sample_watch = SampleWatch(cfg.data.on_bad_sample, cfg.data.max_bad_samples, data.manifest.num_samples)

    def train_step(self, step: int, batches) -> Dict[str, float]:
        """One optimizer step (step.py)."""
        return self.step(step, batches)

    def startup_notes(self) -> List[str]:
        """The lines rank 0 prints before the first step: the negatives' exchange and its cost against the
        backbone gradient (more than one rank), and a warning when sampled ``local`` scores few rows."""
        notes = []
        head = self.parts.head
        if self.comm.size > 1:
            line = head.describe(gradient_bytes(self.parts.backbone.parameters(), self.cfg.optim.fp16_compression))
            notes += [line] if line else []
        warning = head.sampling_warning()
        return notes + ([warning] if warning else [])

    def fit(self) -> str:
        """Train to ``total_steps`` (or until a stop signal, then ``self.stopped_by`` names it); returns the
        last checkpoint folder."""
        cfg, comm = self.cfg, self.comm
        if comm.is_main:
            os.makedirs(cfg.out, exist_ok=True)
            dump_config(cfg, os.path.join(cfg.out, "config.yaml"))
        if self.start_step >= self.total_steps:
            return self._nothing_to_train()
        metrics = MetricsLog(cfg.out, cfg.train.tensorboard) if comm.is_main else None
        interval = {"data_time": 0.0, "step_time": 0.0}   # seconds summed since the last log line
        samples_per_step = cfg.data.batch_size * cfg.optim.backward_passes_per_step * comm.size
        bar = tqdm(total=self.total_steps, initial=self.start_step, disable=not comm.is_main,
                   dynamic_ncols=True, desc=f"train np={comm.size}")
        if comm.is_main:
            for line in self.startup_notes():
                bar.write(line)
        if self.resumed_from and comm.is_main:
            r = self.resumed_from
            bar.write(f"resumed from {r['path']} at step {r['step']} (written by {r['world_size']} ranks), "
                      f"restored in {r.get('restore_s', 0.0):.2f} s")
        last_log, last_t = self.start_step, time.perf_counter()
        last_save = time.monotonic()
        every_s = 60.0 * cfg.checkpoint.every_minutes
        ckpt_dir, vote = None, None
        on_phase = self.step.on_phase
        try:
            watch = self.stragglers = Stragglers.start(cfg, comm, self.start_step, bar.write if comm.is_main
                                                       else (lambda line: None), self.step.device.type == "cuda")
            self.step.on_phase = watch.phases(on_phase)   # on a GPU: the averaging's stall on its clock
            with StopSignals() as signals:
                # after the handlers: forked workers inherit them
                batches = watch.batches(self.sample_watch.batches(
                    named_stalls(iter(self.loader), comm.rank,
                                 cfg.data.batch_timeout if self.loader.num_workers > 0 else 0)))
                for step in range(self.start_step, self.total_steps):
                    faults.before_step(step, comm.rank)
                    out = watch.timed(step, self.train_step, step, batches)   # its own time: stragglers.py
                    for line in self.sample_watch.new_lines():   # every rank names its own bad samples
                        bar.write(line)
                    for key in interval:
                        interval[key] += out[key]
                    done = step + 1
                    final = done == self.total_steps
                    # The vote started after the previous step: did any rank get a stop signal, is rank 0's
                    # time-based checkpoint due? Every rank reads the same answer at the same step.
                    flags = vote.result() if vote is not None else [0.0, 0.0, 1.0]
                    stop, time_due, not_landed = (v > 0 for v in flags[:3])
                    evict = watch.read(done, flags[3:], metrics, bar)   # the ranks' times; an agreed eviction
                    vote = None
                    if self.memory and not not_landed:   # every rank's snapshot copies landed: commit
                        self.memory.all_landed()
                    if done % cfg.train.log_every == 0 or final:
                        last_log, last_t = self._log(done, out, samples_per_step, last_log, last_t, metrics, bar,
                                                     interval)
                    bar.update(1)
                    too_many = self.sample_watch.error   # set at a log step, the same on every rank
                    scheduled = self.checkpointer.due(done, final)
                    save = scheduled or stop or time_due or bool(too_many)
                    evaluate = self.evaluator.due(done, final)
                    if scheduled or evaluate:   # the run goes on with the averaged buffers
                        self.average_buffers(done, save)
                    if save or evaluate:
                        watch.hold(done)
                    if save:
                        ckpt_dir = self.save_checkpoint(done, averaged=scheduled or evaluate)
                        last_save = time.monotonic()
                    if too_many:
                        raise mark_agreed(ShardError(f"step {done}: {too_many}; checkpoint {ckpt_dir} written"))
                    if evaluate:
                        try:
                            self.evaluate(done, bar=bar, metrics=metrics)
                        except EvaluationError as e:   # eval.on_error=stop: not one step lost
                            ckpt_dir = ckpt_dir if save else self.save_checkpoint(done, averaged=True)
                            raise EvaluationError(f"{e}; checkpoint {ckpt_dir} written, stopping "
                                                  "(eval.on_error=stop)") from None
                    if stop:
                        self.stopped_by = signals.received or "a stop signal on another rank"
                        bar.write(f"step {done}: stopping on {self.stopped_by}; checkpoint {ckpt_dir} written, "
                                  f"resume with --resume auto")
                        break
                    if evict and not final:   # an agreed snapshot; then its ranks leave, the others restart
                        ckpt_dir = self._snapshot_to_leave(done, save, scheduled or evaluate, ckpt_dir, evict)
                        break
                    if self.memory and not final and self.memory.due(done):
                        self._memory_snapshot(done, scheduled or evaluate)
                        watch.hold(done)
                    if not final:  # after the save, so a time-based checkpoint is not due twice in a row
                        due = comm.is_main and every_s > 0 and time.monotonic() - last_save >= every_s
                        vote = comm.vote_async([signals.received is not None, due,
                                                self.memory.vote_flag() if self.memory else 0.0,
                                                *watch.vote_part()], name="step")
        finally:
            self.step.on_phase = on_phase
            bar.close()
            if metrics:
                metrics.close()
        return ckpt_dir

    def _memory_snapshot(self, done: int, averaged: bool) -> None:
        """The memory snapshot of step ``done`` (a collective; memory.py); ``averaged``: the buffers were pooled."""
        state = self.parts.training_state(self.layout, self.comm.rank)
        self.memory.snapshot(done, state, averaged, lambda digests: self.checkpointer.meta(
            done, state, self.step.length, digests, True))

    def _snapshot_to_leave(self, done: int, saved: bool, averaged: bool, ckpt_dir: Optional[str],
                           evict) -> Optional[str]:
        """The agreed snapshot an eviction leaves from (stragglers.py): the memory snapshot of ``done``, settled at
        once (committed on every node, or dropped), else a disk checkpoint of it (the step's own, if it wrote one).
        Sets ``self.eviction``; returns the last disk checkpoint."""
        evict.where = "in node memory"
        if self.memory:
            self._memory_snapshot(done, averaged)
            self.memory.settle()
            if self.memory.committed_step == done:
                self.eviction = evict
                return ckpt_dir
        ckpt_dir = ckpt_dir if saved else self.save_checkpoint(done, averaged=averaged)
        evict.where, self.eviction = ckpt_dir, evict
        return ckpt_dir

    def _log(self, done: int, out: Dict[str, float], samples_per_step: int, last_log: int, last_t: float,
             metrics, bar, interval: Dict[str, float]) -> Tuple[int, float]:
        """The log line of step ``done`` (collectives: the mean loss, the classifier skips over ranks, the bad
        samples over ranks under ``data.on_bad_sample: skip``).
        ``interval``: rank 0's data and step seconds summed since the last line (reset here); the record
        holds their means per step, and the first interval after a (re)start, which includes the workers'
        start-up, never warns."""
        cfg = self.cfg
        mean_loss = self.comm.allreduce_scalar(out["loss"], "average", name="log.loss")
        cls_skips = int(self.comm.allreduce_scalar(self.parts.counters.classifier_skipped_steps, "sum", name="log.cls_skips"))
        bad = self.sample_watch.agree(self.comm) if self.sample_watch.active else {}   # data.on_bad_sample=skip
        now = time.perf_counter()
        sps = samples_per_step * (done - last_log) / max(now - last_t, 1e-9)
        lr = cfg.optim.backbone_lr * out["lr_factor"]
        data_t, step_t = (interval[k] / max(1, done - last_log) for k in ("data_time", "step_time"))
        interval.update(data_time=0.0, step_time=0.0)
        if metrics:
            rec = {"step": done, "world_size": self.comm.size, "loss": mean_loss, "rank0_loss": out["loss"], "lr": lr,
                   "grad_norm": out["grad_norm"], "samples_per_s": sps, "skipped_steps": self.parts.counters.skipped_steps,
                   "classifier_skipped_steps": cls_skips, "data_time": data_t, "step_time": step_t,
                   "time": time.time()}
            if self.parts.loss_scale.enabled:
                rec["loss_scale"] = self.parts.loss_scale.scale
            rec.update(bad)
            rec.update(self.stragglers.record())
            metrics.write(rec)
        bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.4g}", sps=f"{sps:.0f}", data=f"{data_t:.3f}/{step_t:.3f}s",
                        **self.stragglers.postfix())
        warning = self.loader_watch.check(done, data_t, step_t, first=last_log == self.start_step)
        if warning and self.comm.is_main:   # rank 0's figures, said by rank 0 (tqdm.write ignores `disable`)
            bar.write(warning)
        return done, now

    def _nothing_to_train(self) -> str:
        """Resumed at (or past) the last step: nothing is rewritten. A checkpoint loaded from elsewhere or
        re-sharded to this world size is saved into this run (that is a new file, not a rewrite)."""
        r = self.resumed_from
        own = r and r["world_size"] == self.comm.size and os.path.realpath(os.path.dirname(r["path"])) == \
            os.path.realpath(self.checkpointer.base)
        if own:
            if self.comm.is_main:
                print(f"nothing to train: {r['path']} is at step {r['step']} of {self.total_steps}", flush=True)
            return r["path"]
        return self.save_checkpoint(self.start_step)

    def average_buffers(self, step: int, save: bool) -> None:
        """Once a step, when the checkpoint or the evaluation is due (a collective): both see the same
        buffers, and the run goes on with the ones it saved. Averaging twice is not the identity at a world
        size that is not a power of two (the sum of N equal float32 values times 1/N rounds), so a second
        averaging after the checkpoint would break a resume's bitwise continuation. Named as before:
        ``buffers.ckpt.<step>`` when a checkpoint is due, else ``buffers.eval.<step>``."""
        self.comm.average_buffers(self.parts.backbone, name=f"{'ckpt' if save else 'eval'}.{step}")

    def evaluate(self, step: int, bar=None, metrics=None) -> Optional[Dict[str, Any]]:
        """The evaluation of ``step`` (every rank; buffers averaged already); rank 0 logs its records. A
        failure, agreed (EvaluationError on every rank), is said on rank 0; with ``eval.on_error=log`` it is
        kept in ``eval_failures`` and the run goes on, with ``stop`` it is raised."""
        try:
            records = self.evaluator.evaluate(step, self.parts.backbone)
        except EvaluationError as e:
            self.eval_failures.append((step, str(e)))
            go_on = self.cfg.eval.on_error == "log"
            if bar is not None and self.comm.is_main:   # tqdm.write ignores `disable`
                bar.write(f"step {step}: {e} (in eval.jsonl); "
                          + ("training goes on (eval.on_error=log)" if go_on else "stopping (eval.on_error=stop)"))
            if not go_on:
                raise
            return None
        if records is None:
            return None
        if metrics:
            for rec in records.values():
                metrics.write({"eval": rec, "step": step})
        if bar is not None:
            bar.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in self.evaluator.summary(records).items()))
        return records

    def save_checkpoint(self, step: int, averaged: bool = False) -> str:
        """Write the checkpoint of ``step`` (a collective: every rank calls it at the same step). ``averaged``:
        the buffers were averaged this step by `average_buffers` (a scheduled checkpoint or an evaluation),
        and the run goes on with them. Else (a stop signal, rank 0's clock, a stop on bad samples, a resume
        at another size with nothing to train) the checkpoint is *unscheduled*: its backbone file holds the
        averaged buffers, while this rank keeps training with its own, as it would have without the
        checkpoint, and its file keeps them, so a resume at the same world size is the run that was never
        stopped, BatchNorm statistics included (before, such a resume differed in them: a preempted run was
        not bitwise the uninterrupted one)."""
        state = self.parts.training_state(self.layout, self.comm.rank)
        if averaged:
            return self.checkpointer.write(step, state, self.step.length)
        own = {k: b.detach().clone() for k, b in self.parts.backbone.named_buffers()}
        try:
            return self.checkpointer.save(step, state, self.step.length, own_buffers=own)
        finally:
            with torch.no_grad():
                for k, b in self.parts.backbone.named_buffers():
                    b.copy_(own[k])

    def final_evaluation_failed(self) -> Optional[str]:
        """The reason the evaluation of the last step failed (on_error=log), else None: the run's last line says it."""
        return next((reason for step, reason in self.eval_failures if step == self.total_steps), None)

