"""Five-point face alignment: landmarks -> the ArcFace template, by a least-squares similarity transform.

Every published IJB / LFW figure of an ArcFace model is measured on crops made this way, so a model's
numbers reproduce only if evaluation aligns as training did. The template is the standard one of the
112x112 ArcFace crop (left eye, right eye, nose tip, left and right mouth corners, in pixels)
`ARCFACE_TEMPLATE_112`; for another input size it is scaled to that size (`arcface_template`), which is
how a 32x32 glyph backbone is evaluated with the same code.

Coordinates follow the convention of the landmark files and of OpenCV: pixel (x, y) has its centre at
integer (x, y). Pillow's ``Image.transform`` samples at pixel centres ``(x + 0.5, y + 0.5)``; `warp`
converts, so an image point at (x, y) lands exactly at ``M @ (x, y, 1)`` (``tests/test_ijb.py`` checks it
against a bilinear reference written in numpy). numpy + Pillow only: no OpenCV, no scikit-image.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
from PIL import Image

ARCFACE_TEMPLATE_112 = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                                 [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)


def arcface_template(height: int, width: int) -> np.ndarray:
    """The five template points (5, 2) for an (height, width) crop: the 112x112 template scaled per axis."""
    return ARCFACE_TEMPLATE_112 * np.array([width / 112.0, height / 112.0])


def similarity_transform(src, dst) -> np.ndarray:
    """The (2, 3) similarity (rotation, uniform scale, translation; no reflection, no shear) that maps
    ``src`` points (K, 2) closest to ``dst`` (K, 2) in the least-squares sense, K >= 2.

    With ``x' = a x - b y + tx``, ``y' = b x + a y + ty`` the problem is linear in (a, b, tx, ty), so one
    ``lstsq`` solves it (the same optimum as Umeyama's closed form, which a reflection-free 2-D similarity
    reduces to)."""
    src, dst = np.asarray(src, dtype=np.float64), np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or len(src) < 2:
        raise ValueError(f"need two (K, 2) point sets with K >= 2, got {src.shape} and {dst.shape}")
    k = len(src)
    a = np.zeros((2 * k, 4))
    a[0::2] = np.c_[src[:, 0], -src[:, 1], np.ones(k), np.zeros(k)]
    a[1::2] = np.c_[src[:, 1], src[:, 0], np.zeros(k), np.ones(k)]
    (ca, cb, tx, ty), *_ = np.linalg.lstsq(a, dst.reshape(-1), rcond=None)
    return np.array([[ca, -cb, tx], [cb, ca, ty]])


def apply_transform(m: np.ndarray, points) -> np.ndarray:
    """``M @ (x, y, 1)`` for each row of ``points`` (K, 2)."""
    points = np.asarray(points, dtype=np.float64)
    return points @ m[:, :2].T + m[:, 2]


def warp(image: Image.Image, m: np.ndarray, size: Tuple[int, int], fill: int = 0) -> Image.Image:
    """``image`` warped by the (2, 3) affine ``m`` (source pixel -> output pixel) into a ``size`` =
    (width, height) image, bilinear, ``fill`` outside the source (black, as InsightFace's warp)."""
    a, t = m[:, :2], m[:, 2]
    inv = np.linalg.inv(a)
    # output centre o (integer convention) samples the source at inv @ (o - t); in Pillow's convention
    # both sides shift by 0.5: src_p = inv @ out_p + (0.5 - inv @ (0.5 + t))
    offset = 0.5 - inv @ (np.array([0.5, 0.5]) + t)
    data = (inv[0, 0], inv[0, 1], offset[0], inv[1, 0], inv[1, 1], offset[1])
    fillcolor = fill if image.mode == "L" else (fill,) * len(image.getbands())
    return image.transform(size, Image.AFFINE, data=data, resample=Image.BILINEAR, fillcolor=fillcolor)


def align(image: Image.Image, landmarks, in_shape: Sequence[int], template=None) -> np.ndarray:
    """The crop a backbone taking ``in_shape`` ((H, W) grayscale or (H, W, C)) sees: uint8 (H, W[, C]).

    ``landmarks``: (5, 2) points in ``image``; ``template``: where they should land (default: the ArcFace
    template scaled to (H, W)). The image is converted to grayscale (``L``) or RGB first, as the shards
    store samples (`hvd_partialfc.data.shards.decode_image`)."""
    h, w = int(in_shape[0]), int(in_shape[1])
    gray = len(in_shape) == 2 or in_shape[-1] == 1
    image = image.convert("L" if gray else "RGB")
    dst = arcface_template(h, w) if template is None else np.asarray(template, dtype=np.float64)
    out = np.array(warp(image, similarity_transform(landmarks, dst), (w, h)), dtype=np.uint8)   # writable
    return out.reshape(tuple(int(v) for v in in_shape))
