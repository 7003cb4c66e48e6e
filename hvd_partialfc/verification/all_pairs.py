"""The all-pairs protocol: 1:1 verification over every pair of distinct samples of a labelled shard set.

Scores are computed block by block (torch matmul) and impostor scores binned, so memory is O(n D + bins),
not O(n^2). `evaluate_all_pairs` is what ``hvd-partialfc eval --all-pairs SHARDS`` runs.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from ..data.loader import RankShardDataset
from .embedding import embed
from .metrics import far_key, top_tie_reason

ALL_PAIRS_FARS: Tuple[float, ...] = (1e-3, 1e-4, 1e-5)
ALL_PAIRS_BINS = 200_000     # cosine in [-1, 1] in steps of 1e-5: finer than any FAR figure needs


def _score_pairs(e: torch.Tensor, y: torch.Tensor, block: int, bins: int) -> Tuple[np.ndarray, torch.Tensor]:
    """Every unordered pair's cosine, ``block`` rows at a time: the same-class scores exactly (float64) and the
    different-class ones as a ``bins``-bin histogram over [-1, 1] (memory O(bins), not O(n^2))."""
    n = len(y)
    hist = torch.zeros(bins, dtype=torch.float64)
    same_scores = []
    cols = torch.arange(n)
    for s in range(0, n, block):
        rows = torch.arange(s, min(s + block, n))
        sim = (e[rows] @ e.T).clamp_(-1.0, 1.0)                     # (b, n) cosine
        upper = cols[None, :] > rows[:, None]                      # each unordered pair once
        same = y[rows][:, None] == y[None, :]
        same_scores.append(sim[upper & same])
        hist += torch.histc(sim[upper & ~same], bins=bins, min=-1.0, max=1.0).double()
    return torch.cat(same_scores).double().numpy(), hist


def all_pairs_metrics(embeddings, labels, fars: Sequence[float] = ALL_PAIRS_FARS, block: int = 2048,
                      bins: int = ALL_PAIRS_BINS, source: str = "all-pairs verification") -> Dict[str, Any]:
    """1:1 verification over *every* pair of distinct samples of a labelled set (IJB-style "all pairs").

    Why: a 6,000-pair protocol has 3,000 different pairs, so its TAR@FAR=1e-3 is set by the 3 highest
    impostor scores and moves by points from one training seed to the next. n samples give n(n-1)/2
    pairs (22,794 held-out glyphs: 2.6 x 10^8, of which ~10^6 same-class), so TAR@FAR=1e-3 rests on
    ~2.6 x 10^5 impostors and even 1e-5 is measured. Same-class scores are kept exactly; different-class
    scores go into a ``bins``-bin histogram over [-1, 1] (memory O(bins), not O(n^2)); the threshold of a
    FAR is the lowest bin edge whose impostor tail is at most ``far`` (so the achieved FAR never exceeds
    it), and the TAR counts the exact same-class scores at or above it.

    ``embeddings``: (n, D) rows of unit length; ``labels``: (n,) ints. Returns ``pairs``, ``same_pairs``,
    ``different_pairs``, ``auc`` and ``tar@far=...`` (with ``notes`` where a FAR is below 1 / #different,
    and where the top bin alone holds more impostors than a FAR allows: TAR 0, as collapsed embeddings
    give, in `metrics.top_tie_reason`'s words). Non-finite embeddings are a ValueError that starts with
    ``source`` (the histogram would drop their pairs without a word: measured, 116 of 7,140 pairs gone for
    one NaN row of 120, and a plausible TAR left).
    """
    e = torch.as_tensor(np.ascontiguousarray(embeddings), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    n = len(y)
    if e.ndim != 2 or len(e) != n or n < 2:
        raise ValueError(f"need (n, D) embeddings and (n,) labels with n >= 2; got {tuple(e.shape)} and {n}")
    bad = int((~torch.isfinite(e).all(dim=1)).sum())
    if bad:
        raise ValueError(f"{source}: {bad} of {n} embeddings are not finite (NaN/inf: a diverged backbone?)")
    pos, hist = _score_pairs(e, y, block, bins)
    n_neg, n_pos = int(hist.sum().item()), len(pos)
    if n_pos == 0 or n_neg == 0:
        raise ValueError("all-pairs verification needs at least two classes and a class with two samples")
    tail = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0]).numpy()   # impostors in bins >= b
    edges = np.linspace(-1.0, 1.0, bins + 1)
    out: Dict[str, Any] = {"pairs": n_pos + n_neg, "same_pairs": n_pos, "different_pairs": n_neg}
    # AUC from the histogram: P(impostor < genuine) + 1/2 P(same bin), genuine scores binned alike
    pos_hist = np.histogram(pos, bins=bins, range=(-1.0, 1.0))[0].astype(np.float64)
    below = np.r_[0.0, np.cumsum(hist.numpy())[:-1]]
    out["auc"] = float((pos_hist * (below + 0.5 * hist.numpy())).sum() / (n_pos * n_neg))
    notes = {}
    for far in fars:
        if n_neg * far < 1:
            out[far_key(far)] = None
            notes[far_key(far)] = f"{n_neg} different pairs; FAR {far_key(far)[8:]} needs at least {math.ceil(1 / far)}"
            continue
        allowed = np.flatnonzero(tail <= far * n_neg)              # bins whose tail is allowed
        if len(allowed) == 0:                                      # the top bin alone holds too many
            out[far_key(far)] = 0.0
            notes[far_key(far)] = top_tie_reason(far, int(tail[-1]), n_neg, f"score bin (width {2 / bins:g})")
            continue
        out[far_key(far)] = float(np.mean(pos >= edges[int(allowed[0])]))   # the lowest one
    out["notes"] = notes
    return out


def evaluate_all_pairs(model: nn.Module, shard_dir: str, batch_size: int = 256, flip: bool = False,
                       fars: Sequence[float] = ALL_PAIRS_FARS, name: str = "") -> Dict[str, Any]:
    """`all_pairs_metrics` of a backbone on every sample of a (held-out) shard set, plus ``time_s``.
    ``name`` (the backbone's file or run; default its class) is what an error about its embeddings names."""
    t0 = time.perf_counter()
    ds = RankShardDataset(shard_dir, 0, 1)
    samples, labels = ds[list(range(len(ds)))]
    e = embed(model, samples.numpy(), batch_size, flip)
    out = all_pairs_metrics(e, labels.numpy(), fars,
                            source=f"backbone {name or type(model).__name__} on {shard_dir}")
    out["samples"], out["time_s"] = len(labels), round(time.perf_counter() - t0, 3)
    return out

