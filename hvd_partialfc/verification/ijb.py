"""IJB-B / IJB-C 1:1 template verification, on the public release layout InsightFace's evaluation reads.

``DIR`` (e.g. ``IJB_release/IJBC``) holds ``loose_crop/`` (the face images) and ``meta/`` with, for
``--ijb-name IJBC`` (``IJBB``: ``ijbb_...``):

* ``ijbc_name_5pts_score.txt``: ``image x1 y1 ... x5 y5 score`` per line: the image file, its five
  landmarks (eyes, nose, mouth corners, in that image's pixels) and the face detector's score;
* ``ijbc_face_tid_mid.txt``: ``image template_id media_id``, the same images in the same order;
* ``ijbc_template_pair_label.txt``: ``template_id template_id label`` (1: same subject, 0: different).

The protocol, as InsightFace's ``eval_ijbc.py`` defines it (all three options on by default there and
here, each can be turned off; the result records which were on):

1. each image is aligned to the ArcFace template (`align.align`, scaled to the backbone's input) and
   embedded; ``flip``: plus its mirror image's embedding (the sum);
2. ``norm_score`` on: the image feature keeps its norm (a blurred or tiny face gets a short feature and
   so less say in its template); off: it is L2-normalised first; ``detector_score`` on: the feature is
   multiplied by the detector's score;
3. template feature = sum over its media of the mean of the medium's image features, L2-normalised
   (`template_features`): the frames of one video count once together, as one still image does;
4. score of a template pair = the cosine of the two template features; figures by
   `metrics.template_metrics` (TAR at FAR = 1e-6 ... 1e-1, AUC, ROC).

Memory: images stream from disk in batches (`AlignedImages` through a ``DataLoader``, optionally with
worker processes), so what is held is the (N, D) float32 feature matrix (IJB-C: 469,375 x 512, 0.96 GB),
the (T, D) template features and the pair list, never the images. ``tests/test_ijb.py`` measures the peak
RSS at two image counts.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader

from ..forking import workers_keep_inherited_objects
from .align import align
from .embedding import embed_batch, frozen
from .metrics import IJB_FARS, template_metrics

IJB_NAMES = ("IJBB", "IJBC")


class IJBError(ValueError):
    """An IJB folder that is incomplete or inconsistent; the message names the file."""


@dataclass
class IJBMeta:
    """The three meta files of one IJB release, as arrays (row i of the image arrays is one face)."""

    name: str
    root: str
    images: List[str]           # (N,) file names under loose_crop/
    landmarks: np.ndarray       # float32 (N, 5, 2)
    det_scores: np.ndarray      # float32 (N,)
    templates: np.ndarray       # int64 (N,)
    media: np.ndarray           # int64 (N,)
    pairs: np.ndarray           # int64 (P, 2) template ids
    labels: np.ndarray          # bool (P,)

    @property
    def image_dir(self) -> str:
        return os.path.join(self.root, "loose_crop")


def meta_paths(root: str, name: str) -> Dict[str, str]:
    """The meta file of each kind (``5pts``, ``tid_mid``, ``pairs``) for an IJB ``name``."""
    if name.upper() not in IJB_NAMES:
        raise IJBError(f"unknown IJB set {name!r}; known: {', '.join(IJB_NAMES)}")
    p = name.lower()
    meta = os.path.join(root, "meta")
    return {"5pts": os.path.join(meta, f"{p}_name_5pts_score.txt"),
            "tid_mid": os.path.join(meta, f"{p}_face_tid_mid.txt"),
            "pairs": os.path.join(meta, f"{p}_template_pair_label.txt")}


def _rows(path: str, columns: int) -> List[List[str]]:
    if not os.path.isfile(path):
        raise IJBError(f"{path}: missing; an IJB folder holds loose_crop/ and meta/ as in InsightFace's "
                       f"IJB release")
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    bad = next((k for k, r in enumerate(rows) if len(r) != columns), None)
    if bad is not None:
        raise IJBError(f"{path}: line {bad + 1} has {len(rows[bad])} fields, expected {columns}")
    return rows


def read_ijb(root: str, name: str) -> IJBMeta:
    """Read and cross-check the meta files (same images in the same order, every paired template known)."""
    paths = meta_paths(root, name)
    pts = _rows(paths["5pts"], 12)
    tid = _rows(paths["tid_mid"], 3)
    if len(pts) != len(tid):
        raise IJBError(f"{paths['tid_mid']}: {len(tid)} images, {paths['5pts']} has {len(pts)}")
    names = [r[0] for r in pts]
    k = next((i for i, (a, b) in enumerate(zip(names, (r[0] for r in tid))) if a != b), None)
    if k is not None:
        raise IJBError(f"{paths['tid_mid']}: line {k + 1} names {tid[k][0]}, {paths['5pts']} names {names[k]}")
    numbers = np.array([r[1:] for r in pts], dtype=np.float32).reshape(-1, 11)
    ids = np.array([r[1:] for r in tid], dtype=np.int64).reshape(-1, 2)
    if not os.path.isfile(paths["pairs"]):
        raise IJBError(f"{paths['pairs']}: missing")
    flat = np.fromfile(paths["pairs"], dtype=np.int64, sep=" ")      # C parser: IJB-C has 15.6 M lines
    if flat.size % 3:
        raise IJBError(f"{paths['pairs']}: {flat.size} numbers, not lines of three")
    pairs = flat.reshape(-1, 3)
    if not np.isin(pairs[:, 2], (0, 1)).all():
        raise IJBError(f"{paths['pairs']}: labels must be 0 or 1")
    unknown = np.setdiff1d(pairs[:, :2], ids[:, 0])
    if len(unknown):
        raise IJBError(f"{paths['pairs']}: {len(unknown)} template ids have no image (e.g. {unknown[0]})")
    return IJBMeta(name.upper(), root, names, numbers[:, :10].reshape(-1, 5, 2), numbers[:, 10],
                   ids[:, 0], ids[:, 1], pairs[:, :2].copy(), pairs[:, 2].astype(bool))


class AlignedImages(torch.utils.data.Dataset):
    """Image i of an IJB folder, read from disk and aligned to what a backbone of ``in_shape`` takes
    (uint8 tensor (H, W[, C])). Holds only file names and landmarks."""

    def __init__(self, image_dir: str, names: Sequence[str], landmarks: np.ndarray, in_shape: Sequence[int],
                 template: Optional[np.ndarray] = None):
        self.image_dir, self.names, self.landmarks = image_dir, names, landmarks
        self.in_shape, self.template = list(in_shape), template

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> torch.Tensor:
        path = os.path.join(self.image_dir, self.names[i])
        try:
            with Image.open(path) as im:
                return torch.from_numpy(align(im, self.landmarks[i], self.in_shape, self.template))
        except (OSError, ValueError) as e:
            raise IJBError(f"{path}: cannot read or align ({type(e).__name__}: {e})") from e


def embed_images(model: nn.Module, dataset: AlignedImages, batch_size: int = 256, flip: bool = True,
                 workers: int = 0, progress: Optional[Callable[[int, int, float], None]] = None) -> np.ndarray:
    """Raw (not normalised) float32 features (N, D) of every image, batch by batch: the matrix is
    allocated once at the first batch and filled in place, nothing else grows with N."""
    if workers > 0:
        workers_keep_inherited_objects()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers)
    feats: Optional[np.ndarray] = None
    done, t0 = 0, time.perf_counter()
    with frozen(model) as device:
        for chunk in loader:
            e = embed_batch(model, chunk, device, "images", flip).cpu().numpy()   # (B, D)
            if feats is None:
                feats = np.empty((len(dataset), e.shape[1]), dtype=np.float32)
            feats[done:done + len(e)] = e
            done += len(e)
            if progress:
                progress(done, len(dataset), time.perf_counter() - t0)
    if feats is None:
        raise IJBError(f"{dataset.image_dir}: no images to embed")
    return feats


def image_features(raw: np.ndarray, det_scores: np.ndarray, norm_score: bool = True,
                   detector_score: bool = True) -> np.ndarray:
    """Step 2 of the protocol, in place on ``raw`` (N, D) float32, which it returns."""
    if not norm_score:
        raw /= np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
    if detector_score:
        raw *= np.asarray(det_scores, dtype=np.float32)[:, None]
    return raw


def template_features(feats: np.ndarray, templates, media, block: int = 65536) -> Tuple[np.ndarray, np.ndarray]:
    """(template ids (T,) sorted, L2-normalised features float32 (T, D)): each template the sum over its
    media of the mean of the medium's image features.

    Sum of means = sum over images of ``f_i / n(medium of i)``: one weighted scatter-add over the images
    (in blocks of ``block`` rows), no (media, D) matrix."""
    templates, media = np.asarray(templates, dtype=np.int64), np.asarray(media, dtype=np.int64)
    if not (len(feats) == len(templates) == len(media)):
        raise ValueError(f"{len(feats)} features, {len(templates)} template ids, {len(media)} media ids")
    _, group, count = np.unique(np.stack([templates, media], 1), axis=0, return_inverse=True, return_counts=True)
    weight = (1.0 / count[group.reshape(-1)]).astype(np.float32)      # 1 / images in this image's medium
    ids, row = np.unique(templates, return_inverse=True)
    out = torch.zeros((len(ids), feats.shape[1]), dtype=torch.float32)
    for s in range(0, len(feats), block):
        f = torch.from_numpy(np.ascontiguousarray(feats[s:s + block]))
        out.index_add_(0, torch.from_numpy(row[s:s + block].reshape(-1)), f * torch.from_numpy(weight[s:s + block, None]))
    return ids, F.normalize(out, dim=1).numpy()


def score_template_pairs(ids: np.ndarray, feats: np.ndarray, pairs: np.ndarray, block: int = 1 << 20) -> np.ndarray:
    """Cosine float64 (P,) of each template pair (template ids, rows of ``ids``/``feats``), in blocks."""
    left, right = np.searchsorted(ids, pairs[:, 0]), np.searchsorted(ids, pairs[:, 1])
    scores = np.empty(len(pairs), dtype=np.float64)
    for s in range(0, len(pairs), block):
        scores[s:s + block] = np.einsum("pd,pd->p", feats[left[s:s + block]], feats[right[s:s + block]])
    return scores


def print_progress(every_s: float = 10.0) -> Callable[[int, int, float], None]:
    """A progress callback printing images done, images/s and the time left, at most every ``every_s``."""
    last = [-every_s]

    def report(done: int, total: int, elapsed: float) -> None:
        if elapsed - last[0] >= every_s or done == total:
            last[0] = elapsed
            rate = done / max(elapsed, 1e-9)
            print(f"ijb: {done:,}/{total:,} images, {rate:,.0f} images/s, {(total - done) / max(rate, 1e-9):,.0f} s left",
                  file=sys.stderr, flush=True)
    return report


def evaluate_ijb(model: nn.Module, in_shape: Sequence[int], root: str, name: str = "IJBC", batch_size: int = 256,
                 flip: bool = True, norm_score: bool = True, detector_score: bool = True, workers: int = 0,
                 fars: Sequence[float] = IJB_FARS, template: Optional[np.ndarray] = None,
                 progress: Optional[Callable[[int, int, float], None]] = None) -> Dict[str, Any]:
    """The IJB 1:1 protocol of a backbone on the release at ``root``: `metrics.template_metrics` plus the
    counts, the options that were on, and times. ``template``: the alignment target (default: ArcFace's,
    scaled to ``in_shape``)."""
    t0 = time.perf_counter()
    meta = read_ijb(root, name)
    ds = AlignedImages(meta.image_dir, meta.images, meta.landmarks, in_shape, template)
    raw = embed_images(model, ds, batch_size, flip, workers, progress)
    embed_s = time.perf_counter() - t0
    ids, tfeat = template_features(image_features(raw, meta.det_scores, norm_score, detector_score),
                                   meta.templates, meta.media)
    del raw
    scores = score_template_pairs(ids, tfeat, meta.pairs)
    out = template_metrics(scores, meta.labels, fars)
    out.update({"name": meta.name, "root": os.path.normpath(root), "images": len(meta.images),
                "templates": int(len(ids)), "media": int(len(np.unique(np.stack([meta.templates, meta.media], 1), axis=0))),
                "flip": flip, "norm_score": norm_score, "detector_score": detector_score,
                "in_shape": [int(v) for v in in_shape], "embed_s": round(embed_s, 3),
                "images_per_s": round(len(meta.images) / max(embed_s, 1e-9), 1),
                "time_s": round(time.perf_counter() - t0, 3)})
    return out
