"""How the speed stage (gpu_speed_check.py) runs one cell inside the GPU call's one deadline: whether it may start,
the limit it runs under, and what is recorded when it ends otherwise than with a result.

A cell starts only while its estimate fits both the stage's budget and the deadline. Its limit is
``CELL_LIMIT_FACTOR`` times its estimate, at least ``CELL_FLOOR_S``, never past the deadline: an estimate is
a guess until the first GPU run replaces it, and a cell that hangs or fails slowly must not spend the
call's time on the cells after it. The limit is kept in this process by SIGALRM (the cells are ours: nothing
else here arms a timer) and by the timeout of the cell's own subprocesses (``left()``).

What a cell ends as: ``ok`` (its result), ``oom`` (out of device memory: the cell's parts are freed by the
caller and the next cell starts), ``timeout`` (cut at its limit), ``failed`` (any other error, with its
traceback), or ``skipped`` before it starts (the budget or the deadline: with the command that runs it alone).
"""
from __future__ import annotations

import math
import signal
import subprocess
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

import torch

CELL_FLOOR_S = 60.0
CELL_LIMIT_FACTOR = 4.0


class CellTimeout(Exception):
    """The running cell reached its limit."""


class CellClock:
    """The one deadline (``time.time()`` seconds; ``math.inf``: none) and the running cell's end."""

    def __init__(self, deadline: Optional[float] = None):
        self.deadline = math.inf if deadline is None else deadline
        self.end = self.deadline

    def limit(self, cost: float) -> float:
        """The seconds a cell estimated at ``cost`` may run from now."""
        return min(max(CELL_FLOOR_S, CELL_LIMIT_FACTOR * cost), self.deadline - time.time())

    def left(self) -> float:
        """The running cell's seconds to its end (a subprocess's timeout): at least 1."""
        return max(1.0, self.end - time.time())


@contextmanager
def cut_after(seconds: float) -> Iterator[None]:
    """CellTimeout in this (the main) thread after ``seconds``; the handler and timer found are put back."""
    if math.isinf(seconds):
        yield
        return

    def expire(signum, frame):
        raise CellTimeout(f"past its limit of {seconds:.0f} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def why_not_start(name: str, cost: float, used: float, budget: float, clock: CellClock) -> Optional[str]:
    """The reason a cell estimated at ``cost`` may not start (``used`` of ``budget`` seconds spent), or None."""
    rerun = f"; run it alone with python -m scripts.gpu.gpu_speed_check WORK OUT --only {name}"
    if used + cost > budget:
        return f"budget: {used:.0f} s used of {budget:.0f}, about {cost} s needed{rerun}"
    if time.time() + cost > clock.deadline:
        return f"deadline: {clock.deadline - time.time():.0f} s left of the call, about {cost} s needed{rerun}"
    return None


def run_cell(name: str, cost: float, fn: Callable[[], Any], clock: CellClock) -> Dict[str, Any]:
    """Run one cell under its limit; its record (name, status, result or error, seconds)."""
    limit = clock.limit(cost)
    clock.end = time.time() + limit
    c0 = time.perf_counter()
    try:
        with cut_after(limit):
            cell = {"name": name, "status": "ok", "result": fn()}
    except (CellTimeout, subprocess.TimeoutExpired) as e:
        cell = {"name": name, "status": "timeout", "error": f"cut at its limit of {limit:.0f} s ({type(e).__name__})"}
    except torch.cuda.OutOfMemoryError as e:
        cell = {"name": name, "status": "oom", "error": f"out of memory: {' '.join(str(e).split())[:300]}"}
    except Exception as e:
        cell = {"name": name, "status": "failed", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:]}
    cell["seconds"] = time.perf_counter() - c0
    cell["limit_s"] = limit
    clock.end = clock.deadline
    return cell
