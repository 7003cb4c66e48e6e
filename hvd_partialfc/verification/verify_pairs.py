"""The pair protocol (LFW / CFP / AgeDB style, and the glyph pair sets): a fixed list of image pairs, a
cosine score per pair, 10-fold accuracy, AUC and TAR@FAR; and the baselines a backbone must beat.

`evaluate_backbone` / `evaluate_baselines` return per-set dicts (the `metrics.verification_metrics` keys
plus ``roc`` and ``time_s``). Flip is off by default here: glyphs are this project's default data and a
mirrored glyph is another glyph (see `embedding.embed`); face pair sets turn it on.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Sequence

import torch.nn as nn

from ..data.pair_files import PairSet
from .embedding import pair_scores, pixel_embed, random_init_backbone, score_pairs
from .metrics import FARS, roc_points, verification_metrics


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
        scores = pair_scores(lambda im: pixel_embed(im, centre), pairs)
        out[name] = verification_metrics(scores, pairs.same, fars)
        out[name]["roc"] = roc_points(scores, pairs.same)
        out[name]["time_s"] = round(time.perf_counter() - t0, 3)
    out["random_init"] = evaluate_backbone(random_init_backbone(model_args, seed), pairs, batch_size, flip, fars)
    out["random_init"]["seed"] = seed
    return out



def check_names(sets: Sequence[PairSet], paths: Sequence[str]) -> None:
    """Pair sets are named by their file's stem in the results: refuse two with the same stem."""
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"pair sets need distinct file names (they name the results): {list(paths)}")

