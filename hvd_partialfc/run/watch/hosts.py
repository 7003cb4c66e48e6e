"""Hosts added to or removed from a running job by its launcher (horovodrun's elastic mode: its discovery script):
a part of the loop's vote (engine/vote.py). The driver tells rank 0's process (``comm.hosts_changed``); the vote
tells every rank, which all checkpoint at the same step and end the attempt; cli_train.py then re-forms the group
in the same processes (the newcomer joins it, a removed host's ranks leave it) and resumes that checkpoint at the
new size. No slot under the other launchers: their votes are unchanged. Not a collective.
"""
from __future__ import annotations

from ...engine.vote import Slot


class HostChanges:
    """``due`` at the step after the vote that carried the driver's notice (never at the last step: the run ends
    there anyway)."""

    def __init__(self, comm):
        self.comm = comm
        self.slots = (Slot("hosts"),) if comm.reformable() else ()
        self.changed = False

    def cast(self, ballot, done: int) -> None:     # (a part without slots is left out of the vote)
        ballot.put("hosts", self.comm.hosts_changed())

    def heard(self, agreed, done: int) -> None:
        self.changed = agreed.flag("hosts")

    def due(self, done: int, final: bool) -> bool:
        return self.changed and not final
