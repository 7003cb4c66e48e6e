"""An agreed eviction of a straggler's node (run/watch/stragglers.py decides it; docs/reliability.md "Stragglers"):
which node goes, how its ranks leave the job, and their exit status.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

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


def off_the_store(f, named: Sequence, node_of: Sequence[int],
                  store_node: Optional[int]) -> Tuple[Optional[Any], str]:
    """The finding whose node is evicted for the new finding ``f``, and the line that says why not ``f``'s ("":
    ``f``'s own). Not a node that serves torchrun's rendezvous store (``store_node``, a node index; None: no node
    does, or none was found): with its agent gone the other agents cannot re-form the group, and the job ends.
    Then the slowest of the other ``named`` ranks (own time over median) off that node, or none."""
    if store_node is None or node_of[f.rank] != store_node:
        return f, ""
    others = [g for g in named if node_of[g.rank] != store_node]
    pick = max(others, key=lambda g: g.own_s / g.median_s, default=None)
    instead = (f"evicting {pick.node} instead, the next slowest (rank {pick.rank}, "
               f"{pick.own_s / pick.median_s:.2f}x)" if pick else "no other straggler to evict")
    return pick, (f"step {f.step}: {f.node} not evicted: it serves torchrun's rendezvous store (the job ends "
                  f"without it); {instead}")
