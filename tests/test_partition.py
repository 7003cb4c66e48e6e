"""Label slices: cover, disjoint, contiguous, sizes; balancing by samples; grouping shards per rank."""
import random

import pytest

from hvd_partialfc.data.partition import (LabelSlice, balanced_slices, check_partition, even_slices, group_slices,
                                     imbalance)


@pytest.mark.parametrize("c,n", [(1, 1), (10, 3), (7, 7), (1000, 64), (1_000_003, 1024), (5, 2)])
def test_even_slices_cover_disjoint_contiguous(c, n):
    s = even_slices(c, n)
    check_partition(s, c)
    widths = [x.width for x in s]
    assert widths == [c // n + (1 if i < c % n else 0) for i in range(n)]  # the first C % N get one more


def test_even_slices_random_property():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 50)
        c = rng.randint(n, 5000)
        s = even_slices(c, n)
        check_partition(s, c)
        assert max(x.width for x in s) - min(x.width for x in s) <= 1
        labels = [l for x in s for l in range(x.start, x.end)]
        assert labels == list(range(c))


def test_fewer_classes_than_ranks_is_an_error():
    with pytest.raises(ValueError, match="cannot split 3 classes into 4"):
        even_slices(3, 4)


def test_balanced_slices_balance_samples_on_long_tail():
    rng = random.Random(1)
    counts = sorted((int(1000 / (i + 1)) + 1 for i in range(500)), reverse=True)  # Zipf-like head
    rng.shuffle(counts)
    for n in (2, 4, 8, 16):
        s = balanced_slices(counts, n)
        check_partition(s, len(counts))
        per = [sum(counts[x.start:x.end]) for x in s]
        per_even = [sum(counts[x.start:x.end]) for x in even_slices(len(counts), n)]
        assert imbalance(per) <= imbalance(per_even) + 1e-9
        assert max(per) - sum(per) / n <= max(counts)  # greedy bound: within one class of the ideal


def test_balanced_slices_keep_a_class_per_part():
    s = balanced_slices([1000, 1, 1, 1], 4)
    check_partition(s, 4)
    assert [x.width for x in s] == [1, 1, 1, 1]


def test_group_slices_blocks_of_shards():
    shards = even_slices(100, 8)
    ranks = group_slices(shards, 2)
    check_partition(ranks, 100)
    assert ranks[0] == LabelSlice(0, 0, shards[3].end)
    # 8 shards on 3 ranks: blocks balanced by samples, so the counts are needed; 9 ranks: more than shards
    with pytest.raises(ValueError, match="sample counts, which were not given"):
        group_slices(shards, 3)
    check_partition(group_slices(shards, 3, [1] * 8), 100)
    with pytest.raises(ValueError, match="maximum world size is 8"):
        group_slices(shards, 9, [1] * 8)


def test_check_partition_rejects_gaps_and_overlaps():
    with pytest.raises(ValueError, match="gap or overlap"):
        check_partition([LabelSlice(0, 0, 5), LabelSlice(1, 6, 10)], 10)
    with pytest.raises(ValueError, match="expected \\[0, 12\\)"):
        check_partition([LabelSlice(0, 0, 5), LabelSlice(1, 5, 10)], 12)
