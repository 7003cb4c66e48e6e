"""Label slices: which contiguous range of global labels each rank (or shard) owns.

Contract: pure arithmetic over Python ints, no torch, no Horovod, so that `data_tools` (offline) and the
trainer (online) compute the same slices from the same inputs. A slice is the half-open range
``[start, end)`` of global labels; slices of one partition are disjoint, contiguous, ordered by rank and
cover ``[0, num_classes)``. (The range math of InsightFace's ``partial_fc_v2`` pulled out and tested.)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class LabelSlice:
    """The global labels ``[start, end)`` owned by one part (a rank or a shard)."""

    index: int
    start: int
    end: int

    @property
    def width(self) -> int:
        return self.end - self.start

    def __contains__(self, label: int) -> bool:
        return self.start <= label < self.end


def even_slices(num_classes: int, num_parts: int) -> List[LabelSlice]:
    """Split C classes into N contiguous slices: C // N each, the first C % N parts one more.

    Raises ValueError when a part would be empty (C < N): a rank without classes has no loss to
    backpropagate, and its dedicated loader would have no samples.
    """
    _check_counts(num_classes, num_parts)
    base, extra = divmod(num_classes, num_parts)
    slices, start = [], 0
    for i in range(num_parts):
        width = base + (1 if i < extra else 0)
        slices.append(LabelSlice(i, start, start + width))
        start += width
    return slices


def balanced_slices(class_counts: Sequence[int], num_parts: int) -> List[LabelSlice]:
    """Contiguous slices that hold about the same number of *samples* each (long-tail data).

    The classes keep their order (slices stay contiguous); boundaries are placed where the running sample
    count crosses k/N of the total, and moved so that every part keeps at least one class. Greedy on the
    prefix sums: the largest part exceeds the ideal share by at most one class's count.
    """
    num_classes = len(class_counts)
    _check_counts(num_classes, num_parts)
    if any(c < 0 for c in class_counts):
        raise ValueError("class counts must be non-negative")
    total = sum(class_counts)
    prefix = [0]
    for c in class_counts:
        prefix.append(prefix[-1] + c)
    bounds = [0]
    for k in range(1, num_parts):
        target = total * k / num_parts
        # First class boundary whose prefix reaches the target; pick the nearer of it and the one before.
        b = _bisect_left(prefix, target)
        if b > 0 and abs(prefix[b - 1] - target) <= abs(prefix[min(b, num_classes)] - target):
            b -= 1
        lo = bounds[-1] + 1                       # at least one class in the previous part
        hi = num_classes - (num_parts - k)        # and at least one left for each later part
        bounds.append(min(max(b, lo), hi))
    bounds.append(num_classes)
    return [LabelSlice(i, bounds[i], bounds[i + 1]) for i in range(num_parts)]


def imbalance(sizes: Sequence[int]) -> float:
    """max / mean of the per-part sizes (1.0 = perfectly balanced)."""
    mean = sum(sizes) / len(sizes)
    return max(sizes) / mean if mean else float("inf")


def group_slices(shard_slices: Sequence[LabelSlice], world_size: int,
                 shard_samples: Optional[Sequence[int]] = None) -> List[LabelSlice]:
    """One slice per rank: the shards of each block of ``block_bounds`` merged (``merge_blocks``)."""
    return merge_blocks(shard_slices, block_bounds(len(shard_slices), world_size, shard_samples))


def merge_blocks(shard_slices: Sequence[LabelSlice], bounds: Sequence[int]) -> List[LabelSlice]:
    """Slice r: shards [bounds[r], bounds[r+1]) merged. Each block is still one contiguous label range
    because the shards themselves are (checked: ValueError naming the two shards otherwise)."""
    out = []
    for r in range(len(bounds) - 1):
        block = shard_slices[bounds[r]:bounds[r + 1]]
        for a, b in zip(block, block[1:]):
            if a.end != b.start:
                raise ValueError(f"shards {a.index} and {b.index} are not contiguous ({a.end} != {b.start})")
        out.append(LabelSlice(r, block[0].start, block[-1].end))
    return out


def block_bounds(num_shards: int, world_size: int, shard_samples: Optional[Sequence[int]] = None) -> List[int]:
    """Where each rank's block of consecutive shards starts: rank r reads shards [bounds[r], bounds[r+1]).

    * N divides S: k = S / N shards a rank, whatever the sample counts. These are the blocks of every run
      before uneven blocks existed, so their checkpoints resume, same size, bit for bit.
    * Otherwise (an elastic restart: 64 shards on 24 ranks): blocks of >= 1 shards balanced by samples
      (``shard_samples``, required then), see ``_balanced_bounds``.
    * N > S: ValueError. A shard is never split between ranks: it holds a contiguous label range whose
      rows one rank owns, and the loader reads whole shards.
    """
    if world_size < 1:
        raise ValueError(f"the world size must be >= 1, got {world_size}")
    if world_size > num_shards:
        raise ValueError(
            f"the shard set has {num_shards} shards, so the maximum world size is {num_shards}, not {world_size}: "
            f"every rank reads at least one whole shard (a shard's labels belong to one rank); run on at most "
            f"{num_shards} ranks or rebuild the shards with --num-shards >= {world_size}")
    if num_shards % world_size == 0:
        k = num_shards // world_size
        return [r * k for r in range(world_size + 1)]
    if shard_samples is None:
        raise ValueError(f"{num_shards} shards on {world_size} ranks (not a divisor) are balanced by the "
                         f"shards' sample counts, which were not given")
    if len(shard_samples) != num_shards or any(c < 0 for c in shard_samples):
        raise ValueError(f"need {num_shards} non-negative shard sample counts, got {list(shard_samples)}")
    return _balanced_bounds(list(shard_samples), world_size)


def _balanced_bounds(sizes: List[int], parts: int) -> List[int]:
    """Contiguous blocks (>= 1 shard each) whose largest sample count is the least possible (M*).

    M* is found by binary search: a cap M is feasible iff a greedy left-to-right packing needs <= ``parts``
    blocks (more blocks can always be had by splitting, as parts <= len(sizes)). Many partitions reach M*;
    the rule picks one that also spreads the slack: boundary j goes, among the positions that keep every
    block <= M* and leave each later rank a shard, to the one whose prefix sum is nearest to j/N of the
    total (exact integer comparison; a tie goes to the lower index). So 64 equal shards on 24 ranks give
    blocks of 3 and 2 shards interleaved, not twenty 3s and four 1s. O(S log(total)), deterministic.
    """
    prefix = [0]
    for c in sizes:
        prefix.append(prefix[-1] + c)
    total, n = prefix[-1], len(sizes)
    lo, hi = max(sizes), total
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy_blocks(sizes, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    cap = lo
    # earliest[m]: the leftmost start from which the rest fits in m blocks <= cap (greedy from the right)
    earliest, end = [n], n
    while end > 0 and len(earliest) <= parts:
        start = end - 1
        while start > 0 and prefix[end] - prefix[start - 1] <= cap:
            start -= 1
        earliest.append(start)
        end = start
    earliest += [0] * (parts + 1 - len(earliest))
    bounds = [0]
    for j in range(1, parts):
        left = parts - j                          # blocks still to place after boundary j
        a = max(bounds[-1] + 1, earliest[left])
        b = min(bisect.bisect_right(prefix, prefix[bounds[-1]] + cap) - 1, n - left)
        bounds.append(_nearest(prefix, a, b, j * total, parts))
    bounds.append(n)
    return bounds


def _greedy_blocks(sizes: Sequence[int], cap: int) -> int:
    """Blocks a greedy left-to-right packing with at most ``cap`` samples a block needs."""
    blocks, run = 1, 0
    for c in sizes:
        if run + c > cap:
            blocks, run = blocks + 1, 0
        run += c
    return blocks


def _nearest(prefix: Sequence[int], a: int, b: int, num: int, den: int) -> int:
    """The index i in [a, b] whose prefix[i] is nearest to num / den; a tie goes to the lower index."""
    i = bisect.bisect_left(prefix, -(-num // den), a, b + 1)   # first prefix >= num / den (integers)
    best = min((k for k in (i - 1, i) if a <= k <= b), key=lambda k: (abs(den * prefix[k] - num), k))
    return bisect.bisect_left(prefix, prefix[best], a, best + 1)   # the lowest index with that prefix


def check_partition(slices: Sequence[LabelSlice], num_classes: int) -> None:
    """Raise ValueError unless the slices are ordered, contiguous, non-empty and cover [0, num_classes)."""
    expect = 0
    for i, s in enumerate(slices):
        if s.index != i:
            raise ValueError(f"slice {i} has index {s.index}")
        if s.start != expect:
            raise ValueError(f"slice {i} starts at {s.start}, expected {expect} (gap or overlap)")
        if s.end <= s.start:
            raise ValueError(f"slice {i} [{s.start}, {s.end}) is empty")
        expect = s.end
    if expect != num_classes:
        raise ValueError(f"slices cover [0, {expect}), expected [0, {num_classes})")


def _check_counts(num_classes: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"number of parts must be >= 1, got {num_parts}")
    if num_classes < num_parts:
        raise ValueError(f"cannot split {num_classes} classes into {num_parts} non-empty slices "
                         f"(need at least one class per rank/shard)")


def _bisect_left(a: Sequence[float], x: float) -> int:
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
