"""Verification and identification figures, pure numpy (no torch, no files, no Horovod).

Verification works over ``scores`` (float (P,), higher = more likely the same class) and ``same`` (bool
(P,)); a pair is *accepted* at threshold ``t`` when ``score >= t``: `roc_curve`, `roc_auc`,
`best_threshold`, `kfold_accuracy`, `tar_at_far`, `roc_points`, `verification_metrics` (the pair
protocols' bundle, 10-fold accuracy included) and `template_metrics` (the IJB bundle: no folds, FARs down
to 1e-6). Identification works over each probe's best gallery candidates (`rank_accuracy`,
`tpir_at_fpir`). `jsonable` makes any result JSON-safe.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

FARS: Tuple[float, ...] = (1e-2, 1e-3, 1e-4)
N_FOLDS = 10


def far_key(far: float) -> str:
    """``1e-3`` -> ``"tar@far=1e-3"`` (the key used in records and JSON)."""
    mantissa, exponent = f"{far:.0e}".split("e")
    return f"tar@far={mantissa}e{int(exponent)}"


def check_scores(scores, same) -> Tuple[np.ndarray, np.ndarray]:
    """(float64 scores, bool same), flat; raises on a length mismatch, a non-finite score, or a set
    without both same and different pairs (no ROC exists then)."""
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
    scores, same = check_scores(scores, same)
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
    return _best_split(*check_scores(scores, same))


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
    scores, same = check_scores(scores, same)
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
    scores, same = check_scores(scores, same)
    return _tar_at_far_points(*_operating_points(scores, same), far)


def _tar_at_far_points(tp: np.ndarray, fp: np.ndarray, thr: np.ndarray, far: float) -> Dict[str, Any]:
    """`tar_at_far` from precomputed `_operating_points` (one sort serves every FAR)."""
    n_pos, n_neg = int(tp[-1]), int(fp[-1])
    need = int(math.ceil(1.0 / far - 1e-9))
    if n_neg < need:
        return {"tar": None, "threshold": None, "far": None,
                "reason": f"{n_neg} different pairs; FAR {far_key(far)[8:]} needs at least {need}"}
    i = int(np.flatnonzero(fp <= far * n_neg + 1e-9)[-1])   # fp grows with i: the last allowed point
    return {"tar": float(tp[i] / n_pos), "threshold": float(thr[i]), "far": float(fp[i] / n_neg),
            "reason": None if i > 0 else top_tie_reason(far, int(fp[1]), n_neg, "score")}


def top_tie_reason(far: float, top_impostors: int, n_neg: int, where: str) -> str:
    """Why TAR is 0 at ``far``: the highest ``where`` (one tied score, or the all-pairs histogram's top bin)
    alone holds ``top_impostors`` different pairs, more than the FAR allows, so only accepting nothing keeps
    it. Collapsed embeddings (a diverged run: every pair scores about 1) give exactly this; the exact and the
    binned protocols say it in the same words."""
    allowed = int(math.floor(far * n_neg + 1e-9))
    return (f"TAR 0: the top {where} alone holds {top_impostors} of {n_neg} different pairs, more than FAR "
            f"{far_key(far)[8:]} allows ({allowed}); only accepting nothing keeps it (collapsed embeddings?)")


def roc_points(scores, same, max_points: int = 2000) -> Dict[str, List[float]]:
    """The ROC as a step function for plotting and JSON: the best TAR at each achievable FAR.

    Only the corner of each FAR step is kept (exact up to ``max_points`` corners); beyond that the curve
    is sampled on a log-spaced FAR grid from 1 / #different pairs to 1 (the log axis is what matters).
    """
    scores, same = check_scores(scores, same)
    tp, fp, _ = _operating_points(scores, same)
    return _roc_points_from(tp, fp, max_points)


def _roc_points_from(tp: np.ndarray, fp: np.ndarray, max_points: int) -> Dict[str, List[float]]:
    """`roc_points` from precomputed `_operating_points`."""
    n_pos, n_neg = int(tp[-1]), int(fp[-1])
    keep = np.r_[np.flatnonzero(fp[1:] != fp[:-1]), len(fp) - 1]   # last (highest-TAR) point per FAR
    far, tar = fp[keep] / n_neg, tp[keep] / n_pos
    if len(far) > max_points:
        grid = np.unique(np.r_[0.0, np.logspace(np.log10(1.0 / n_neg), 0.0, max_points - 1)])
        idx = np.searchsorted(far, grid + 1e-12, side="right") - 1
        far, tar = grid, tar[idx]
    return {"far": [float(v) for v in far], "tar": [float(v) for v in tar]}


def verification_metrics(scores, same, fars: Sequence[float] = FARS, n_folds: int = N_FOLDS) -> Dict[str, Any]:
    """All figures of one scorer on one pair set, JSON-able (non-finite thresholds become ``None``)."""
    scores, same = check_scores(scores, same)
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
    return jsonable(out)



IJB_FARS: Tuple[float, ...] = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def template_metrics(scores, same, fars: Sequence[float] = IJB_FARS, max_points: int = 2000) -> Dict[str, Any]:
    """The IJB-B/C 1:1 figures of template-pair scores: counts, AUC, ``tar@far=...`` (as `tar_at_far`,
    ``None`` with a note where there are too few different pairs) and the ``roc`` points.

    No 10-fold accuracy: the IJB protocol reports TAR at fixed FARs only. One sort serves every figure,
    which matters at IJB-C's 15.6 M pairs (about 2 s a sort here). TAR@FAR is the best TAR among
    thresholds whose FAR is at most the target; InsightFace's ``eval_ijbc.py`` instead reads the ROC
    point whose FAR is *nearest* the target, which may lie a little above it: on a large set the two
    differ in the fourth decimal.
    """
    scores, same = check_scores(scores, same)
    tp, fp, thr = _operating_points(scores, same)
    far_, tar_ = fp / fp[-1], tp / tp[-1]
    out: Dict[str, Any] = {"pairs": int(len(same)), "same_pairs": int(tp[-1]), "different_pairs": int(fp[-1]),
                           "auc": float(np.sum(np.diff(far_) * (tar_[1:] + tar_[:-1]) / 2.0))}
    notes = {}
    for far in fars:
        r = _tar_at_far_points(tp, fp, thr, far)
        out[far_key(far)] = r["tar"]
        if r["reason"]:
            notes[far_key(far)] = r["reason"]
    out["notes"] = notes
    out["roc"] = _roc_points_from(tp, fp, max_points)
    return jsonable(out)


def rank_accuracy(candidates, mates, k: int) -> float:
    """Fraction of mated probes whose mate is among their first ``k`` candidates.

    ``candidates``: int (Q, K >= k), each probe's gallery ids, best first; ``mates``: int (Q,), the
    probe's true gallery id."""
    candidates, mates = np.asarray(candidates), np.asarray(mates).reshape(-1)
    if candidates.ndim != 2 or len(candidates) != len(mates) or candidates.shape[1] < k or not len(mates):
        raise ValueError(f"need (Q, >={k}) candidates for Q >= 1 mates; got {candidates.shape} and {mates.shape}")
    return float(np.mean((candidates[:, :k] == mates[:, None]).any(axis=1)))


def tpir_at_fpir(mated_scores, mated_hit, nonmated_scores, fpir: float) -> Dict[str, Any]:
    """Rank-1 true positive identification rate at a false positive identification rate of at most
    ``fpir`` (NIST FRVT's definition, as TPIR = 1 - FNIR).

    ``nonmated_scores``: float (N,), the best gallery score of each probe whose class is not in the
    gallery: it raises a false alarm when that score clears the threshold. ``mated_scores`` / ``mated_hit``:
    float / bool (Q,), each mated probe's best gallery score and whether that best candidate is its mate:
    it is identified when it is a hit *and* clears the threshold. The threshold is the lowest one that
    lets at most ``floor(fpir * N)`` non-mated probes through (a probe passes when its score is strictly
    above the (m+1)-th highest non-mated score), so the achieved FPIR never exceeds ``fpir``. With fewer
    than ``1 / fpir`` non-mated probes the figure is ``None`` with the reason, as `tar_at_far` does.
    """
    nm = np.sort(np.asarray(nonmated_scores, dtype=np.float64).reshape(-1))[::-1]
    ms = np.asarray(mated_scores, dtype=np.float64).reshape(-1)
    hit = np.asarray(mated_hit, dtype=bool).reshape(-1)
    if len(ms) != len(hit) or not len(ms):
        raise ValueError(f"need Q >= 1 mated scores and hits; got {len(ms)} and {len(hit)}")
    need = int(math.ceil(1.0 / fpir - 1e-9))
    if len(nm) < need:
        return {"tpir": None, "threshold": None, "fpir": None,
                "reason": f"{len(nm)} non-mated probes; FPIR {fpir:g} needs at least {need}"}
    m = int(math.floor(fpir * len(nm) + 1e-9))          # false alarms allowed
    thr = nm[m] if m < len(nm) else -math.inf           # accept scores strictly above it
    return {"tpir": float(np.mean(hit & (ms > thr))), "threshold": float(thr),
            "fpir": float(np.mean(nm > thr)), "reason": None}


def jsonable(obj: Any) -> Any:
    """Plain Python types; ±inf / NaN -> None (JSON has no infinities)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj

