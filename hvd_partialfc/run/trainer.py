"""The loop: train to the last step; every other thing a step may bring is a part of the loop that owns its timing.

Per step, on every rank: the step (step.py; watched by the straggler watch, which measures this rank's own time,
and the sample watch, which notes bad samples); the per-step vote started after the previous step is read and
every part hears it (engine/vote.py: a stop signal on any rank, rank 0's time-based checkpoint, snapshot copies
still landing, every rank's own time and an eviction rank 0 decided), so every rank takes the same turn at the
same step; the log line (train_log.py, its figures agreed across ranks); then the side work of the step
(``_side_work``): the BatchNorm buffers averaged once when a checkpoint or an evaluation is due, the checkpoint
when due (the checkpointer: every K steps, the last step, its clock; a stop; too many bad samples), evaluation on
its schedule (a failing evaluation never costs the step's checkpoint; agreed across ranks, with
``eval.on_error=log`` recorded and survived, with ``stop`` the run ends after a checkpoint of that step), a stop,
an agreed eviction's snapshot, a memory snapshot; and the next vote, which every part casts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config_io import dump_config
from ..data.stalls import named_stalls
from ..data.shards import ShardError
from ..engine.base import gradient_bytes, mark_agreed
from ..engine.vote import StepVote
from ..run_files import CheckpointError
from ..verification.evaluator import EvaluationError
from .train_log import TrainLog
from .watch import faults
from .watch.hosts import HostChanges
from .watch.preempt import StopSignals
from .watch.sample_watch import SampleWatch
from .watch.stragglers import Stragglers


@dataclass
class RunData:
    """The run's data as built once (startup.py): the manifest, the rank layout, this rank's dataset, the
    data's identity (resume.DataIdentity) and this rank's batches per epoch."""

    manifest: Any
    layout: Any
    dataset: Any
    identity: Any
    local_batches: int


@dataclass
class BuiltRun:
    """What start-up built for the loop (startup.py): the trainable parts and their step, the data and this rank's
    loader, the checkpointer and the evaluator, the memory snapshots (None: ``checkpoint.memory_every`` 0), and
    where the run starts (``resumed_from``: the resume point, None for a fresh start)."""

    parts: Any
    step: Any
    data: RunData
    loader: Any
    checkpointer: Any
    evaluator: Any
    snapshots: Any = None
    start_step: int = 0
    resumed_from: Optional[Dict[str, Any]] = None


class NoSnapshots:
    """The loop's snapshot part when ``checkpoint.memory_every`` is 0: never due."""

    committed_step = None

    def due(self, done: int, final: bool) -> bool:
        return False


class Trainer:
    """Holds the step and the loop over the parts built for it (``startup.start_trainer`` builds it)."""

    def __init__(self, cfg, comm, run: BuiltRun):
        self.cfg, self.comm, self.run = cfg, comm, run
        self.parts, self.step, self.data, self.loader = run.parts, run.step, run.data, run.loader
        self.checkpointer, self.evaluator = run.checkpointer, run.evaluator
        self.memory = run.snapshots or NoSnapshots()
        self.layout, self.manifest = run.data.layout, run.data.manifest
        self.label_slice = run.data.layout.slices[comm.rank]
        self.start_step, self.resumed_from = run.start_step, run.resumed_from
        self.total_steps = run.step.total_steps
        self.stopped_by: Optional[str] = None   # the signal that stopped fit(), if one did
        self.eviction = None   # stragglers.Eviction: the node fit() stopped for, to go on without it (cli_train.py)
        self.eval_failures: List[Tuple[int, str]] = []   # (step, reason) of each failed evaluation (on_error=log)
        self.samples = SampleWatch(cfg.data.on_bad_sample, cfg.data.max_bad_samples, run.data.manifest.num_samples)
        self.last_checkpoint: Optional[str] = None
        self.log: Optional[TrainLog] = None             # open while fit() runs
        self.stragglers: Optional[Stragglers] = None     # built in fit() (a collective)
        self.signals: Optional[StopSignals] = None
        self.hosts = HostChanges(comm)
        self.regroup = False   # fit() stopped for the launcher's new set of hosts: the group re-forms (cli_train.py)

    def train_step(self, step: int, batches) -> Dict[str, float]:
        """One optimizer step (step.py)."""
        return self.step(step, batches)

    def fit(self) -> Optional[str]:
        """Train to ``total_steps`` (or until a stop signal, then ``self.stopped_by`` names it, or an agreed
        eviction, then ``self.eviction``); returns the last checkpoint folder."""
        if self.comm.is_main:
            os.makedirs(self.cfg.out, exist_ok=True)
            dump_config(self.cfg, os.path.join(self.cfg.out, "config.yaml"))
        if self.start_step >= self.total_steps:
            return self._nothing_to_train()
        with TrainLog(self.cfg, self.comm, self.parts, self.start_step, self.total_steps, self.samples) as log, \
                StopSignals() as signals:   # before the loader's workers fork: they inherit the handlers
            self._open(log, signals)
            vote = StepVote(self.comm, [signals, self.checkpointer, self.memory, self.stragglers, self.hosts])
            batches = named_stalls(iter(self.loader), self.comm.rank,
                                   self.cfg.data.batch_timeout if self.loader.num_workers > 0 else 0)
            with self.step.watched_by(self.stragglers, self.samples):
                for step in range(self.start_step, self.total_steps):
                    faults.before_step(step, self.comm.rank)
                    out = self.train_step(step, batches)
                    for line in self.samples.new_lines():   # every rank names its own bad samples
                        log.write(line)
                    done, final = step + 1, step + 1 == self.total_steps
                    vote.read(done)
                    log.step(done, out, final)
                    if self._side_work(done, final):
                        break
                    if not final:
                        vote.start(done)
        return self.last_checkpoint

    def _open(self, log: TrainLog, signals: StopSignals) -> None:
        """The loop's own parts for this fit (the straggler watch is a collective), and rank 0's opening lines."""
        self.log, self.signals = log, signals
        self.stragglers = Stragglers.start(self.cfg, self.comm, self.start_step, log, self.step.device.type == "cuda")
        log.add_figures(self.stragglers)
        for line in self.startup_notes():
            log.say(line)
        if self.resumed_from:
            r = self.resumed_from
            log.say(f"resumed from {r['path']} at step {r['step']} (written by {r['world_size']} ranks), "
                    f"restored in {r.get('restore_s', 0.0):.2f} s")

    def _side_work(self, done: int, final: bool) -> bool:
        """What step ``done`` brings besides itself, in this order (the module's docstring); True when the loop
        ends here (a stop, an eviction). Every decision is the same on every rank (the vote, the schedules)."""
        stop, too_many = self.signals.due(done, final), self.samples.due(done, final)
        regroup = self.hosts.due(done, final) and not stop
        stop = stop or regroup
        scheduled, evaluate = self.checkpointer.scheduled(done, final), self.evaluator.due(done, final)
        save, averaged = self.checkpointer.due(done, final) or stop or too_many, scheduled or evaluate
        if averaged:   # the run goes on with the averaged buffers
            self.average_buffers(done, save)
        if save or evaluate:
            self.stragglers.hold(done)
        if save:
            self._checkpoint(done, averaged, needed=final or stop or too_many)
        if too_many:
            raise mark_agreed(ShardError(f"step {done}: {self.samples.error}; checkpoint {self.last_checkpoint} "
                                         "written"))
        if evaluate:
            self._evaluate_or_stop(done, saved=save)
        if regroup:
            self.regroup = True
            self.log.write(f"step {done}: the launcher changed the hosts; checkpoint {self.last_checkpoint} written, "
                           "the group re-forms")
            return True
        if stop:
            self.stopped_by = self.signals.stopped_by
            self.log.write(f"step {done}: stopping on {self.stopped_by}; checkpoint {self.last_checkpoint} written, "
                           "resume with --resume auto")
            return True
        if self.stragglers.due(done, final):   # an agreed snapshot; then its ranks leave, the others restart
            self._snapshot_to_leave(done, save, averaged, self.stragglers.eviction)
            return True
        if self.memory.due(done, final):
            self._memory_snapshot(done, averaged)
            self.stragglers.hold(done)
        return False

    def _checkpoint(self, done: int, averaged: bool, needed: bool) -> None:
        """The checkpoint of step ``done``. One the run can do without (every K steps, the clock's) that no rank
        could write (a full disk: ``checkpoint.not_written``, agreed) is said, recorded in metrics.jsonl, and the run goes
        on from its own processes: the next one is tried on schedule, ``latest`` still names the last one
        written. One it cannot do without (``needed``: the last step's, a stop's, before leaving on bad
        samples) raises, as does every failure with ``checkpoint.on_write_error=stop`` and diverged backbones."""
        try:
            self.last_checkpoint = self.save_checkpoint(done, averaged=averaged)
        except CheckpointError as e:
            if needed or self.cfg.checkpoint.on_write_error == "stop" or not hasattr(e, "detail"):
                raise
            self.log.record({"step": done, "checkpoint_failed": e.detail})
            self.log.say(f"step {done}: checkpoint not written, training goes on (checkpoint.on_write_error=go_on; "
                         f"the next is tried on schedule; the last written: {self.last_checkpoint}): {e.detail}")

    def _evaluate_or_stop(self, done: int, saved: bool) -> None:
        """The evaluation of step ``done``; with ``eval.on_error=stop`` a failure ends the run after a checkpoint
        of this step (not one step lost)."""
        try:
            self.evaluate(done, log=self.log)
        except EvaluationError as e:
            if not saved:
                self.last_checkpoint = self.save_checkpoint(done, averaged=True)
            raise EvaluationError(f"{e}; checkpoint {self.last_checkpoint} written, stopping "
                                  "(eval.on_error=stop)") from None

    def _memory_snapshot(self, done: int, averaged: bool) -> None:
        """The memory snapshot of step ``done`` (a collective; snapshots/memory.py); ``averaged``: the buffers were
        pooled this step."""
        state = self.parts.training_state(self.layout, self.comm.rank)
        self.memory.snapshot(done, state, averaged, lambda digests: self.checkpointer.meta(
            done, state, self.step.length, digests, True))

    def _snapshot_to_leave(self, done: int, saved: bool, averaged: bool, evict) -> None:
        """The agreed snapshot an eviction leaves from (watch/stragglers.py): the memory snapshot of ``done``,
        settled at once (committed on every node, or dropped), else a disk checkpoint of it (the step's own, if
        it wrote one). Then the eviction is certain: recorded, and ``self.eviction`` set."""
        evict.where = "in node memory"
        if not isinstance(self.memory, NoSnapshots):
            self._memory_snapshot(done, averaged)
            self.memory.settle()
        if self.memory.committed_step != done:
            if not saved:
                self.last_checkpoint = self.save_checkpoint(done, averaged=averaged)
            evict.where = self.last_checkpoint
        self.stragglers.evicting(evict)
        self.eviction = evict

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

    def evaluate(self, step: int, log: Optional[TrainLog] = None) -> Optional[Dict[str, Any]]:
        """The evaluation of ``step`` (every rank; buffers averaged already); rank 0 logs its records. A
        failure, agreed (EvaluationError on every rank), is said on rank 0; with ``eval.on_error=log`` it is
        kept in ``eval_failures`` and the run goes on, with ``stop`` it is raised."""
        try:
            records = self.evaluator.evaluate(step, self.parts.backbone)
        except EvaluationError as e:
            self.eval_failures.append((step, str(e)))
            go_on = self.cfg.eval.on_error == "log"
            if log is not None:
                log.say(f"step {step}: {e} (in eval.jsonl); "
                        + ("training goes on (eval.on_error=log)" if go_on else "stopping (eval.on_error=stop)"))
            if not go_on:
                raise
            return None
        if records is None:
            return None
        if log is not None:
            for rec in records.values():
                log.record({"eval": rec, "step": step})
            log.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in self.evaluator.summary(records).items()))
        return records

    def save_checkpoint(self, step: int, averaged: bool = False) -> str:
        """Write the checkpoint of ``step`` (a collective: every rank calls it at the same step). ``averaged``:
        the buffers were averaged this step by `average_buffers` (a scheduled checkpoint or an evaluation),
        and the run goes on with them. Else (a stop signal, rank 0's clock, a stop on bad samples, a resume
        at another size with nothing to train) the checkpoint is *unscheduled*: its backbone file holds the
        averaged buffers, while this rank keeps training with its own, as it would have without the
        checkpoint, and its file keeps them, so a resume at the same world size is the run that was never
        stopped, BatchNorm statistics included."""
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
