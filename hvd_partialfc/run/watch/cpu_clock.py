"""A CPU rank's own time a step, for the straggler watch (stragglers.py): the step's CPU time of the rank's thread,
stretched by how long that thread has lately waited, runnable, for a CPU (Linux's run-queue delay, the second
field of ``/proc/thread-self/schedstat``).

Why the wait: CPU time alone sees a rank slowed by more work (a slower core) but not one slowed by less CPU.
Measured on two nodes, one put under a 25% CPU quota: every step 3.9x slower (80.7 -> 311 ms), its CPU time a
step only 1.15x. The run-queue delay is the rest: it grows while another process holds the thread's core and
while a cgroup's quota throttles it (checked here: a thread burning 0.3 CPU-s waited 0.31 s beside a busy
process on its core, 0.92 s under a 25% ``cpu.cfs_quota_us``). A wait that blocks (a collective, the loader's
queue) is neither: a blocked thread is not runnable. A wait that spins (Horovod's: sched_yield until the collective
is done) is both, and is left out (``CpuClock``'s ``inside``).

Why a share over about ``TAU`` seconds and not the step's own wait: other processes take a core for tens of ms
to seconds at a time (the scheduler's slices and balancing, other jobs), so with steps of a few ms a healthy rank
waits for several steps in a row while its peer does not. Measured on this 2-core machine beside other jobs
(load 3 to 10), 2 ranks (torchrun, 2 agents), 300-400 clean steps of 5-7 ms CPU, 4 runs, 2 of them with 2
loader workers a rank: the step's CPU time plus its own wait stood at 1.40-1.50x the lower median (slowest rank,
median step) and named a healthy rank in 2 of the 4 runs at ``train.straggler_steps=10``. With a 2 s memory the
same runs named none, but scripts/studies/stragglers.py's clean 2-node runs still did (2 in 3: 1.71x, 2.48x, a
rank held to a third of a core for some seconds by the machine's other jobs); hence 10 s. The first ``SETTLE``
second gives no share: a few steps' waits would decide it, and the loader workers start then.

Why against the ranks' median share (``stretch``): the job's own ranks and loader workers on shared cores make
every rank wait, and a rank slowed by more work makes the others wait for the core it holds: with each rank's
own wait counted, a node at half speed (the ``slow`` fault, 3 nodes on 2 cores) was named 112 steps late, not
after 12. The median's wait is the job's; a rank is stretched only by what it waits beyond it, and never
shrunk (the slow one, which waits least, keeps its CPU time). The step's CPU time itself stays per step, so
more work shows at once.

Where the file is absent (not Linux, a kernel without scheduler statistics) the wait reads 0 and the clock is
the CPU time alone (``fallback`` says why; the watch says it in one line): more work is seen, less CPU is not.
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

PATH = "/proc/thread-self/schedstat"
TAU = 10.0     # seconds: the wait share's memory (the module's docstring)
SETTLE = 1.0   # seconds of steps timed before the share counts


class _Open:
    """A thread's schedstat, open for the thread's life (read with pread: 2 us, against 22 to open and read);
    closed when the thread ends and its ``threading.local`` goes."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def __del__(self):
        os.close(self.fd)


_mine = threading.local()


def _fd(path: Optional[str]) -> Optional[int]:
    """The calling thread's schedstat (the file stays its opener's thread's, whoever reads it)."""
    path = path or PATH
    got = getattr(_mine, "open", None)
    if got is None or got.path != path:
        try:
            _mine.open = got = _Open(path, os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None
    return got.fd


def fallback(path: Optional[str] = None) -> Optional[str]:
    """None where the run-queue delay can be read; else why not, in a few words."""
    fd = _fd(path)
    if fd is None:
        return f"{path or PATH} is absent"
    return None if _read(fd) is not None else f"{path or PATH} does not read as 'run_ns delay_ns slices'"


def _read(fd: int) -> Optional[int]:
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None


def read(path: Optional[str] = None) -> Tuple[float, float]:
    """The calling thread's seconds on a CPU and seconds runnable without one, since it started (0 where schedstat
    cannot be read). The CPU time is ``thread_time``'s: schedstat's first field is the running thread's time as of
    its last scheduler update, up to a tick (4 ms) behind; the wait is final by the time the thread runs."""
    fd = _fd(path)
    waited = _read(fd) if fd is not None else None
    return time.thread_time(), (waited or 0) / 1e9


class CpuClock:
    """One thread's time a step: ``start()`` before it, ``step()`` after it (once a step). ``ran()``: the CPU
    seconds since ``start`` (what a slower core multiplies: faults.py's ``slow``). ``read`` and ``now``: the
    thread's (ran, waited) seconds and the wall clock; ``inside``: the part of ``read`` spent so far in waits for
    the other ranks (the engine's ``wait_used``), left out of both: Horovod's wait spins (sched_yield until the
    collective is done), so a rank that waits for a slower one spends CPU time there, and run-queue delay when
    the core is busy; read with them, the rank that waits most looked the slowest (seed 6262 under horovodrun:
    a healthy rank named at 2-3x, its extra CPU time a step all inside ``synchronize``)."""

    def __init__(self, tau: float = TAU, settle: float = SETTLE, read: Callable[[], Tuple[float, float]] = read,
                 now: Callable[[], float] = time.perf_counter,
                 inside: Callable[[], Tuple[float, float]] = lambda: (0.0, 0.0)):
        self.tau, self.settle, self.read, self.now, self.inside = tau, settle, read, now, inside
        self.ran_sum = self.waited_sum = 0.0      # time-decayed sums over about the last ``tau`` seconds
        self.at: Tuple[float, float] = (0.0, 0.0)
        self.first: Optional[float] = None
        self.last: Optional[float] = None

    def _own(self) -> Tuple[float, float]:
        """The thread's (ran, waited) seconds outside the waits for the other ranks."""
        (ran, waited), (ran_in, waited_in) = self.read(), self.inside()
        return ran - ran_in, waited - waited_in

    def start(self) -> None:
        self.at = self._own()
        if self.first is None:
            self.first = self.now()

    def ran(self) -> float:
        return self._own()[0] - self.at[0]

    def step(self) -> Tuple[float, float]:
        """After the step: its CPU seconds, and the thread's recent share (seconds waited for a CPU per second run,
        summed over about ``tau`` seconds; 0 in the first ``settle`` seconds: a few steps' waits, the loader
        workers' start)."""
        ran, waited = (b - a for a, b in zip(self.at, self._own()))
        now = self.now()
        keep = 0.0 if self.last is None else math.exp(-(now - self.last) / self.tau)
        self.last = now
        self.ran_sum = self.ran_sum * keep + ran
        self.waited_sum = self.waited_sum * keep + max(waited, 0.0)
        if self.ran_sum <= 0 or self.first is None or now - self.first < self.settle:
            return ran, 0.0
        return ran, self.waited_sum / self.ran_sum


def stretch(times: Sequence[float], shares: Sequence[float]) -> List[float]:
    """Every rank's own time: its CPU time a step, times (1 + its share) / (1 + the ranks' lower median share)
    where that is above 1. Against the median: the job's own ranks and workers on shared cores, and the wait a
    slow rank's work makes the others' work wait, are in every rank's share (the ranks that waited for the slow
    one's core are the median, and the slow one, which waits least, keeps its CPU time); what one rank waits
    beyond the others is its own."""
    ref = 1.0 + sorted(shares)[(len(shares) - 1) // 2] if shares else 1.0
    return [t * max(1.0, (1.0 + s) / ref) for t, s in zip(times, shares)] if len(shares) == len(times) else list(times)
