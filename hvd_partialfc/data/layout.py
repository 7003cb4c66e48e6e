"""The rank layout: every rank's label slice and block of shards, computed once. Not a collective.

A shard set of S shards runs on N ranks when S is a multiple of N: rank r reads shards [r k, (r + 1) k)
(k = S / N), whose label ranges are contiguous, so its slice of the classifier is one range of global
labels. Everything that needs a slice takes it from here: the loader (which shards a rank reads), the
parts builder (how wide a rank's classifier is, where its rows start), the cross-shard negatives (every
rank's width), checkpoint re-sharding (the slices of another world size) and, without shards, the
benchmark and the estimator (``RankLayout.even``: C classes split as evenly as possible).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .partition import LabelSlice, even_slices, group_slices


@dataclass(frozen=True)
class RankLayout:
    """``slices[r]``: rank r's global labels [start, end); ``shard_blocks[r]``: the shard indices it reads
    (empty without shards)."""

    num_classes: int
    slices: Tuple[LabelSlice, ...]
    shard_blocks: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_shards(cls, shard_slices: Sequence[LabelSlice], world_size: int) -> "RankLayout":
        """Consecutive shards merged into one block per rank (``partition.group_slices``); ValueError when
        the shard count is not a multiple of ``world_size`` or a block's ranges are not contiguous."""
        slices = group_slices(shard_slices, world_size)
        per_rank = len(shard_slices) // world_size
        blocks = tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(world_size))
        return cls(slices[-1].end if slices else 0, tuple(slices), blocks)

    @classmethod
    def from_manifest(cls, manifest, world_size: int) -> "RankLayout":
        """The layout of a shard set (``shards.Manifest``) on ``world_size`` ranks."""
        layout = cls.from_shards(manifest.shard_slices(), world_size)
        return cls(manifest.num_classes, layout.slices, layout.shard_blocks)

    @classmethod
    def even(cls, num_classes: int, world_size: int) -> "RankLayout":
        """Without shards (benchmark, estimator): C // N classes a rank, the first C % N ranks one more."""
        slices = even_slices(num_classes, world_size)
        return cls(num_classes, tuple(slices), tuple(() for _ in slices))

    @property
    def world_size(self) -> int:
        return len(self.slices)

    @property
    def widths(self) -> List[int]:
        return [s.width for s in self.slices]

    def bounds(self) -> List[List[int]]:
        """Every rank's [start, end), as checkpoints record them."""
        return [[s.start, s.end] for s in self.slices]
