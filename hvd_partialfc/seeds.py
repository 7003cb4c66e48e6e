"""The seed derivations: every generator seed of the package comes from here. Not a collective.

``derive_seed``: a generator seed from (run seed, rank, counter, stream). Every per-rank stream takes its seed from here, so a stream is reproducible from these numbers alone.
``stream`` keeps uses apart whose counters overlap: 0 for the loader's epoch permutations and the
cross-shard negatives' subsets (their seeds since the first release), 1 for the loader's worker seeds,
2 for the re-seed after a resume at another world size, 3 for the data augmentation of each batch.
Two older formulas keep their values under their own names: ``rank_process_seed`` (a rank's process
stream) and ``classifier_block_seed`` (the classifier rows' init). The run's seed itself (``train.seed``)
seeds the backbone's init directly, the same on every rank.
"""
from __future__ import annotations

from typing import List

LOADER_EPOCHS, LOADER_WORKERS, RESHARD_RESEED, AUGMENT = 0, 1, 2, 3


def derive_seed(seed: int, rank: int, counter: int = 0, stream: int = 0) -> int:
    """``(seed * 1_000_003 + rank) * 10_007 + counter`` (+ ``stream`` x 2^40), below 2^63 for
    ``torch.manual_seed``."""
    return ((int(seed) * 1_000_003 + int(rank)) * 10_007 + int(counter) + int(stream) * 2 ** 40) % 2 ** 63


def stream_entropy(seed: int, rank: int, counter: int, stream: int) -> List[int]:
    """Entropy for ``numpy.random.default_rng`` of a stream whose counter grows without bound (a batch
    index): ``[derive_seed(seed, rank, 0, stream), counter]``.

    In ``derive_seed`` the counter is added to ``rank * 10_007``, so counter 10_007 of rank r is counter 0
    of rank r + 1: harmless for epochs, a repeat after 10,007 batches for a per-batch stream. numpy's
    SeedSequence hashes the two words together instead, so no (rank, counter) pair repeats another's.
    """
    return [derive_seed(seed, rank, 0, stream), int(counter)]


def rank_process_seed(seed: int, rank: int) -> int:
    """The seed of a rank's process-global torch stream once its parts are built (dropout, row sampling):
    ``seed * 1_000_003 + rank`` (the value since the first release)."""
    return int(seed) * 1_000_003 + int(rank)


def classifier_block_seed(seed: int, block: int) -> int:
    """The generator seed of global classifier row block ``block`` (its rows' N(0, 0.01) init):
    ``seed * 1_000_003 + 7_919 + block``, the same whatever the world size."""
    return int(seed) * 1_000_003 + 7_919 + int(block)
