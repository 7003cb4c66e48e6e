"""The one seed derivation: a generator seed from (run seed, rank, counter, stream). Not a collective.

Every per-rank stream takes its seed from here, so a stream is reproducible from these numbers alone.
``stream`` keeps uses apart whose counters overlap: 0 for the loader's epoch permutations and the
cross-shard negatives' subsets (their seeds since the first release), 1 for the loader's worker seeds,
2 for the re-seed after a resume at another world size.
"""
from __future__ import annotations

LOADER_EPOCHS, LOADER_WORKERS, RESHARD_RESEED = 0, 1, 2


def derive_seed(seed: int, rank: int, counter: int = 0, stream: int = 0) -> int:
    """``(seed * 1_000_003 + rank) * 10_007 + counter`` (+ ``stream`` x 2^40), below 2^63 for
    ``torch.manual_seed``."""
    return ((int(seed) * 1_000_003 + int(rank)) * 10_007 + int(counter) + int(stream) * 2 ** 40) % 2 ** 63
