"""Verification pair sets: reading (and writing) the two formats the evaluation takes.

* ``*.h5`` (written by ``hvd-partialfc-shards pairs``): datasets ``images`` uint8 (M, H, W[, C]) — or
  ``encoded`` variable-length uint8 (M,) with attribute ``sample_shape`` — plus ``pairs`` int64 (P, 2)
  (indices into the images) and ``same`` bool (P,); attributes ``format`` = "hvd_partialfc.pairs",
  ``version`` = 1, and optional ``class_names`` / ``labels`` (int64 (M,)) of the images.
* ``*.bin`` (the LFW / CFP / AgeDB files face users already have, InsightFace's ``load_bin``): a pickle
  of ``(list of encoded images, list of bools)`` where images 2k and 2k+1 form pair k.

Both read into one `PairSet` with decoded uint8 images.
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import List, Optional, Sequence

import h5py
import numpy as np

from .atomic import atomic_path
from .shards import decode_image

FORMAT = "hvd_partialfc.pairs"
VERSION = 1


@dataclass
class PairSet:
    name: str
    images: np.ndarray      # uint8 (M, H, W) or (M, H, W, C)
    left: np.ndarray        # int64 (P,) image index of each pair's first image
    right: np.ndarray       # int64 (P,)
    same: np.ndarray        # bool (P,)

    @property
    def num_pairs(self) -> int:
        return len(self.same)


def read_pairs(path: str) -> PairSet:
    """Read a ``.h5`` pair set or an LFW-style ``.bin`` file."""
    name = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".bin"):
        with open(path, "rb") as f:
            try:
                blobs, issame = pickle.load(f)
            except UnicodeDecodeError:  # files pickled by Python 2 (the original InsightFace bins)
                f.seek(0)
                blobs, issame = pickle.load(f, encoding="bytes")
        if len(blobs) != 2 * len(issame):
            raise ValueError(f"{path}: {len(blobs)} images for {len(issame)} pairs (expected 2 per pair)")
        first = decode_image(blobs[0])
        images = np.stack([decode_image(b, first.shape) for b in blobs])
        idx = np.arange(len(issame), dtype=np.int64)
        return PairSet(name, images, 2 * idx, 2 * idx + 1, np.asarray(issame, dtype=bool))
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path}: not a hvd_partialfc pair set (format={f.attrs.get('format')!r})")
        if "images" in f:
            images = f["images"][:]
        else:
            shape = [int(s) for s in f.attrs["sample_shape"]]
            images = np.stack([decode_image(b, shape) for b in f["encoded"][:]])
        pairs = f["pairs"][:].astype(np.int64)
        same = f["same"][:].astype(bool)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or len(pairs) != len(same):
        raise ValueError(f"{path}: pairs must be (P, 2) with P flags, got {pairs.shape} and {same.shape}")
    if len(pairs) and (pairs.min() < 0 or pairs.max() >= len(images)):
        raise ValueError(f"{path}: pair indices outside [0, {len(images)})")
    return PairSet(name, images, pairs[:, 0].copy(), pairs[:, 1].copy(), same)


def write_pairs_h5(path: str, images: np.ndarray, pairs: np.ndarray, same: np.ndarray,
                   labels: Optional[np.ndarray] = None, class_names: Optional[List[str]] = None) -> None:
    """Write a ``.h5`` pair set (raw uint8 images), atomically."""
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("images", data=np.asarray(images, dtype=np.uint8))
        f.create_dataset("pairs", data=np.asarray(pairs, dtype=np.int64).reshape(-1, 2))
        f.create_dataset("same", data=np.asarray(same, dtype=bool))
        if labels is not None:
            f.create_dataset("labels", data=np.asarray(labels, dtype=np.int64))
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        if class_names is not None:
            f.attrs["class_names"] = np.array(class_names, dtype=h5py.string_dtype())


def write_bin(path: str, encoded_images: Sequence[bytes], issame: Sequence[bool]) -> None:
    """Write an LFW-style ``.bin`` (what InsightFace writes: a pickle of (list of bytes, list of bools)),
    atomically: images 2k and 2k+1 form pair k."""
    if len(encoded_images) != 2 * len(issame):
        raise ValueError(f"{len(encoded_images)} images for {len(issame)} pairs (expected 2 per pair)")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump((list(encoded_images), list(bool(s) for s in issame)), f, protocol=4)
