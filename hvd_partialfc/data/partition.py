"""Label slices: which contiguous range of global labels each rank (or shard) owns.

Contract: pure arithmetic over Python ints, no torch, no Horovod, so that `data_tools` (offline) and the
trainer (online) compute the same slices from the same inputs. A slice is the half-open range
``[start, end)`` of global labels; slices of one partition are disjoint, contiguous, ordered by rank and
cover ``[0, num_classes)``. (The range math of InsightFace's ``partial_fc_v2`` pulled out and tested.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence


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


def group_slices(shard_slices: Sequence[LabelSlice], world_size: int) -> List[LabelSlice]:
    """Merge consecutive shard slices into one slice per rank: rank r takes shards [r*k, (r+1)*k).

    A shard set of S shards runs on N ranks when S is a multiple of N; each rank's block of shards is
    still one contiguous label range because the shards themselves are.
    """
    num_shards = len(shard_slices)
    if world_size < 1 or num_shards % world_size:
        raise ValueError(
            f"the shard set has {num_shards} shards, which is not a multiple of the world size {world_size}; "
            f"run on a divisor of {num_shards} ranks or rebuild the shards with --num-shards a multiple of {world_size}")
    per_rank = num_shards // world_size
    out = []
    for r in range(world_size):
        block = shard_slices[r * per_rank:(r + 1) * per_rank]
        for a, b in zip(block, block[1:]):
            if a.end != b.start:
                raise ValueError(f"shards {a.index} and {b.index} are not contiguous ({a.end} != {b.start})")
        out.append(LabelSlice(r, block[0].start, block[-1].end))
    return out


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
