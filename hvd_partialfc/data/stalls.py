"""``data.batch_timeout``: each wait for a batch bounded, a stalled loader named and its workers ended.

Why a signal: a worker that is alive but sends nothing (a read stuck on a stalled file system, a lock held
across the fork) would otherwise hold the job until a collective's timeout, or for ever under Horovod, which
bounds none (docs/engines.md). DataLoader's own ``timeout`` bounds only its queue's poll, and a batch's tensors
are then fetched from the worker that made them (their file descriptors): with that worker stopped, the test of
this hung for ever; a timed wait on the queue has the same gap. A thread that killed the workers instead ended
the wait, but each killed worker's SIGCHLD then raised torch's error wherever the rank was. SIGALRM
(``setitimer``) ends the wait wherever it is.

SIGALRM is the process's, not ours, so the bound borrows it for one wait at a time (``_BorrowedAlarm``): its
handler and timer are there only while ``next()`` waits, never through the step or a checkpoint's write; the
handler and the timer found (someone's alarm, pytest-timeout's) are put back after each wait, the timer with
what remains of it. A timer found that falls due during the wait fires its own handler at its time, and a
SIGALRM sent from outside goes to that handler too: only our own deadline becomes the stall. Signals reach
the main thread alone, so every wait checks that it is there (an iterator can be handed to another thread
after its first batch); elsewhere the wait is refused, never silently left unbounded.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Iterator, List, Optional, Tuple

# An alarm is taken as due this early: the timer never fires before its time, and this absorbs the rounding
# between time.monotonic() and setitimer's microseconds.
_SLACK_S = 1e-3

_STATES = {"D": "in uninterruptible I/O (D: a stalled disk or network file system)", "T": "stopped (T)",
           "t": "stopped by a debugger (t)", "S": "sleeping (S)", "R": "running (R)", "Z": "a zombie (Z)"}


class LoaderStalled(RuntimeError):
    """No batch from the rank's loader workers within ``data.batch_timeout``."""


class _Expired(BaseException):
    """Our deadline's SIGALRM: a batch's wait ran over (a BaseException: no ``except Exception`` on the way
    swallows it)."""


def _pass_on(handler, signum: int, frame) -> None:
    """Give a SIGALRM that is not ours to the handler found: call it, or do what SIG_DFL would have done (end
    the process, as it would have ended without us); SIG_IGN drops it."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


class _BorrowedAlarm:
    """One wait's hold on SIGALRM (a context manager around ``next()``): our handler, and ITIMER_REAL armed for
    the nearer of our deadline and the found timer's next expiry; on leaving, the found handler and what is left
    of the found timer (its interval kept). Main thread only (the caller checks)."""

    def __init__(self, timeout: float):
        self.previous = signal.getsignal(signal.SIGALRM)
        if self.previous is None:   # installed by C code: Python could not put it back
            raise RuntimeError("data.batch_timeout: SIGALRM's handler was installed outside Python, so it could "
                               "not be put back after a wait; set data.batch_timeout=0")
        now = time.monotonic()
        self.deadline = now + timeout
        delay, self.interval = signal.getitimer(signal.ITIMER_REAL)
        self.found: Optional[float] = now + delay if delay > 0 else None   # the found timer's next expiry
        self.closing = False

    def _arm(self) -> None:
        due = self.deadline if self.found is None else min(self.deadline, self.found)
        signal.setitimer(signal.ITIMER_REAL, max(due - time.monotonic(), 1e-6))

    def _on_alarm(self, signum, frame) -> None:
        now = time.monotonic()
        theirs = self.found is not None and now >= self.found - _SLACK_S
        if theirs:
            self.found = self.found + self.interval if self.interval > 0 else None
        ours = now >= self.deadline - _SLACK_S
        if not ours and not self.closing:
            self._arm()                      # the next of the two
        if theirs or not ours:               # the found timer's, or one sent from outside
            _pass_on(self.previous, signum, frame)
        if ours and not self.closing:        # once the batch is here, a deadline met on the way out is not a stall
            raise _Expired()

    def __enter__(self) -> "_BorrowedAlarm":
        signal.signal(signal.SIGALRM, self._on_alarm)
        self._arm()
        return self

    def __exit__(self, *exc) -> None:
        self.closing = True
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)   # an alarm still pending runs first (its handler may raise)
        finally:
            if signal.getsignal(signal.SIGALRM) != self.previous:
                signal.signal(signal.SIGALRM, self.previous)
            if self.found is not None:
                signal.setitimer(signal.ITIMER_REAL, max(self.found - time.monotonic(), 1e-6), self.interval)


def _workers() -> List[Tuple[int, str]]:
    """This process's multiprocessing children (while it trains: the loader's workers) and their kernel states."""
    import multiprocessing
    out = []
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        out.append((child.pid, f"pid {child.pid} {_STATES.get(state, state)}"))
    return out


def _end_workers(rank: int, timeout: float) -> str:
    """The stall's line, after SIGKILL to every worker: Python joins its children at exit, which a stopped worker
    would hold for ever (SIGKILL ends a stopped process at once, one in a killable wait, NFS's, when the wait
    returns). torch's SIGCHLD handler is set aside first: it would raise its own error for each killed worker
    wherever this rank then is, its error report included (seen in the test of this)."""
    workers = _workers()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid, _ in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return (f"rank {rank}: no batch from its loader workers in {timeout:g} s (data.batch_timeout); workers: "
            f"{'; '.join(w for _, w in workers) or 'none alive'} (killed). A worker is stuck (a stalled file "
            "system, a deadlock): this rank stops, so the job ends or restarts from its last checkpoint instead "
            "of waiting; if one batch can really take this long, raise data.batch_timeout")


def named_stalls(batches: Iterator, rank: int, timeout: float) -> Iterator:
    """``batches`` (a DataLoader's iterator), each wait for one bounded by ``timeout`` seconds (0: none; the
    trainer passes 0 without workers, as ``simulate``'s threaded ranks have). A wait that runs over kills the
    workers and raises ``LoaderStalled`` naming them; a wait from a thread other than the main one is refused."""
    if timeout <= 0:
        yield from batches
        return
    while True:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                f"rank {rank}: data.batch_timeout bounds each wait for a batch with SIGALRM, which only the main "
                f"thread receives, and this wait is in thread {threading.current_thread().name!r}: iterate the "
                "loader in the main thread, or set data.batch_timeout=0")
        try:
            with _BorrowedAlarm(timeout):
                item = next(batches)
        except StopIteration:
            return
        except _Expired:
            raise LoaderStalled(_end_workers(rank, timeout)) from None
        yield item
