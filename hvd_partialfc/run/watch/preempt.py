"""Stop requests from the scheduler: SIGTERM (Slurm preemption, cloud spot reclaim, ``scancel``) and SIGUSR1
(Slurm's ``--signal=USR1@SECONDS`` ahead of the time limit). Not a collective; no Horovod.

A handler only records the signal; it rides in the loop's per-step vote (engine/vote.py: the slot ``stop``, a max
over ranks), so every rank stops at the same step, writes a checkpoint together and exits ``EXIT_PREEMPTED``. A
signal that reaches one rank only (a node's agent, a test) is enough.
DataLoader workers forked while the handler is installed inherit it and keep running, so the step that
is in flight when the signal comes completes.

Handlers can only be installed in the main thread. In another thread (the simulator's virtual ranks,
``simulate.py``) nothing is installed, and ``received`` reports what the main thread's active StopSignals
received: a signal to the simulator reaches every virtual rank, which then agree on it like processes.
"""
from __future__ import annotations

import signal
import threading
from typing import Dict, Optional

from ...engine.vote import Slot

SIGNALS = ("SIGTERM", "SIGUSR1")
EXIT_PREEMPTED = 75   # EX_TEMPFAIL: "try again later"; launch/slurm_horovod.sbatch requeues the job on it


class StopSignals:
    """Context manager: installs the handlers on entry (main thread only), restores the old ones on exit. A part
    of the loop's vote: ``due`` once any rank received a stop signal."""

    _main: Optional["StopSignals"] = None   # the main thread's, while it is entered
    slots = (Slot("stop"),)

    def __init__(self):
        self._received: Optional[str] = None
        self._old: Dict[int, object] = {}
        self._in_main = False
        self.requested = False      # the vote said some rank received one

    def cast(self, ballot, done: int) -> None:
        ballot.put("stop", self.received is not None)

    def heard(self, agreed, done: int) -> None:
        self.requested = agreed.flag("stop")

    def due(self, done: int, final: bool) -> bool:
        return self.requested

    @property
    def stopped_by(self) -> str:
        """What stopped the run, in words: this rank's signal, or another rank's."""
        return self.received or "a stop signal on another rank"

    @property
    def received(self) -> Optional[str]:
        """The name of the first stop signal received (in another thread: the main thread's), or None."""
        main = StopSignals._main
        if self._received is None and not self._in_main and main is not None:
            return main._received
        return self._received

    def _handle(self, signum, frame) -> None:
        if self._received is None:
            self._received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._in_main = True
            for name in SIGNALS:
                sig = getattr(signal, name)
                self._old[sig] = signal.signal(sig, self._handle)
            StopSignals._main = self
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if StopSignals._main is self:
            StopSignals._main = None
