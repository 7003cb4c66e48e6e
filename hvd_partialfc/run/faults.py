"""Fault injection, for the reliability tests and for rehearsing failures on a real cluster.

``HVD_PARTIALFC_FAULT`` holds comma-separated ``KIND@STEP`` or ``KIND@STEP:RANK`` entries (no rank: all
ranks). STEP counts completed optimizer steps. Kinds:

* ``raise``            raise an exception before step STEP+1 (a crash in Python code on that rank);
* ``kill``             SIGKILL the rank's own process before step STEP+1 (a lost node, an OOM kill);
* ``sigterm``          SIGTERM to the rank's own process before step STEP+1 (a scheduler's preemption at a
                       known step: the stop vote it starts is read after step STEP+2, whose checkpoint
                       is the unscheduled one a preemption writes);
* ``sigint``           SIGINT to the rank's own process before step STEP+1 (a user's Ctrl-C: KeyboardInterrupt,
                       no checkpoint; memory snapshots must stay for the restart);
* ``stall``            the main thread sleeps ``HVD_PARTIALFC_STALL_SECONDS`` (default 30) before step STEP+1
                       (a long evaluation or checkpoint write: the other ranks wait in a collective);
* ``pause-after-ckpt`` sleep forever right after the checkpoint of step STEP is complete;
* ``pause-in-ckpt``    sleep forever in the middle of writing the checkpoint of step STEP (rank files
                       written, ``meta.json`` not yet, ``latest`` not moved): a kill then must leave the
                       previous checkpoint valid;
* ``kill-in-memory``   SIGKILL the rank in the middle of the memory snapshot of step STEP (its own copy
                       written, its buddy's not sent): the previous snapshot must be the one recovered.

Faults fire in the first attempt of an elastic job only (``restart_count() == 0``): the restarted group,
resumed from a checkpoint before STEP, must not meet the same fault again.

Unset (the normal case), every check is one dictionary lookup.
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional, Tuple

ENV = "HVD_PARTIALFC_FAULT"
KINDS = ("raise", "kill", "sigterm", "sigint", "stall", "pause-after-ckpt", "pause-in-ckpt", "kill-in-memory")


class InjectedFault(RuntimeError):
    pass


def _parse(text: str) -> List[Tuple[str, int, Optional[int]]]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"{ENV}: bad entry {item!r} (expected KIND@STEP[:RANK], KIND one of {', '.join(KINDS)})")
        out.append((kind, int(step), int(rank) if rank else None))
    return out


def restart_count() -> int:
    """Which attempt of an elastic job this process belongs to: torchrun's ``TORCHELASTIC_RESTART_COUNT``,
    or ``HVD_PARTIALFC_RESTART_COUNT`` (set by launch/horovod_restarts.py); 0 outside them."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("HVD_PARTIALFC_RESTART_COUNT") or 0)


def active(kind: str, step: int, rank: int) -> bool:
    text = os.environ.get(ENV)
    if not text or restart_count() > 0:    # faults are injected in the first attempt only (see the docstring)
        return False
    return any(k == kind and s == step and (r is None or r == rank) for k, s, r in _parse(text))


def before_step(step: int, rank: int) -> None:
    """Called by the loop before each step with the number of steps completed."""
    for kind in ("raise", "kill"):
        if active(kind, step, rank):   # a marker with the time: tests measure from it (a bound that held
            # the launch's start-up flaked on slow machines)
            print(f"[rank {rank}] injected {kind} before step {step + 1} at {time.time():.3f}", flush=True)
            if kind == "raise":
                raise InjectedFault(f"injected failure on rank {rank} before step {step + 1} ({ENV})")
            kill_self()
    for kind, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
        if active(kind, step, rank):
            os.kill(os.getpid(), sig)
    if active("stall", step, rank):
        time.sleep(float(os.environ.get("HVD_PARTIALFC_STALL_SECONDS", "30")))


def kill_self(what: str = "", rank: Optional[int] = None) -> None:
    """SIGKILL this process (a lost node: no handler, no cleanup runs), saying ``what`` first."""
    if what:
        print(f"[rank {rank}] injected {what} at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def pause(kind: str, step: int, rank: int) -> None:
    if active(kind, step, rank):
        print(f"[rank {rank}] {kind} at step {step}: pausing ({ENV})", flush=True)
        while True:
            time.sleep(60)
