"""A rank's own time a step on the GPU's clock, for the straggler watch (stragglers.py), with no host
synchronisation.

Why not the host's clock: under the torch engine with NCCL, the all-reduce's ``wait`` only makes the compute
stream wait for NCCL's; the host goes on and blocks later, at the step's read of the norms, on a stream that
is stalled for the slowest rank. On the host, every rank's step then lasts as long as the slowest rank's, and
the span less the host-side waits names no one. On the stream it is plain: CUDA events recorded at marks, and
the time between two events is the stream's time between them, work or stall:

* ``start`` .. ``end``: the step (its ``slow`` fault's host work included: the stream idles while the host burns);
* ``wanted`` .. ``arrived``, per batch: the stream's idle while the host waits for the loader (nothing is
  queued between the two marks; zero where the stream still had work queued);
* ``sync0`` .. ``sync1``: the gradient averaging's stall (torch engine: the stream waits for NCCL; Horovod: the
  host blocks in ``synchronize`` and the stream idles), with the averaged gradients' copy-back, a few us.

Own time = the step less the loader and averaging stalls. Events are read when the step's last one has
completed (``query``, which never blocks): a step or two late while the host runs ahead, which the detector's
runs of ``train.straggler_steps`` steps do not notice. At most ``KEEP`` steps wait to be read; older ones are
dropped unread. The periodic collective of the head (cross-shard negatives, every ``head.negatives_every``
steps) stalls inside the step and is counted as work: a stall of every rank alike, by the step's first
microseconds, which the median carries.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Optional, Tuple

KEEP = 8
PAIRS = (("wanted", "arrived"), ("sync0", "sync1"))


def cuda_event() -> Any:
    import torch
    return torch.cuda.Event(enable_timing=True)


class DeviceClock:
    """``begin``, ``mark(name)``..., ``end`` per step (marks outside a step are ignored); ``own()``: the own
    seconds of the newest step whose events completed, or None when none has since the last call.
    ``event`` makes an event with ``record()``, ``query()`` and ``elapsed_time(later)`` (ms): CUDA's by default."""

    def __init__(self, event: Callable[[], Any] = cuda_event):
        self.event = event
        self.current: Optional[List[Tuple[str, Any]]] = None
        self.pending: Deque[List[Tuple[str, Any]]] = deque(maxlen=KEEP)

    def mark(self, name: str) -> None:
        if self.current is None:
            return
        ev = self.event()
        ev.record()
        self.current.append((name, ev))

    def begin(self) -> None:
        self.current = []
        self.mark("start")

    def end(self) -> None:
        if self.current is None:
            return
        self.mark("end")
        self.pending.append(self.current)
        self.current = None

    def own(self) -> Optional[float]:
        newest = None
        while self.pending and self.pending[0][-1][1].query():
            newest = self.pending.popleft()
        return None if newest is None else own_seconds(newest)


def own_seconds(marks: List[Tuple[str, Any]]) -> float:
    """The step's span less its loader and averaging stalls (module docstring), in seconds."""
    def ms(a, b) -> float:
        return a.elapsed_time(b)
    total = ms(marks[0][1], marks[-1][1])
    opened = {}
    for name, ev in marks:
        for first, second in PAIRS:
            if name == first:
                opened[first] = ev
            elif name == second and first in opened:
                total -= ms(opened.pop(first), ev)
    return max(total, 0.0) / 1e3
