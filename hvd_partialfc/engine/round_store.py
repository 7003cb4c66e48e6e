"""One key prefix per rendezvous round in torchrun's shared store, agreed by every member of the round.

Why: torchrun's c10d rendezvous shares one TCPStore (the agent's) across all the rounds of a job, and
``init_process_group`` writes its ranks' addresses under the same keys in every round; a group that read the
previous round's addresses connected to dead ports (measured: one restart in three failed with "Connection
refused" or hung in Gloo's connectFullMesh; PyTorch issue 135712). The engine used to key the store by
``TORCHELASTIC_RESTART_COUNT``, but each agent counts its own restarts, and a restart for a change of members
(a node joining) is counted by none: a node that joins back has a new agent at 0 while the others are at 1,
so the two sides took different prefixes and ``init_process_group`` waited its whole timeout, at every later
restart. Nothing the launcher gives a worker names the round.

How (``agreed_prefix``): a counter in the store numbers the rounds, and rank 0 alone opens each one.

* Rank 0 adds 1 to the counter (round g is its own: nobody else increments), records the round's world size,
  waits until every other rank has *claimed* its slot in round g with a fresh random nonce, then publishes
  ``go``: the nonces it saw.
* Rank r reads the counter (c) and claims slot r of round c (``compare_set``: only if nobody holds it), then
  waits for round c's ``go``. It takes round c only if ``go`` lists *its own* nonce. A round it reads too early
  is the previous one: of another world size (skipped), complete (its slot is already held: skipped), or
  incomplete, its rank 0 gone (no ``go`` ever comes: rank r moves on as soon as the counter passes c). A
  round whose rank 0 died between opening it and recording its size is left the same way, as soon as the
  counter passes it (before, rank r waited for that size until the collective timeout).

Safe by construction on one condition, which torchrun's agents keep: a round's processes are all stopped
before the next round's start (an agent stops its workers before it joins the next round). A rank can then
only ever take a round whose ``go`` was written, after it claimed, by a live rank 0 that read its nonce; the
nonce is unique, so no other round's ``go`` can name it. Cost: a few store round trips and 50 ms polls at
start-up. Without torchrun's shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or a plain launch) the
group has a new store every round and this is not used.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable

BASE = "hvd_partialfc/rounds/"


class RoundError(RuntimeError):
    """No round could be agreed before the deadline."""


def _wait(condition: Callable[[], bool], deadline: float, poll_s: float, what: Callable[[], str]) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise RoundError(f"no rendezvous round agreed in time: {what()}")
        time.sleep(poll_s)


def agreed_prefix(store, rank: int, size: int, timeout_s: float, poll_s: float = 0.05) -> str:
    """The key prefix of this rendezvous round for ``init_process_group``'s store (see the module's docstring).
    A collective over ``store``: every rank of the round calls it, with the round's ``rank`` and ``size``."""
    deadline = time.monotonic() + timeout_s
    counter = BASE + "counter"

    def key(g: int, name: str) -> str:
        return f"{BASE}{g}/{name}"
    if rank == 0:
        g = int(store.add(counter, 1))
        store.set(key(g, "world"), str(size))
        claims = [key(g, f"claim/{r}") for r in range(1, size)]
        _wait(lambda: not claims or store.check(claims), deadline, poll_s,
              lambda: f"rank 0 opened round {g} of {size} ranks; ranks "
                      f"{[r for r in range(1, size) if not store.check([key(g, f'claim/{r}')])]} never claimed it")
        go = {str(r): store.get(key(g, f"claim/{r}")).decode() for r in range(1, size)}
        store.set(key(g, "go"), json.dumps(go))
        return key(g, "pg/")
    nonce, rejected = uuid.uuid4().hex, 0
    while True:
        _wait(lambda: int(store.add(counter, 0)) > rejected, deadline, poll_s,
              lambda: f"rank {rank} waited for rank 0 to open a round (the last seen: {rejected})")
        c = int(store.add(counter, 0))
        _wait(lambda: store.check([key(c, "world")]) or int(store.add(counter, 0)) > c, deadline, poll_s,
              lambda: f"round {c} has no world size")
        if not store.check([key(c, "world")]):      # its rank 0 died between opening and sizing it: the next
            rejected = c
            continue
        if int(store.get(key(c, "world"))) == size and \
                store.compare_set(key(c, f"claim/{rank}"), "", nonce).decode() == nonce:
            _wait(lambda: store.check([key(c, "go")]) or int(store.add(counter, 0)) > c, deadline, poll_s,
                  lambda: f"rank {rank} claimed round {c}, whose rank 0 never said go")
            if store.check([key(c, "go")]) and json.loads(store.get(key(c, "go")).decode()).get(str(rank)) == nonce:
                return key(c, "pg/")
        rejected = c
