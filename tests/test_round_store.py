"""The rendezvous round's store prefix (engine/round_store.py): every member of a round agrees on one prefix,
whatever an earlier round left in torchrun's shared store, and whatever order the ranks start in. Ranks are
threads on one TCPStore here (the agreement is store operations only); tests/test_twonode.py runs it under
torchrun across three network-namespace nodes, with a node that joins back."""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hvd_partialfc.engine.round_store import BASE, RoundError, agreed_prefix


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield lambda: dist.TCPStore("127.0.0.1", master.port, 1, False, timeout=timedelta(seconds=30))
    del master


def _round(make_store, size, rank0_delay=0.0, timeout=20.0):
    """Every rank of one round in its own thread and client; rank 0 starts ``rank0_delay`` s after the others.
    Their prefixes by rank."""
    out, errors = {}, []

    def member(rank):
        try:
            out[rank] = agreed_prefix(make_store(), rank, size, timeout, poll_s=0.01)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=member, args=(r,)) for r in range(1, size)]
    for t in threads:
        t.start()
    time.sleep(rank0_delay)
    threads.append(threading.Thread(target=member, args=(0,)))
    threads[-1].start()
    for t in threads:
        t.join(timeout + 5)
    assert not errors, errors
    return out


def test_every_member_of_each_round_agrees_and_rounds_differ(store):
    first = _round(store, 4)
    second = _round(store, 3, rank0_delay=0.3)      # the others read the counter before rank 0 opens round 2
    third = _round(store, 3)
    assert len(set(first.values())) == len(set(second.values())) == len(set(third.values())) == 1
    assert len({first[0], second[0], third[0]}) == 3


def test_an_incomplete_earlier_round_of_the_same_size_is_never_taken(store):
    """Round 1 was opened by a rank 0 that died before every rank claimed (rank 1 did, rank 2 did not): a new
    round's ranks 1 and 2, started before their rank 0, claim round 1's free slot first, then move on."""
    s = store()
    s.add(BASE + "counter", 1)
    s.set(BASE + "1/world", "3")
    s.set(BASE + "1/claim/1", "a-dead-process")
    got = _round(store, 3, rank0_delay=0.5)
    assert set(got.values()) == {BASE + "2/pg/"}


def test_a_round_whose_rank_0_died_before_sizing_it_is_left_at_once(store):
    """Round 1 was opened (the counter added) by a rank 0 that died before it recorded the round's size: the
    next round's ranks, started before their rank 0, move on to round 2 as soon as it is opened, instead of
    waiting for round 1's size until their timeout (20 s here)."""
    store().add(BASE + "counter", 1)
    t0 = time.monotonic()
    got = _round(store, 3, rank0_delay=0.5)
    assert set(got.values()) == {BASE + "2/pg/"} and time.monotonic() - t0 < 10


def test_a_complete_earlier_round_of_the_same_size_is_never_taken(store):
    """Round 1 completed (its go written) and its processes stopped: the new round's ranks, before their rank
    0, find their slots held and wait for round 2."""
    first = _round(store, 3)
    go = json.loads(store().get(BASE + "1/go").decode())
    assert set(go) == {"1", "2"}
    got = _round(store, 3, rank0_delay=0.5)
    assert set(got.values()) == {BASE + "2/pg/"} and first[0] == BASE + "1/pg/"


def test_a_round_whose_rank_0_never_comes_fails_in_time(store):
    t0 = time.monotonic()
    with pytest.raises(RoundError, match="rank 1 waited for rank 0 to open a round"):
        agreed_prefix(store(), 1, 2, timeout_s=0.5, poll_s=0.01)
    assert time.monotonic() - t0 < 5
