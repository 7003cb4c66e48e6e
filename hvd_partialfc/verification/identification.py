"""Open-set identification (1:N) on a held-out shard set: a seeded gallery / probe split, then each probe
searched against the whole gallery.

Split (`split_gallery`, seeded, from the labels alone): ``nonmated_share`` of the classes (10%, at least
one) are left out of the gallery and all their samples become *non-mated* probes (someone the system has
never enrolled); every other class gets one gallery template, the normalised mean embedding of a
``gallery_share`` part of its samples (at least one), and its remaining samples are *mated* probes.

Figures (`metrics.rank_accuracy`, `metrics.tpir_at_fpir`): rank-1 / rank-5 accuracy of the mated
probes (closed-set: is the mate among the k best gallery scores), and TPIR at FPIR = 1e-2 and 1e-1
(open-set: the threshold lets through that fraction of non-mated probes; a mated probe counts when its
best candidate is its mate and clears it).

Memory: the search keeps only each probe's best ``k`` (score, gallery id); the probe x gallery score
matrix is computed in blocks of at most `SEARCH_BLOCK_BYTES`, so a 10^5-entry gallery costs its own
(G, D) matrix plus one block. Embedding reads the shard set batch by batch.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.loader import RankShardDataset
from .embedding import embed
from .metrics import rank_accuracy, tpir_at_fpir

FPIRS: Tuple[float, ...] = (1e-2, 1e-1)
RANKS: Tuple[int, ...] = (1, 5)
SEARCH_BLOCK_BYTES = 64 << 20      # float32 scores of one probe block against the gallery


def fpir_key(fpir: float) -> str:
    """``1e-2`` -> ``"tpir@fpir=1e-2"``."""
    mantissa, exponent = f"{fpir:.0e}".split("e")
    return f"tpir@fpir={mantissa}e{int(exponent)}"


def split_gallery(labels, seed: int = 0, gallery_share: float = 0.5,
                  nonmated_share: float = 0.1) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(gallery sample positions, their class, mated probe positions, non-mated probe positions).

    Classes with one sample go to the gallery whole (no mated probe); the rest keep at least one probe."""
    labels = np.asarray(labels, dtype=np.int64)
    classes = np.unique(labels)
    if len(classes) < 2:
        raise ValueError(f"identification needs at least two classes, got {len(classes)}")
    rng = np.random.default_rng(seed)
    n_out = min(len(classes) - 1, max(1, int(round(nonmated_share * len(classes)))))
    left_out = set(rng.choice(classes, n_out, replace=False).tolist())
    gallery, gallery_class, mated, nonmated = [], [], [], []
    for c in classes:
        pos = np.flatnonzero(labels == c)
        if c in left_out:
            nonmated.append(pos)
            continue
        pos = rng.permutation(pos)
        g = len(pos) if len(pos) == 1 else min(len(pos) - 1, max(1, int(round(gallery_share * len(pos)))))
        gallery.append(pos[:g])
        gallery_class.append(np.full(g, c))
        mated.append(pos[g:])
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)
    return cat(gallery), cat(gallery_class), cat(mated), cat(nonmated)


def gallery_templates(embeddings: np.ndarray, classes: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(gallery class ids (G,) sorted, L2-normalised mean embedding of each (G, D) float32)."""
    ids, row = np.unique(classes, return_inverse=True)
    out = torch.zeros((len(ids), embeddings.shape[1]), dtype=torch.float32)
    out.index_add_(0, torch.from_numpy(row.reshape(-1)), torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)))
    return ids, F.normalize(out, dim=1).numpy()


def search(gallery: np.ndarray, probes: np.ndarray, k: int = 5,
           block_bytes: int = SEARCH_BLOCK_BYTES) -> Tuple[np.ndarray, np.ndarray]:
    """(scores float32 (Q, k), gallery rows int64 (Q, k)), best first, of each probe's top ``k`` cosine
    scores; blocks of probes are sized so that one (block, G) score matrix fits ``block_bytes``."""
    g = torch.from_numpy(np.ascontiguousarray(gallery, dtype=np.float32))
    k = min(k, len(g))
    rows = max(1, block_bytes // (4 * max(len(g), 1)))
    scores, ids = [], []
    for s in range(0, len(probes), rows):
        p = torch.from_numpy(np.ascontiguousarray(probes[s:s + rows], dtype=np.float32))
        top = torch.topk(p @ g.T, k, dim=1)              # (b, G) -> (b, k)
        scores.append(top.values.numpy())
        ids.append(top.indices.numpy().astype(np.int64))
    if not scores:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return np.concatenate(scores), np.concatenate(ids)


def identification_metrics(gallery_ids: np.ndarray, gallery: np.ndarray, mated: np.ndarray, mated_class: np.ndarray,
                           nonmated: np.ndarray, ranks: Sequence[int] = RANKS,
                           fpirs: Sequence[float] = FPIRS) -> Dict[str, Any]:
    """Rank-k accuracy and TPIR at FPIR from embeddings: gallery (G, D) with class ids (G,), mated probes
    (Q, D) with their class, non-mated probes (N, D); all rows L2-normalised."""
    k = max(ranks)
    m_scores, m_rows = search(gallery, mated, k)
    n_scores, _ = search(gallery, nonmated, 1)
    candidates = gallery_ids[m_rows]                      # (Q, k) class ids, best first
    out: Dict[str, Any] = {"gallery": int(len(gallery_ids)), "mated_probes": int(len(mated)),
                           "nonmated_probes": int(len(nonmated))}
    for r in ranks:
        out[f"rank{r}"] = rank_accuracy(candidates, mated_class, r) if len(gallery_ids) >= r else None
    notes = {}
    for f in fpirs:
        res = tpir_at_fpir(m_scores[:, 0], candidates[:, 0] == mated_class, n_scores[:, 0], f)
        out[fpir_key(f)] = res["tpir"]
        if res["reason"]:
            notes[fpir_key(f)] = res["reason"]
    out["notes"] = notes
    return out


def embed_shard_set(model: nn.Module, shard_dir: str, batch_size: int = 256, flip: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """(L2-normalised embeddings (n, D), global labels (n,)) of every sample, read batch by batch."""
    ds = RankShardDataset(shard_dir, 0, 1)
    parts = []
    for s in range(0, len(ds), batch_size):
        samples, _ = ds[list(range(s, min(s + batch_size, len(ds))))]
        parts.append(embed(model, samples.numpy(), batch_size, flip))
    if not parts:
        raise ValueError(f"{shard_dir}: no samples")
    return np.concatenate(parts), ds.labels


def evaluate_identification(model: nn.Module, shard_dir: str, batch_size: int = 256, flip: bool = False,
                            seed: int = 0, gallery_share: float = 0.5, nonmated_share: float = 0.1) -> Dict[str, Any]:
    """The 1:N protocol of a backbone on a held-out shard set (see the module docstring), plus ``time_s``."""
    t0 = time.perf_counter()
    e, labels = embed_shard_set(model, shard_dir, batch_size, flip)
    g, g_class, mated, nonmated = split_gallery(labels, seed, gallery_share, nonmated_share)
    ids, gallery = gallery_templates(e[g], g_class)
    out = identification_metrics(ids, gallery, e[mated], labels[mated], e[nonmated])
    out.update({"samples": int(len(labels)), "seed": seed, "gallery_share": gallery_share,
                "nonmated_share": nonmated_share, "flip": flip, "time_s": round(time.perf_counter() - t0, 3)})
    return out
