"""The loop's per-step agreement (``StepVote``): one elementwise max over ranks with named slots, started after
each step and read after the next, so that every rank takes the same turn at the same step without a round trip
of its own (the engines' ``vote_async`` rides in the next step's collectives).

A *part* of the loop (a stop signal, the checkpointer's clock, the memory snapshots, the straggler watch) takes
part through three small hooks, each optional:

* ``slots``: the slots it declares (``Slot``), the same on every rank (they depend on the config and the engine);
* ``cast(ballot, done)``: what it puts in the vote started after step ``done`` (``Ballot.put``, by name);
* ``heard(agreed, done)``: what it does with the vote read after step ``done`` (``Agreed``, read by name);

and the loop asks it ``due(done, final)``: whether it acts at step ``done``. A slot is a max over ranks: a flag
any rank raises is raised for all; a per-rank slot (``Slot(name, per_rank=True)``) gives each rank its own
place, so every rank reads every rank's value. Nothing is read by position outside this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence


@dataclass(frozen=True)
class Slot:
    """A named entry of the vote: one value, or one per rank (``per_rank``)."""

    name: str
    per_rank: bool = False


class Ballot:
    """This rank's entries of one vote (zeros where nothing is put)."""

    def __init__(self, places: Dict[str, "_Place"], length: int, rank: int):
        self._places, self._rank = places, rank
        self.values: List[float] = [0.0] * length

    def put(self, name: str, value: float) -> None:
        """Slot ``name``'s value (a flag: True is 1); a per-rank slot takes it at this rank's place."""
        place = self._places[name]
        self.values[place.start + (self._rank if place.per_rank else 0)] = float(value)


@dataclass(frozen=True)
class _Place:
    start: int
    width: int
    per_rank: bool


class Agreed:
    """The vote's answer: every slot's maximum over ranks, read by name."""

    def __init__(self, places: Dict[str, _Place], values: Sequence[float]):
        self._places, self._values = places, list(values)

    def value(self, name: str) -> float:
        return self._values[self._places[name].start]

    def flag(self, name: str) -> bool:
        """Some rank raised slot ``name``."""
        return self.value(name) > 0

    def per_rank(self, name: str) -> List[float]:
        """A per-rank slot: every rank's value, in rank order."""
        place = self._places[name]
        return self._values[place.start:place.start + place.width]


class StepVote:
    """The vote of ``parts`` (each with ``slots``, ``cast`` and ``heard``) over ``comm``'s ranks: ``start(done)``
    after a step, ``read(done)`` after the next one (the parts hear it). At most one vote is in flight."""

    def __init__(self, comm, parts: Iterable, name: str = "step"):
        self.comm, self.name = comm, name
        self.parts = [p for p in parts if getattr(p, "slots", ())]
        self.places: Dict[str, _Place] = {}
        length = 0
        for part in self.parts:
            for slot in part.slots:
                if slot.name in self.places:
                    raise ValueError(f"vote slot {slot.name!r} declared twice")
                width = comm.size if slot.per_rank else 1
                self.places[slot.name] = _Place(length, width, slot.per_rank)
                length += width
        self.length = length
        self._in_flight = None

    def start(self, done: int) -> None:
        """Every part casts its entries after step ``done``; the max over ranks starts (a collective)."""
        if not self.parts:
            return
        ballot = Ballot(self.places, self.length, self.comm.rank)
        for part in self.parts:
            part.cast(ballot, done)
        self._in_flight = self.comm.vote_async(ballot.values, name=self.name)

    def read(self, done: int) -> Optional[Agreed]:
        """The vote in flight, if one is (None after the first step of a start), heard by every part at step
        ``done``; returned for the caller's own reading."""
        if self._in_flight is None:
            return None
        agreed, self._in_flight = Agreed(self.places, self._in_flight.result()), None
        for part in self.parts:
            part.heard(agreed, done)
        return agreed
