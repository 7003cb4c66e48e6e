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
                       written, its buddy's not sent): the previous snapshot must be the one recovered;
* ``hang-worker``      SIGSTOP to the rank's loader workers before step STEP+1 (a worker alive but stuck, as on
                       a stalled file system: ``data.batch_timeout`` must end the rank, naming them);
* ``slow``             from step STEP+1 on, each step takes ``HVD_PARTIALFC_SLOW_FACTOR`` (F, default 2) times
                       the rank's own work: after its step the rank works (small matrix products on its own
                       thread) for F - 1 times that step's own time (run/watch/stragglers.py measures it; on the CPU,
                       CPU time), so it reaches the next collective late, as a throttled GPU's rank does. Work,
                       not a pause.

Faults fire in the first attempt of an elastic job only (``restart_count() == 0``): the restarted group,
resumed from a checkpoint before STEP, must not meet the same fault again. Except ``slow``: a slow machine
stays slow when its job restarts.

``HVD_PARTIALFC_FAULT_FILE`` names a file of more entries, read again whenever it changes (its mtime): a fault
started from outside a running job, at no planned step (the chaos run's slow node: ``slow@0`` written while
it trains, the file removed to end it).

Unset (the normal case), every check is two dictionary lookups.
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional, Tuple

ENV = "HVD_PARTIALFC_FAULT"
FILE_ENV = "HVD_PARTIALFC_FAULT_FILE"
KINDS = ("raise", "kill", "sigterm", "sigint", "stall", "pause-after-ckpt", "pause-in-ckpt", "kill-in-memory", "slow",
         "hang-worker")
SLOW_FACTOR = "HVD_PARTIALFC_SLOW_FACTOR"


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


_FILE = {"key": None, "text": ""}    # the fault file's (path, mtime) as last read, and its entries


def _entries() -> List[Tuple[str, int, Optional[int]]]:
    """The entries of ``HVD_PARTIALFC_FAULT`` and of the file ``HVD_PARTIALFC_FAULT_FILE`` names (none: [])."""
    text, path = os.environ.get(ENV, ""), os.environ.get(FILE_ENV)
    if path:
        try:
            key = (path, os.stat(path).st_mtime_ns)
        except OSError:
            key = (path, None)
        if key != _FILE["key"]:
            try:
                with open(path) as f:
                    _FILE["text"] = f.read().replace("\n", ",")
            except OSError:
                _FILE["text"] = ""
            _FILE["key"] = key
        text = f"{text},{_FILE['text']}"
    return _parse(text) if text else []


def _configured() -> bool:
    """Whether any fault is given (the normal case: none, and every check ends here)."""
    return ENV in os.environ or FILE_ENV in os.environ


_REFORMED = [0]   # times this process's group re-formed in it (cli_train.py): later attempts of the same job


def note_reformed() -> None:
    """The group re-formed in this process (cli_train.py): what follows is a later attempt."""
    _REFORMED[0] += 1


def restart_count() -> int:
    """Which attempt of an elastic job this process belongs to: torchrun's ``TORCHELASTIC_RESTART_COUNT``,
    or ``HVD_PARTIALFC_RESTART_COUNT`` (set by launch/horovod_restarts.py), plus the group's re-formings in
    this process; 0 outside them."""
    return _REFORMED[0] + int(os.environ.get("TORCHELASTIC_RESTART_COUNT")
                              or os.environ.get("HVD_PARTIALFC_RESTART_COUNT") or 0)


def active(kind: str, step: int, rank: int) -> bool:
    if not _configured() or restart_count() > 0:   # the first attempt only
        return False
    return any(k == kind and s == step and (r is None or r == rank) for k, s, r in _entries())


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
    if active("hang-worker", step, rank):
        import multiprocessing
        pids = [c.pid for c in multiprocessing.active_children()]
        print(f"[rank {rank}] injected hang-worker before step {step + 1}: SIGSTOP to {pids}", flush=True)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)


def slow_work(step: int, rank: int, own_s: float) -> None:
    """``slow`` (see the module's docstring): after step ``step + 1``, whose own time was ``own_s`` seconds,
    work for F - 1 times that (this thread's CPU time) when the fault is on for this rank."""
    if not _configured() or not any(
            k == "slow" and step >= s and (r is None or r == rank) for k, s, r in _entries()):
        return
    import torch
    end = time.thread_time() + (float(os.environ.get(SLOW_FACTOR, "2")) - 1.0) * own_s
    a = torch.full((96, 96), 1.0 / 96)      # a @ a == a: the same work every product, no overflow
    while time.thread_time() < end:
        a = a @ a


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
