"""The rank layout: every rank's label slice and block of shards, computed once. Not a collective.

A shard set of S shards runs on any N <= S ranks; rank r reads a block of consecutive shards, whose label
ranges are contiguous, so its slice of the classifier is one range of global labels. The blocks
(``partition.block_bounds``): when N divides S, k = S / N shards a rank ([r k, (r + 1) k), the layout of
every run before uneven blocks, so same-size resumes stay bitwise); otherwise blocks of unequal shard
counts that minimise the largest block's samples (the manifest's per-shard ``num_samples``), for elastic
restarts on what is left of a cluster. N > S is an error: a shard is never split between ranks.
Everything that needs a slice takes it from here: the loader (which shards a rank reads), the parts
builder (how wide a rank's classifier is, where its rows start), the cross-shard negatives (every rank's
width), checkpoint re-sharding (the slices of another world size) and, without shards, the benchmark and
the estimator (``RankLayout.even``: C classes split as evenly as possible).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .partition import LabelSlice, block_bounds, even_slices, merge_blocks


@dataclass(frozen=True)
class RankLayout:
    """``slices[r]``: rank r's global labels [start, end); ``shard_blocks[r]``: the shard indices it reads
    (empty without shards)."""

    num_classes: int
    slices: Tuple[LabelSlice, ...]
    shard_blocks: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_shards(cls, shard_slices: Sequence[LabelSlice], world_size: int,
                    shard_samples: Optional[Sequence[int]] = None) -> "RankLayout":
        """Consecutive shards merged into one block per rank (``partition.block_bounds``, ``merge_blocks``;
        ``shard_samples``, each shard's sample count, balances the blocks when ``world_size`` does not
        divide the shard count). ValueError when there are more ranks than shards, or a block's ranges are
        not contiguous."""
        bounds = block_bounds(len(shard_slices), world_size, shard_samples)
        slices = merge_blocks(shard_slices, bounds)
        blocks = tuple(tuple(range(bounds[r], bounds[r + 1])) for r in range(world_size))
        return cls(slices[-1].end if slices else 0, tuple(slices), blocks)

    @classmethod
    def from_manifest(cls, manifest, world_size: int) -> "RankLayout":
        """The layout of a shard set (``shards.Manifest``) on ``world_size`` ranks, balanced by the sample
        counts its manifest records for every shard."""
        layout = cls.from_shards(manifest.shard_slices(), world_size, [s.num_samples for s in manifest.shards])
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
