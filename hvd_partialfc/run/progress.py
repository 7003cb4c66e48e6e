"""A run's length and position in samples: what keeps it the same run when it resumes at another world size.

A step consumes one global batch, ``data.batch_size x optim.backward_passes_per_step x N`` samples, so at N
ranks a step is N times the work of a step at one rank. A run counted in steps changes when N does: before
this module, ``train.steps: 0`` (the run is ``train.epochs`` long) recomputed its step count from the new
world size's steps per epoch while the resumed step kept the old world's count. Shrunk 4 -> 2 ranks at 50%,
the cosine schedule jumped back to 25% and the run trained 12.5 epochs instead of 10; grown 2 -> 4 at 60%,
the resumed step was past the new total and the run said "done" after 6 of its 10 epochs.

So a run is defined by what it consumes (``RunLength``):

* **budget**: the samples the run trains on. At the world size it started with (its first *segment*),
  ``train.epochs`` of that world's steps per epoch, or ``train.steps``, times that world's global batch:
  ``train.steps`` counts steps of the run's first world size, so no resume at another size changes how much
  the run trains (docs/reliability.md gives the rule, docs/evidence/reliability.md its reason). Unchanged at a resume, unless the
  config extends the run (``train.steps`` / ``train.epochs``), which recomputes it the same way.
* **unit**: the samples of a schedule step, the first segment's global batch. The learning rate is a function
  of ``position = samples consumed / unit`` against ``budget / unit``: at the first world size that is the
  step and the step count exactly (integer samples, divided once), so a run that never changes size has the
  same floats as before; at another size the position moves ``G' / unit`` a step, and the schedule goes on
  from where it was, warm-up included, without a jump.
* **segments**: one per world size the run has trained at, ``(step, samples, world_size, global_batch)`` at
  its start. A resume at the same size continues the current segment; another size opens a new one. The run
  ends at the step where the budget is consumed, to the nearest step of the current segment (within half a
  global batch).
* **epoch**: the samples of the run's epoch at its first world size (its steps per epoch, the minimum over
  ranks, times its global batch). A rank's loader starts a new segment at the run's fraction of its epoch
  (``loader_start``): each rank's own stream at the same fraction of *its* epoch. Within a segment it draws
  ``backward_passes_per_step`` batches a step, as it always did; the first segment starts at batch 0, so a
  run at one world size draws exactly the batches it drew before.

meta.json records the ``RunLength`` (``record``) beside ``total_steps``. A checkpoint from before it (no
``length``) is read as one segment at its own world size (``legacy_record``).

An imported run keeps the schedule it was trained under (``ImportedSchedule``, the record's ``lr_schedule``):
arcface_torch's scheduler steps once per backward pass, whatever its gradient accumulation, and warms up to
its peak *at* the last warm-up step where this package's reaches it one step earlier, so no choice of this
package's keys gives its curve; its lr goes on by the samples consumed, as this package's does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..data.layout import RankLayout
from ..data.partition import LabelSlice


@dataclass(frozen=True)
class Segment:
    """The run at one world size, from ``step`` on; ``samples`` consumed before it."""

    step: int
    samples: int
    world_size: int
    global_batch: int

    def as_dict(self) -> Dict[str, int]:
        return {"step": self.step, "samples": self.samples, "world_size": self.world_size,
                "global_batch": self.global_batch}


@dataclass(frozen=True)
class ImportedSchedule:
    """The lr schedule an imported run brought (tools/arcface_import.py): its scheduler's own steps of
    ``samples_per_step`` samples (arcface_torch: one batch on every rank), ``warmup`` and ``total`` of them,
    ``power``. An optimizer step takes the lr at ``index``: the samples consumed before it in those steps, plus
    ``index_offset`` (arcface_torch: ``gradient_acc - 1``, its step's last batch, plus ``last_epoch -
    global_step``, the scheduler's lag behind its batches: 0 today, -1 in the older one)."""

    samples_per_step: int
    index_offset: int
    warmup: float
    total: float
    power: float

    def index(self, samples: int) -> float:
        return samples / self.samples_per_step + self.index_offset

    def as_dict(self) -> Dict[str, Any]:
        return {"samples_per_step": self.samples_per_step, "index_offset": self.index_offset,
                "warmup": self.warmup, "total": self.total, "power": self.power}


class RunLength:
    """A run's budget, schedule unit, epoch and segments (see the module's docstring); an imported run's own
    lr schedule (``schedule``), None for this package's (the config's)."""

    def __init__(self, budget: int, unit: int, epoch: int, segments: Sequence[Segment],
                 schedule: Optional[ImportedSchedule] = None):
        if unit <= 0 or epoch <= 0 or budget <= 0 or not segments:
            raise ValueError(f"a run length needs a positive budget, unit and epoch and a segment "
                             f"(budget {budget}, unit {unit}, epoch {epoch}, {len(segments)} segments)")
        self.budget, self.unit, self.epoch, self.segments = int(budget), int(unit), int(epoch), list(segments)
        self.schedule = schedule

    @classmethod
    def fixed(cls, total_steps: int, global_batch: int = 1) -> "RunLength":
        """A run of ``total_steps`` steps at one world size (the benchmark's, a test's)."""
        return cls(total_steps * global_batch, global_batch, total_steps * global_batch,
                   [Segment(0, 0, 1, global_batch)])

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def samples_at(self, step: int) -> int:
        """Samples consumed when ``step`` steps are done."""
        seg = self.current
        return seg.samples + (step - seg.step) * seg.global_batch

    def position(self, step: int) -> float:
        """The schedule's position at ``step``, in schedule steps (exactly ``step`` in the first segment)."""
        return self.samples_at(step) / self.unit

    @property
    def schedule_total(self) -> float:
        """The schedule's length in schedule steps (the step count at the first world size)."""
        return self.budget / self.unit

    @property
    def total_steps(self) -> int:
        """The step at which the budget is consumed, to the nearest step of the current segment."""
        seg = self.current
        left = max(0, self.budget - seg.samples)
        return seg.step + (left + seg.global_batch // 2) // seg.global_batch

    def loader_start(self, step: int, rank_batches_per_epoch: int, batches_per_step: int) -> int:
        """Batches a rank's loader has drawn at ``step``: the segment's start at the run's fraction of the
        rank's epoch (0 in the first segment), then ``batches_per_step`` a step."""
        seg = self.current
        base = 0 if len(self.segments) == 1 else seg.samples * rank_batches_per_epoch // self.epoch
        return base + (step - seg.step) * batches_per_step

    def record(self, step: int) -> Dict[str, Any]:
        """What meta.json keeps (``length``), at ``step``."""
        out = {"budget_samples": self.budget, "samples": self.samples_at(step),
               "samples_per_schedule_step": self.unit, "epoch_samples": self.epoch,
               "segments": [s.as_dict() for s in self.segments]}
        if self.schedule is not None:
            out["lr_schedule"] = self.schedule.as_dict()
        return out


def global_batch(cfg, world_size: int) -> int:
    return cfg.data.batch_size * cfg.optim.backward_passes_per_step * world_size


def budget_of(cfg, unit: int, epoch: int) -> int:
    """The config's budget in samples: ``train.steps`` steps of ``unit``, or ``train.epochs`` of the run's
    epoch in whole steps (``int(epochs x steps per epoch)``, at least 1: the step count it always had)."""
    if cfg.train.steps:
        return cfg.train.steps * unit
    return max(1, int(cfg.train.epochs * (epoch // unit))) * unit


def min_steps_per_epoch(shard_slices: Sequence[Sequence[int]], shard_samples: Sequence[int], world_size: int,
                        batch_size: int, passes: int) -> int:
    """The run's steps per epoch at ``world_size`` (the fewest over ranks): what start-up computes from the
    ranks' datasets, here from the manifest's shard counts and the layout's blocks."""
    slices = [LabelSlice(i, a, b) for i, (a, b) in enumerate(shard_slices)]
    layout = RankLayout.from_shards(slices, world_size, list(shard_samples))
    return min(sum(shard_samples[i] for i in block) // batch_size // passes for block in layout.shard_blocks)


def legacy_record(meta: Dict[str, Any], shard_samples: Sequence[int]) -> Dict[str, Any]:
    """The ``length`` of a checkpoint written before it was recorded: one segment at its world size (the one
    that wrote it; ``resharded_from`` when it was re-sharded offline), its ``total_steps`` the budget."""
    cfg = meta["config"]
    batch, passes = cfg["data"]["batch_size"], cfg["optim"]["backward_passes_per_step"]
    world = meta.get("resharded_from", meta["world_size"])
    unit = batch * passes * world
    spe = min_steps_per_epoch(meta["shard_slices"], shard_samples, world, batch, passes)
    return one_segment_record(world, unit, spe, meta["step"], meta["total_steps"])


def one_segment_record(world: int, unit: int, steps_per_epoch: int, step: int, total_steps: int) -> Dict[str, Any]:
    """The ``length`` of a run trained so far at one world size: ``step`` steps of ``unit`` samples, an epoch of
    ``steps_per_epoch`` of them, ``total_steps`` its budget (old checkpoints; an imported run's)."""
    return {"budget_samples": total_steps * unit, "samples": step * unit, "samples_per_schedule_step": unit,
            "epoch_samples": max(1, steps_per_epoch) * unit, "segments": [Segment(0, 0, world, unit).as_dict()]}


def plan(cfg, world_size: int, steps_per_epoch: int, start_step: int = 0,
         resumed: Optional[Dict[str, Any]] = None, log: Callable[[str], None] = lambda m: None) -> RunLength:
    """The run's length at start-up: fresh (``resumed`` None) from the config at this world size, or from a
    checkpoint's ``length`` record continued at this world size (a new segment when it differs), its budget
    from the config (unchanged unless the config extends the run). ``steps_per_epoch``: this world's."""
    g = global_batch(cfg, world_size)
    if resumed is None:
        unit, epoch = g, max(1, steps_per_epoch) * g
        return RunLength(budget_of(cfg, unit, epoch), unit, epoch, [Segment(0, 0, world_size, g)])
    unit, epoch = int(resumed["samples_per_schedule_step"]), int(resumed["epoch_samples"])
    segments: List[Segment] = [Segment(**s) for s in resumed["segments"]]
    samples = int(resumed["samples"])
    budget = budget_of(cfg, unit, epoch)
    schedule = ImportedSchedule(**resumed["lr_schedule"]) if "lr_schedule" in resumed else None
    if schedule is not None and budget != int(resumed["budget_samples"]):   # extended: its decay to the new end
        schedule = replace(schedule, total=budget / schedule.samples_per_step)
    length = RunLength(budget, unit, epoch, segments, schedule)
    if length.current.world_size != world_size or length.current.global_batch != g:
        was = length.current
        length.segments.append(Segment(start_step, samples, world_size, g))
        done = 100.0 * samples / length.budget
        first = segments[0]
        steps_rule = f"; train.steps={cfg.train.steps} counts steps of its first world size " \
                     f"({first.world_size} ranks x {first.global_batch // first.world_size} samples: " \
                     f"{first.global_batch} a step)" if cfg.train.steps else ""
        log(f"resume: {was.world_size} -> {world_size} ranks at step {start_step}, {done:.1f}% of the run's "
            f"{length.budget:,} samples: {length.total_steps - start_step} steps of {g} samples left, the lr "
            f"schedule goes on from there{steps_rule}")
    elif length.samples_at(start_step) != samples:
        raise ValueError(f"the checkpoint's run length says {samples} samples at step {start_step}, its "
                         f"segments {length.samples_at(start_step)}: meta.json is inconsistent")
    return length
