"""``hvd-partialfc simulate --ranks N``: the trainer's method for N virtual ranks in one process.

Each virtual rank is a thread running the unchanged trainer (startup.py, trainer.py) with an ``engine.sim.SimComm``: its
own label slice, loader, backbone copy (so BatchNorm normalises over the rank's own batch, and its running
statistics are the rank's own until a checkpoint or an evaluation averages them), classifier and
optimizers; the backbone gradient is averaged over the virtual ranks; the cross-shard negatives and the
`global` / `replicated` collectives meet in one process. The run folder is a real run's (config,
metrics, checkpoints with every rank's classifier file and digests): ``info``, ``eval``, ``export``,
``reshard`` and ``--resume`` work on it, and a real run can resume it (and the other way round).

One virtual rank computes at a time (engine/sim.py: the baton), with the intra-op threads a real rank would
have on this host (``train.threads`` sets more): the cost is about that of one process training on the
global batch (docs/simulate.md). DataLoader workers are off
(``data.workers`` = 0: N ranks would fork N x workers processes from a threaded process); the loader then
reads in the computing thread. The run's numbers do not depend on it.

The main thread owns the stop signals (SIGTERM, SIGUSR1): every virtual rank sees them
(``preempt.StopSignals``), they agree at the next step, checkpoint and stop, as processes do.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import List, Optional

from ..config import Config
from .watch.preempt import StopSignals
from ..engine.sim import SimComm, SimWorld
from .watch.run_lock import release
from .startup import start_trainer


@dataclass
class SimResult:
    checkpoint: Optional[str]      # the last checkpoint folder written
    stopped_by: Optional[str]      # the stop signal that ended the run early, if one did
    collectives: int               # collectives completed (all ranks)
    final_eval_error: Optional[str] = None   # the last step's evaluation failed (eval.on_error=log): why


class SimFailure(RuntimeError):
    """A virtual rank failed: ``rank`` and ``error`` (the original exception) say which and why."""

    def __init__(self, rank: int, error: BaseException):
        super().__init__(f"rank {rank}: {type(error).__name__}: {error}")
        self.rank, self.error = rank, error


def simulate(cfg: Config, ranks: int) -> SimResult:
    """Train ``cfg`` as ``ranks`` virtual ranks; returns rank 0's result, or raises ``SimFailure``."""
    cfg = copy.deepcopy(cfg)
    cfg.data.workers = 0
    if cfg.checkpoint.memory_every:   # one process: no node to lose, and its threads would share one server
        print(f"simulate: checkpoint.memory_every={cfg.checkpoint.memory_every} is off in the simulator "
              "(one process)", flush=True)
        cfg.checkpoint.memory_every = 0
    world = SimWorld(ranks)
    results: List[Optional[SimResult]] = [None] * ranks

    def run(rank: int) -> None:
        try:
            world.enter(rank)
            trainer = start_trainer(copy.deepcopy(cfg), SimComm(world, rank))
            ckpt = trainer.fit()
            results[rank] = SimResult(ckpt, trainer.stopped_by, 0, trainer.final_evaluation_failed())
        except BaseException as e:   # every rank's error ends the world; the first one is reported
            world.fail(rank, e)
            return
        world.leave(rank)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}", daemon=True) for r in range(ranks)]
    with StopSignals():
        for t in threads:
            t.start()
        world.begin()
        for t in threads:
            t.join()
    release()                   # the run folder's lock (run_lock.py): another job may train into it now
    if world.failure is not None:
        raise SimFailure(world.failed_rank, world.failure)
    out = results[0]
    out.collectives = world.collectives
    return out
