"""An agreed eviction of a straggler's node (run/watch/stragglers.py decides it; docs/reliability.md "Stragglers"):
how the node's ranks leave the job, and their exit status.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import List

EXIT_EVICTED = 76      # the evicted node's ranks; its neighbours exit preempt.EXIT_PREEMPTED, restarted without it


@dataclass
class Eviction:
    """The agreed eviction of ``node`` (its ``ranks``) at ``step``; ``mine``: this rank is one of them."""

    step: int
    node: str
    ranks: List[int]
    mine: bool
    nodes_left: int
    where: str = ""          # the snapshot it leaves from (set by trainer.py): node memory, or a checkpoint

    def part(self, comm) -> None:
        """After the agreed snapshot (collectives): the node's ranks ignore SIGTERM, which their agent passes on
        to them once stopped, and every rank agrees that they do (a node's ranks reach this at their own pace:
        its first rank signalling the agent at once could stop a sibling not yet ignoring it); then the node's
        first rank stops its agent (``comm.stop_agent``) and every rank agrees again, so that the others' agents
        restart only once that agent is no longer in the job."""
        if self.mine:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        comm.agree(None, name=f"stragglers.ignore.{self.step}")
        if self.mine:
            comm.stop_agent()
        comm.agree(None, name=f"stragglers.leave.{self.step}")

    def exit_code(self, rank: int) -> int:
        """This rank's line and exit status (cli.py)."""
        from .preempt import EXIT_PREEMPTED
        if self.mine:
            print(f"[rank {rank}] evicted: {self.node} is a straggler; this node leaves the job after the snapshot "
                  f"of step {self.step} ({self.where}); exit {EXIT_EVICTED}", flush=True)
            return EXIT_EVICTED
        print(f"[rank {rank}] {self.node} evicted as a straggler after the snapshot of step {self.step} "
              f"({self.where}); exit {EXIT_PREEMPTED}: torchrun restarts the group on {nodes_text(self.nodes_left)} "
              "from it", flush=True)
        return EXIT_PREEMPTED


def nodes_text(n: int) -> str:
    """``n`` node(s), for the lines."""
    return f"{n} node" + ("s" if n != 1 else "")

