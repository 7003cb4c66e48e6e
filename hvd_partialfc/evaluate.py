"""Open-set verification: does the trained backbone tell *unseen* classes apart?

Training over many classes is only a means; the product is an embedding. It is judged the way face
recognition is judged on LFW / CFP / AgeDB / IJB: pairs of images of classes the model never saw, a cosine
score per pair, and how well one threshold on that score separates "same" from "different".

Contract of this module (no Horovod, no collectives; the caller averages BatchNorm buffers first):

* Metric functions are pure numpy over ``scores`` (float (P,), higher = more likely the same class) and
  ``same`` (bool (P,)): `roc_curve`, `roc_auc`, `best_threshold`, `kfold_accuracy`, `tar_at_far`,
  `roc_points`, and `verification_metrics` which bundles them into one JSON-able dict. A pair is
  *accepted* at threshold ``t`` when ``score >= t``.
* `embed` / `score_pairs` run a backbone over a `PairSet` (batched, ``torch.inference_mode``, eval mode,
  L2-normalised embeddings); they leave the module's parameters, buffers, train/eval flags and the global
  torch RNG state as they found them.
* `evaluate_backbone` / `evaluate_baselines` return per-set dicts; `evaluate_files` is what
  ``hvd-partialfc eval`` runs (tables, ``eval.json``, ``roc.png``). ``eval.json`` holds ``backbone``,
  ``model``, ``flip``, ``pairs`` (set name -> file) and ``sets``: set name -> model key (``backbone``,
  ``pixels``, ``pixels_ncc``, ``random_init``) -> the `verification_metrics` keys plus ``roc``
  (``far``/``tar`` lists).
* `Evaluator` is the training-loop component (``due(step, final)``, ``run(step, backbone)``), rank 0 only,
  appending one record per set to ``out_dir/eval.jsonl``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .atomic import write_text
from .data import prepare_batch
from .pairs import PairSet, read_pairs

FARS: Tuple[float, ...] = (1e-2, 1e-3, 1e-4)
N_FOLDS = 10
BASELINE_LABELS = {"backbone": "trained backbone", "pixels": "raw pixels",
                   "pixels_ncc": "raw pixels, centred (NCC)", "random_init": "random-init backbone"}


# ----------------------------------------------------------------------------------------------------------
# Metrics (pure numpy)
# ----------------------------------------------------------------------------------------------------------

def far_key(far: float) -> str:
    """``1e-3`` -> ``"tar@far=1e-3"`` (the key used in records and JSON)."""
    mantissa, exponent = f"{far:.0e}".split("e")
    return f"tar@far={mantissa}e{int(exponent)}"


def _check(scores, same) -> Tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    same = np.asarray(same, dtype=bool).reshape(-1)
    if scores.shape != same.shape:
        raise ValueError(f"{scores.shape[0]} scores for {same.shape[0]} same/different flags")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"{int((~np.isfinite(scores)).sum())} scores are not finite (NaN/inf embeddings?)")
    if same.all() or not same.any():
        raise ValueError(f"verification needs both same and different pairs; got {int(same.sum())} same, "
                         f"{int((~same).sum())} different")
    return scores, same


def _operating_points(scores: np.ndarray, same: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every distinct way one threshold can split the pairs, strictest first.

    Returns ``tp``, ``fp`` (int (D+1,)) and ``thresholds`` (float (D+1,)), D = number of distinct scores:
    point i accepts exactly the pairs with ``score >= thresholds[i]``; point 0 accepts nothing
    (``thresholds[0] = +inf``), point D accepts everything. Tied scores are accepted or rejected together,
    which is what makes the ROC of a tied group a diagonal segment (and AUC count a tie as 1/2).
    """
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], same[order]
    ends = np.r_[np.flatnonzero(s[1:] != s[:-1]), len(s) - 1]   # last index of each run of equal scores
    tp = np.r_[0, np.cumsum(y)[ends]]
    fp = np.r_[0, np.cumsum(~y)[ends]]
    return tp, fp, np.r_[np.inf, s[ends]]


def roc_curve(scores, same) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact ROC: (far, tar, thresholds), one point per distinct score plus the (0, 0) start.

    ``far[i]`` / ``tar[i]`` are the false / true accept rates when accepting ``score >= thresholds[i]``
    (sklearn's ``roc_curve`` without dropping collinear points; sklearn is not a dependency).
    """
    scores, same = _check(scores, same)
    tp, fp, thr = _operating_points(scores, same)
    return fp / (~same).sum(), tp / same.sum(), thr


def roc_auc(scores, same) -> float:
    """Area under the exact ROC (trapezoids), = P(score of a same pair > a different pair) + P(tie) / 2."""
    far, tar, _ = roc_curve(scores, same)
    return float(np.sum(np.diff(far) * (tar[1:] + tar[:-1]) / 2.0))


def _best_split(scores: np.ndarray, same: np.ndarray) -> Tuple[float, float]:
    """(threshold, accuracy) of the most accurate threshold; no both-classes requirement (a training split
    of the k-fold may hold one class only). The threshold is the midpoint between the lowest accepted and
    the highest rejected score, so that it generalises symmetrically to unseen scores (±inf at the ends).
    Ties in accuracy go to the strictest threshold, as ``np.argmax`` over InsightFace's ascending distance
    thresholds does."""
    tp, fp, thr = _operating_points(scores, same)
    acc = (tp + ((~same).sum() - fp)) / len(scores)
    i = int(np.argmax(acc))
    if i == 0:
        t = math.inf
    elif i == len(thr) - 1:
        t = -math.inf
    else:
        t = float((thr[i] + thr[i + 1]) / 2.0)
    return t, float(acc[i])


def best_threshold(scores, same) -> Tuple[float, float]:
    """(threshold, accuracy) of the single threshold that classifies all the given pairs best."""
    return _best_split(*_check(scores, same))


def kfold_accuracy(scores, same, n_folds: int = N_FOLDS) -> Dict[str, Any]:
    """The LFW protocol: 10-fold accuracy, threshold chosen on 9 folds, accuracy on the held-out fold.

    Folds are contiguous blocks in pair order, sized as ``sklearn.model_selection.KFold(n_splits=10,
    shuffle=False)`` sizes them (the first ``P % 10`` folds hold one extra pair), which is what InsightFace's
    ``calculate_roc`` uses: for the LFW / CFP / AgeDB ``.bin`` files this makes each fold one of the
    official splits, so the numbers are comparable with published ones. A pair file should therefore mix
    same and different pairs along its order (as those files do). Returns mean and *population* standard
    deviation (``np.std``, as InsightFace reports it) over the folds, plus each fold's accuracy and
    threshold.
    """
    scores, same = _check(scores, same)
    if len(scores) < n_folds:
        raise ValueError(f"{n_folds}-fold accuracy needs at least {n_folds} pairs, got {len(scores)}")
    fold_acc, fold_thr = [], []
    for test in np.array_split(np.arange(len(scores)), n_folds):
        train = np.ones(len(scores), dtype=bool)
        train[test] = False
        t, _ = _best_split(scores[train], same[train])
        fold_thr.append(t)
        fold_acc.append(float(np.mean((scores[test] >= t) == same[test])))
    return {"acc": float(np.mean(fold_acc)), "acc_std": float(np.std(fold_acc)),
            "fold_acc": fold_acc, "fold_threshold": fold_thr}


def tar_at_far(scores, same, far: float) -> Dict[str, Any]:
    """True accept rate at a false accept rate of at most ``far`` (threshold-based, not interpolated).

    It is the best TAR among thresholds that actually achieve ``FAR <= far`` on these pairs, so the
    number is an operating point one can deploy. With fewer than ``1 / far`` different pairs that FAR
    allows not one false accept: the figure would be "TAR at zero false accepts" under another name, so
    it is reported as ``None`` with the reason.
    """
    scores, same = _check(scores, same)
    n_neg = int((~same).sum())
    need = int(math.ceil(1.0 / far - 1e-9))
    if n_neg < need:
        return {"tar": None, "threshold": None, "far": None,
                "reason": f"{n_neg} different pairs; FAR {far_key(far)[8:]} needs at least {need}"}
    tp, fp, thr = _operating_points(scores, same)
    i = int(np.flatnonzero(fp <= far * n_neg + 1e-9)[-1])   # fp grows with i: the last allowed point
    return {"tar": float(tp[i] / same.sum()), "threshold": float(thr[i]), "far": float(fp[i] / n_neg),
            "reason": None}


def roc_points(scores, same, max_points: int = 2000) -> Dict[str, List[float]]:
    """The ROC as a step function for plotting and JSON: the best TAR at each achievable FAR.

    Only the corner of each FAR step is kept (exact up to ``max_points`` corners); beyond that the curve
    is sampled on a log-spaced FAR grid from 1 / #different pairs to 1 (the log axis is what matters).
    """
    scores, same = _check(scores, same)
    tp, fp, _ = _operating_points(scores, same)
    n_pos, n_neg = int(same.sum()), int((~same).sum())
    keep = np.r_[np.flatnonzero(fp[1:] != fp[:-1]), len(fp) - 1]   # last (highest-TAR) point per FAR
    far, tar = fp[keep] / n_neg, tp[keep] / n_pos
    if len(far) > max_points:
        grid = np.unique(np.r_[0.0, np.logspace(np.log10(1.0 / n_neg), 0.0, max_points - 1)])
        idx = np.searchsorted(far, grid + 1e-12, side="right") - 1
        far, tar = grid, tar[idx]
    return {"far": [float(v) for v in far], "tar": [float(v) for v in tar]}


def verification_metrics(scores, same, fars: Sequence[float] = FARS, n_folds: int = N_FOLDS) -> Dict[str, Any]:
    """All figures of one scorer on one pair set, JSON-able (non-finite thresholds become ``None``)."""
    scores, same = _check(scores, same)
    out: Dict[str, Any] = {"pairs": int(len(same)), "same_pairs": int(same.sum()),
                           "different_pairs": int((~same).sum())}
    out.update(kfold_accuracy(scores, same, n_folds))
    out["auc"] = roc_auc(scores, same)
    notes = {}
    for far in fars:
        r = tar_at_far(scores, same, far)
        out[far_key(far)] = r["tar"]
        if r["reason"]:
            notes[far_key(far)] = r["reason"]
    out["best_threshold"], out["best_acc"] = best_threshold(scores, same)
    out["notes"] = notes
    return _jsonable(out)


ALL_PAIRS_FARS: Tuple[float, ...] = (1e-3, 1e-4, 1e-5)
ALL_PAIRS_BINS = 200_000     # cosine in [-1, 1] in steps of 1e-5: finer than any FAR figure needs


def all_pairs_metrics(embeddings, labels, fars: Sequence[float] = ALL_PAIRS_FARS, block: int = 2048,
                      bins: int = ALL_PAIRS_BINS) -> Dict[str, Any]:
    """1:1 verification over *every* pair of distinct samples of a labelled set (IJB-style "all pairs").

    Why: a 6,000-pair protocol has 3,000 different pairs, so its TAR@FAR=1e-3 is set by the 3 highest
    impostor scores and moves by points from one training seed to the next. n samples give n(n-1)/2
    pairs (22,794 held-out glyphs: 2.6 x 10^8, of which ~10^6 same-class), so TAR@FAR=1e-3 rests on
    ~2.6 x 10^5 impostors and even 1e-5 is measured. Same-class scores are kept exactly; different-class
    scores go into a ``bins``-bin histogram over [-1, 1] (memory O(bins), not O(n^2)); the threshold of a
    FAR is the lowest bin edge whose impostor tail is at most ``far`` (so the achieved FAR never exceeds
    it), and the TAR counts the exact same-class scores at or above it.

    ``embeddings``: (n, D) rows of unit length; ``labels``: (n,) ints. Returns ``pairs``, ``same_pairs``,
    ``different_pairs``, ``auc`` and ``tar@far=...`` (with ``notes`` where a FAR is below 1 / #different).
    """
    e = torch.as_tensor(np.ascontiguousarray(embeddings), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    n = len(y)
    if e.ndim != 2 or len(e) != n or n < 2:
        raise ValueError(f"need (n, D) embeddings and (n,) labels with n >= 2; got {tuple(e.shape)} and {n}")
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
    pos = torch.cat(same_scores).double().numpy()
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
        b = int(np.flatnonzero(tail <= far * n_neg)[0])           # lowest bin whose tail is allowed
        out[far_key(far)] = float(np.mean(pos >= edges[b]))
    out["notes"] = notes
    return out


def evaluate_all_pairs(model: nn.Module, shard_dir: str, batch_size: int = 256, flip: bool = False,
                       fars: Sequence[float] = ALL_PAIRS_FARS) -> Dict[str, Any]:
    """`all_pairs_metrics` of a backbone on every sample of a (held-out) shard set, plus ``time_s``."""
    from .data import RankShardDataset
    t0 = time.perf_counter()
    ds = RankShardDataset(shard_dir, 0, 1)
    samples, labels = ds[list(range(len(ds)))]
    e = embed(model, samples.numpy(), batch_size, flip)
    out = all_pairs_metrics(e, labels.numpy(), fars)
    out["samples"], out["time_s"] = len(labels), round(time.perf_counter() - t0, 3)
    return out


def _jsonable(obj: Any) -> Any:
    """Plain Python types; ±inf / NaN -> None (JSON has no infinities)."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


# ----------------------------------------------------------------------------------------------------------
# Embedding and scoring
# ----------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _frozen(model: nn.Module) -> Iterator[torch.device]:
    """Eval mode + inference mode + a forked RNG, and everything restored afterwards.

    Each submodule's own ``training`` flag is restored (not just ``model.train(was_training)``), so a
    caller that keeps some BatchNorm frozen finds it frozen. Eval mode means BatchNorm uses (and does not
    update) its running statistics and dropout is off: no parameter or buffer changes. The RNG fork is a
    guard: nothing here draws random numbers, and if a backbone ever does, training must not notice.
    """
    flags = [(m, m.training) for m in model.modules()]
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.inference_mode():
            model.eval()
            yield device
    finally:
        for m, flag in flags:
            m.training = flag


def embed(model: nn.Module, images: np.ndarray, batch_size: int = 256, flip: bool = False) -> np.ndarray:
    """L2-normalised embeddings float32 (M, D) of uint8 images (M, H, W[, C]) or float features (M, F).

    Images get the training normalisation (`data.prepare_batch`: [-1, 1], channels first). ``flip=True``
    embeds each image and its mirror image and normalises the sum, as the face protocol does (a face
    and its mirror are the same person, and the sum is a cheap test-time augmentation). It is off by
    default because this project's default data are characters, where the mirror image of a glyph is a
    different glyph (or none at all): it would blur the very strokes that tell classes apart.
    """
    kind = "images" if images.dtype == np.uint8 else "features"
    if flip and kind != "images":
        raise ValueError("flip=True needs images; these samples are feature vectors")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = []
    with _frozen(model) as device:
        for start in range(0, len(images), batch_size):
            chunk = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size]))
            x, _ = prepare_batch(chunk, torch.zeros(len(chunk), dtype=torch.int64), device, kind)
            e = model(x)                                  # (B, D)
            if flip:
                e = e + model(torch.flip(x, dims=[3]))    # x is (B, C, H, W): mirror along W
            out.append(F.normalize(e.float(), dim=1).cpu())
    if not out:
        return np.zeros((0, 0), dtype=np.float32)
    return torch.cat(out).numpy()


def _pair_scores(embed_fn, pairs: PairSet) -> np.ndarray:
    """Cosine score per pair from an ``embed_fn(images) -> L2-normalised (m, D)``, embedding each used
    image once."""
    used, inv = np.unique(np.r_[pairs.left, pairs.right], return_inverse=True)
    images = pairs.images if len(used) == len(pairs.images) else pairs.images[used]
    e = embed_fn(images)                                 # (m, D), rows of unit length
    n = pairs.num_pairs
    return np.einsum("pd,pd->p", e[inv[:n]], e[inv[n:]]).astype(np.float64)


def score_pairs(model: nn.Module, pairs: PairSet, batch_size: int = 256, flip: bool = False) -> np.ndarray:
    """Cosine similarity float64 (P,) of each pair's embeddings."""
    return _pair_scores(lambda im: embed(model, im, batch_size, flip), pairs)


def pixel_embed(images: np.ndarray, centre: bool = False, batch_size: int = 1024) -> np.ndarray:
    """The raw-pixel "embedding": the model's input ([-1, 1], as `prepare_batch` makes it) flattened and
    L2-normalised. ``centre=True`` first subtracts each image's own mean, making the cosine the normalised
    cross-correlation (template matching, blind to brightness and contrast) — a stronger baseline than the
    plain cosine, which on glyphs is dominated by the shared background."""
    out = []
    for start in range(0, len(images), batch_size):
        x = images[start:start + batch_size]
        x = x.reshape(len(x), -1).astype(np.float32)                 # (B, H*W*C)
        if images.dtype == np.uint8:
            x = x / 127.5 - 1.0                                      # as data.prepare_batch scales images
        if centre:
            x = x - x.mean(axis=1, keepdims=True)
        out.append(x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12))
    return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)


def random_init_backbone(model_args: Dict[str, Any], seed: int = 0) -> nn.Module:
    """The same architecture as ``model_args`` (``export.load_backbone``'s second value) at a seeded random
    init, in eval mode. Built under a forked RNG so the caller's torch RNG state is untouched."""
    from .models import create_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = create_model(model_args["name"], in_shape=model_args["in_shape"],
                             embedding_dim=model_args["embedding_dim"], **model_args.get("kwargs", {}))
    return model.eval()


def check_input_shape(model_args: Dict[str, Any], pairs: PairSet) -> None:
    """Refuse a pair set whose samples are not the shape the backbone was trained on."""
    want, got = [int(v) for v in model_args["in_shape"]], list(pairs.images.shape[1:])
    if want != got:
        raise ValueError(f"pair set {pairs.name!r} has samples of shape {got}; the backbone takes {want}")


def evaluate_backbone(model: nn.Module, pairs: PairSet, batch_size: int = 256, flip: bool = False,
                      fars: Sequence[float] = FARS, roc: bool = True) -> Dict[str, Any]:
    """`verification_metrics` of a backbone on one pair set (plus ``roc`` points and ``time_s``)."""
    t0 = time.perf_counter()
    scores = score_pairs(model, pairs, batch_size, flip)
    out = verification_metrics(scores, pairs.same, fars)
    if roc:
        out["roc"] = roc_points(scores, pairs.same)
    out["time_s"] = round(time.perf_counter() - t0, 3)
    return out


def evaluate_baselines(model_args: Dict[str, Any], pairs: PairSet, batch_size: int = 256, flip: bool = False,
                       seed: int = 0, fars: Sequence[float] = FARS) -> Dict[str, Dict[str, Any]]:
    """The references a trained backbone must beat by a wide margin (if not, something is broken):

    * ``pixels``: cosine of the flattened, L2-normalised input images (no learning at all);
    * ``pixels_ncc``: the same after removing each image's mean (normalised cross-correlation);
    * ``random_init``: the same architecture at a seeded random init (what the architecture alone gives).

    ``flip`` applies to the random-init backbone only (it is what the trained backbone is compared under).
    """
    check_input_shape(model_args, pairs)
    out = {}
    for name, centre in (("pixels", False), ("pixels_ncc", True)):
        t0 = time.perf_counter()
        scores = _pair_scores(lambda im: pixel_embed(im, centre), pairs)
        out[name] = verification_metrics(scores, pairs.same, fars)
        out[name]["roc"] = roc_points(scores, pairs.same)
        out[name]["time_s"] = round(time.perf_counter() - t0, 3)
    out["random_init"] = evaluate_backbone(random_init_backbone(model_args, seed), pairs, batch_size, flip, fars)
    out["random_init"]["seed"] = seed
    return out


# ----------------------------------------------------------------------------------------------------------
# Reports: table, plot, files (what `hvd-partialfc eval` runs)
# ----------------------------------------------------------------------------------------------------------

def format_table(name: str, rows: Dict[str, Dict[str, Any]], fars: Sequence[float] = FARS) -> str:
    """A plain-text table of one pair set: one row per model/baseline, ``-`` where a TAR is undefined."""
    first = next(iter(rows.values()))
    head = (f"{name}: {first['pairs']} pairs ({first['same_pairs']} same, {first['different_pairs']} different)")
    tar_heads = "".join(f"{far_key(f).replace('tar@far=', 'TAR@'):>12}" for f in fars)
    cols = f"{'model':<28}{'acc (10-fold)':>18}{'AUC':>9}{tar_heads}{'threshold':>11}"
    lines = [head, cols]
    for key, m in rows.items():
        tars = "".join(f"{m[far_key(f)]:>12.4f}" if m[far_key(f)] is not None else f"{'-':>12}" for f in fars)
        thr = f"{m['best_threshold']:>11.4f}" if m["best_threshold"] is not None else f"{'-':>11}"
        acc = f"{m['acc']:.4f} ± {m['acc_std']:.4f}"
        lines.append(f"{BASELINE_LABELS.get(key, key):<28}{acc:>18}{m['auc']:>9.4f}{tars}{thr}")
    for key, reason in first["notes"].items():
        lines.append(f"  {key}: not reported, {reason}")
    return "\n".join(lines)


def format_all_pairs(shard_dir: str, m: Dict[str, Any]) -> str:
    """One line per FAR of `all_pairs_metrics`, for the terminal."""
    lines = [f"all pairs of {shard_dir}: {m['samples']} samples, {m['same_pairs']:,} same-class and "
             f"{m['different_pairs']:,} different-class pairs, AUC {m['auc']:.4f}"]
    for key in sorted((k for k in m if k.startswith("tar@far=")), key=lambda k: -float(k[8:])):
        lines.append(f"  {key:<14} {'-' if m[key] is None else f'{m[key]:.4f}'}  {m['notes'].get(key, '')}")
    return "\n".join(lines)


def plot_roc(results: Dict[str, Dict[str, Dict[str, Any]]], path: str) -> str:
    """One panel per pair set, one step curve per model/baseline, log-scale FAR axis; written to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(results)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 4.2 * rows), squeeze=False)
    for ax, (set_name, models) in zip(axes.flat, results.items()):
        lo = 1.0
        for key, m in models.items():
            far, tar = np.asarray(m["roc"]["far"]), np.asarray(m["roc"]["tar"])
            lo = min(lo, 1.0 / max(m["different_pairs"], 1))
            ax.plot(np.maximum(far, lo / 2), tar, drawstyle="steps-post",
                    label=f"{BASELINE_LABELS.get(key, key)} (AUC {m['auc']:.3f})")
        ax.plot([lo / 2, 1.0], [lo / 2, 1.0], ls="--", color="grey", lw=0.8, label="chance")
        ax.set_xscale("log")
        ax.set_xlim(lo / 2, 1.0)
        ax.set_ylim(0.0, 1.01)
        ax.set_xlabel("false accept rate (log)")
        ax.set_ylabel("true accept rate")
        ax.set_title(f"ROC: {set_name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def default_out_dir(backbone: str) -> str:
    """Where ``eval`` writes when no ``--out`` is given: the run/checkpoint folder, or beside the file."""
    return backbone if os.path.isdir(backbone) else (os.path.dirname(os.path.abspath(backbone)))


def evaluate_files(backbone: str, pairs_paths: Sequence[str], flip: bool = False, baselines: bool = False,
                   batch_size: int = 256, out_dir: Optional[str] = None, seed: int = 0,
                   all_pairs_dirs: Sequence[str] = ()) -> Dict[str, Any]:
    """Load a backbone (file, checkpoint or run) and pair sets, evaluate, write ``eval.json`` and
    ``roc.png`` into ``out_dir``; returns the JSON dict with ``tables`` (one text table per set) added.
    ``all_pairs_dirs``: shard sets evaluated over all their pairs (`evaluate_all_pairs`), under
    ``all_pairs`` (shard dir -> metrics) in the JSON."""
    from .export import load_backbone
    model, args = load_backbone(backbone)
    if not pairs_paths and not all_pairs_dirs:
        raise ValueError("nothing to evaluate: give pair sets and/or shard sets for all-pairs verification")
    sets = [read_pairs(p) for p in pairs_paths]
    _check_names(sets, pairs_paths)
    for s in sets:
        check_input_shape(args, s)
    out_dir = out_dir or default_out_dir(backbone)
    os.makedirs(out_dir, exist_ok=True)
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for s in sets:
        results[s.name] = {"backbone": evaluate_backbone(model, s, batch_size, flip)}
        if baselines:
            results[s.name].update(evaluate_baselines(args, s, batch_size, flip, seed))
    all_pairs = {os.path.abspath(d): evaluate_all_pairs(model, d, batch_size, flip) for d in all_pairs_dirs}
    report = {"backbone": os.path.abspath(backbone), "model": args, "flip": flip, "batch_size": batch_size,
              "pairs": {s.name: os.path.abspath(p) for s, p in zip(sets, pairs_paths)}, "sets": results,
              "all_pairs": all_pairs}
    json_path, png_path = os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "roc.png")
    write_text(json_path, json.dumps(_jsonable(report), indent=1))
    if results:
        plot_roc(results, png_path)
    report["files"] = {"json": json_path, "roc": png_path if results else None}
    report["tables"] = [format_table(name, rows) for name, rows in results.items()]
    report["tables"] += [format_all_pairs(d, m) for d, m in all_pairs.items()]
    return report


def _check_names(sets: Sequence[PairSet], paths: Sequence[str]) -> None:
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"pair sets need distinct file names (they name the results): {list(paths)}")


# ----------------------------------------------------------------------------------------------------------
# The training-loop component
# ----------------------------------------------------------------------------------------------------------

class Evaluator:
    """Verification during training: decides when (`due`) and evaluates (`run`), on rank 0 only.

    The pair sets are read and checked once, here, so a bad path fails before training rather than at
    the first evaluation. The caller, on *every* rank, asks `due(step, final)`; when it is due, all ranks
    average the BatchNorm buffers (a collective: each rank has seen different classes, so each rank's
    running statistics differ), then rank 0 calls `run`. `run` changes nothing in the backbone (see
    `embed`) and appends one JSON line per set to ``out_dir/eval.jsonl``.
    """

    def __init__(self, pairs_paths: List[str], every: int, flip: bool = False, batch_size: int = 256,
                 out_dir: str = ".", fars: Sequence[float] = FARS):
        if every < 0:
            raise ValueError(f"eval every must be >= 0 (0: only at the end), got {every}")
        self.sets = [read_pairs(p) for p in pairs_paths]
        _check_names(self.sets, pairs_paths)
        for s in self.sets:
            _check(np.zeros(s.num_pairs), s.same)      # both classes present
            if s.num_pairs < N_FOLDS:
                raise ValueError(f"pair set {s.name!r}: {s.num_pairs} pairs, the 10-fold protocol needs >= 10")
        self.every, self.flip, self.batch_size, self.fars = every, flip, batch_size, tuple(fars)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "eval.jsonl")

    @classmethod
    def from_config(cls, eval_cfg, out_dir: str) -> "Evaluator":
        """From the ``eval`` config section (``pairs``, ``every``, ``flip``, ``batch_size``)."""
        return cls(list(eval_cfg.pairs), eval_cfg.every, eval_cfg.flip, eval_cfg.batch_size, out_dir)

    def due(self, step: int, final: bool) -> bool:
        """True every ``every`` steps and at the final step (never without pair sets)."""
        return bool(self.sets) and (final or (self.every > 0 and step % self.every == 0))

    def run(self, step: int, backbone: nn.Module) -> Dict[str, Dict[str, Any]]:
        """Evaluate ``backbone`` on every set; returns ``{set name: record}`` and appends the records."""
        records = {}
        for s in self.sets:
            m = evaluate_backbone(backbone, s, self.batch_size, self.flip, self.fars, roc=False)
            rec = {"step": int(step), "set": s.name, "acc": m["acc"], "acc_std": m["acc_std"], "auc": m["auc"]}
            rec.update({far_key(f): m[far_key(f)] for f in self.fars})
            rec.update({"best_threshold": m["best_threshold"], "pairs": m["pairs"], "time_s": m["time_s"]})
            records[s.name] = rec
        os.makedirs(self.out_dir, exist_ok=True)
        with open(self.path, "a") as f:
            for rec in records.values():
                f.write(json.dumps(rec) + "\n")
        return records

    @staticmethod
    def summary(records: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
        """Short progress-bar fields: ``{"<set>_acc": "0.912", "<set>_tar@1e-3": "0.55"}``."""
        out = {}
        for name, r in records.items():
            out[f"{name}_acc"] = f"{r['acc']:.3f}"
            if r.get("tar@far=1e-3") is not None:
                out[f"{name}_tar@1e-3"] = f"{r['tar@far=1e-3']:.3f}"
        return out
