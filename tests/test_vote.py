"""The loop's per-step vote (engine/vote.py): named slots, a flag any rank raises is every rank's, a per-rank slot
gives each rank its place, parts hear the answer a step later, and a slot name is declared once."""
from __future__ import annotations

import pytest

from hvd_partialfc.engine.vote import Slot, StepVote


class Bus:
    """Three ranks' votes met by hand: ``result`` is the elementwise max of what every rank started (the engines'
    ``vote_async``, computed here without them)."""

    def __init__(self, size):
        self.size, self.started = size, {}

    def comm(self, rank):
        bus = self

        class Comm:
            def __init__(self):
                self.rank, self.size = rank, bus.size

            def vote_async(self, flags, name):
                bus.started[rank] = (name, list(flags))

                class Pending:
                    def result(self):
                        assert len(bus.started) == bus.size and {n for n, _ in bus.started.values()} == {name}
                        return [max(v[i] for _, v in bus.started.values()) for i in range(len(flags))]
                return Pending()
        return Comm()


class Part:
    def __init__(self, rank, slots, cast):
        self.rank, self.slots, self._cast, self.heard_at = rank, slots, cast, []

    def cast(self, ballot, done):
        for name, value in self._cast(self.rank, done).items():
            ballot.put(name, value)

    def heard(self, agreed, done):
        self.heard_at.append((done, agreed))


def test_slots_are_read_by_name_a_flag_is_everyones_and_each_rank_has_its_place():
    bus = Bus(3)
    stops = [Part(r, (Slot("stop"),), lambda r, done: {"stop": r == 1}) for r in range(3)]
    times = [Part(r, (Slot("evict"), Slot("times", per_rank=True)),
                  lambda r, done: {"evict": 2.0 if r == 0 else 0.0, "times": 0.1 * (r + 1) + done})
             for r in range(3)]
    quiet = [Part(r, (), lambda r, done: {}) for r in range(3)]        # no slots: not in the vote
    votes = [StepVote(bus.comm(r), [stops[r], quiet[r], times[r]]) for r in range(3)]
    assert votes[0].length == 1 + 1 + 3 and quiet[0] not in votes[0].parts
    assert all(v.read(5) is None for v in votes)                        # nothing in flight: nobody hears
    for v in votes:
        v.start(5)
    answers = [v.read(6) for v in votes]
    for r, agreed in enumerate(answers):
        assert agreed.flag("stop") and agreed.value("evict") == 2.0          # rank 1's stop, rank 0's eviction
        assert agreed.per_rank("times") == pytest.approx([5.1, 5.2, 5.3])   # every rank's, at its place
        assert stops[r].heard_at == [(6, agreed)] and times[r].heard_at == [(6, agreed)]
    assert votes[0].read(7) is None                                      # read once


def test_a_slot_is_declared_once():
    bus = Bus(1)
    with pytest.raises(ValueError, match="vote slot 'stop' declared twice"):
        StepVote(bus.comm(0), [Part(0, (Slot("stop"),), None), Part(0, (Slot("stop"),), None)])
