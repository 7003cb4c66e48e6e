"""``data.batch_timeout`` borrows SIGALRM for each wait alone (data/stalls.py): a timer armed before it still fires
at its time, a SIGALRM outside its deadline reaches the handler that was there, a wait from another thread is
refused, and a stuck wait still ends as a named stall. Fake batch iterators (no workers): the signal handling is
what is under test; the real stopped worker under horovodrun is test_train_multirank.py's."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hvd_partialfc.data import stalls
from hvd_partialfc.data.stalls import LoaderStalled, named_stalls


@pytest.fixture
def found():
    """A SIGALRM handler of the test's own (the times it ran, in ``found.fired``), installed before iterating;
    pytest-timeout's handler and timer (its signal method) put back after the test."""
    handler, (delay, interval), t0 = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL), \
        time.monotonic()

    def record(signum, frame):
        record.fired.append(time.monotonic())
    record.fired = []
    signal.signal(signal.SIGALRM, record)
    yield record
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, handler)
    if delay > 0:
        signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - t0), 1e-3), interval)


def waits(*seconds):
    """Batches that each take their time to come (the wait is inside ``next``)."""
    for i, s in enumerate(seconds):
        time.sleep(s)
        yield i


def test_a_timer_armed_before_fires_at_its_time_during_a_wait_and_after_one(found):
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.15)          # due in the middle of the first wait
    batches = named_stalls(waits(0.3, 0.05), rank=0, timeout=5)
    assert next(batches) == 0
    assert len(found.fired) == 1 and 0.15 <= found.fired[0] - t0 < 0.28, [f - t0 for f in found.fired]
    assert signal.getsignal(signal.SIGALRM) is found and signal.getitimer(signal.ITIMER_REAL) == (0, 0)
    t1 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 0.15)          # armed in a step, due in the next step
    assert next(batches) == 1                           # a 0.05 s wait
    assert 0.05 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.1    # what is left of it, still armed
    time.sleep(0.2)
    assert len(found.fired) == 2 and 0.15 <= found.fired[1] - t1 < 0.25, [f - t1 for f in found.fired]


def test_a_sigalrm_outside_the_deadline_goes_to_the_handler_found_and_ends_no_wait(found):
    def sends_one():
        yield 0
        os.kill(os.getpid(), signal.SIGALRM)            # during a wait: someone else's signal
        time.sleep(0.01)
        yield 1
    batches = named_stalls(sends_one(), rank=0, timeout=5)
    assert next(batches) == 0
    os.kill(os.getpid(), signal.SIGALRM)                # during the step
    time.sleep(0.01)
    assert len(found.fired) == 1
    assert next(batches) == 1 and len(found.fired) == 2
    assert signal.getsignal(signal.SIGALRM) is found


def test_a_wait_from_another_thread_is_refused(found):
    started = named_stalls(waits(0, 0), rank=3, timeout=5)
    assert next(started) == 0                           # its first wait in the main thread
    errors = []

    def wait(batches):
        try:
            next(batches)
        except RuntimeError as e:
            errors.append(str(e))
    for batches in (named_stalls(waits(0), rank=3, timeout=5), started):
        t = threading.Thread(target=wait, args=(batches,), name="elsewhere")
        t.start()
        t.join(5)
    assert len(errors) == 2 and all(
        e == "rank 3: data.batch_timeout bounds each wait for a batch with SIGALRM, which only the main thread "
             "receives, and this wait is in thread 'elsewhere': iterate the loader in the main thread, or set "
             "data.batch_timeout=0" for e in errors), errors
    assert signal.getsignal(signal.SIGALRM) is found and not found.fired


def test_a_stuck_wait_still_ends_as_a_named_stall(found, monkeypatch):
    monkeypatch.setattr(stalls, "_workers", lambda: [])   # no worker to kill here (this process's are pytest's)
    chld = signal.getsignal(signal.SIGCHLD)
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, 30)            # a timer found, far off
    try:
        with pytest.raises(LoaderStalled, match=r"^rank 2: no batch from its loader workers in 0\.2 s "
                                                r"\(data\.batch_timeout\); workers: none alive \(killed\)"):
            list(named_stalls(waits(0, 30), rank=2, timeout=0.2))
    finally:
        signal.signal(signal.SIGCHLD, chld)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    assert signal.getsignal(signal.SIGALRM) is found and not found.fired
    assert 28 < signal.getitimer(signal.ITIMER_REAL)[0] <= 29.8
