"""A small IJB-shaped set made from aligned samples (held-out glyph classes): the IJB protocol end to end
on data whose answer is known.

The real IJB-B/C hold "loose crops" (a face somewhere in a larger image, at some scale and roll), five
landmarks per image from a detector, and templates made of several media (stills, video frames). This
writes the same layout (`hvd_partialfc.verification.ijb`: ``loose_crop/``, ``meta/<name>_*.txt``) from
samples that are *already aligned* (a shard set's images):

* every class gets ``templates`` templates; a template has 1..``max_media`` media, each medium one sample
  of the class (different samples across the class's templates while the class has enough: for glyphs,
  different fonts), shown in 1..``max_frames`` frames;
* a frame is the sample placed on a larger black canvas by a random similarity transform (roll within
  ±``rotation`` degrees, scale in ``scale``, random position, the whole sample inside the canvas); its
  landmarks are the ArcFace template (scaled to the sample's size) under the same transform, plus
  Gaussian noise of ``landmark_noise`` sample pixels, like a detector's error; its "detector score" is
  uniform in [0.6, 1);
* pairs: every two templates of the same class (label 1) and ``impostor_pairs`` distinct pairs of
  templates of different classes (label 0; all of them when there are fewer).

Aligning a frame with its landmarks gives back the sample (up to interpolation and the noise), so the
figure of a backbone on this set is its figure on the aligned samples, and any alignment error shows.
Seeded: the same samples and options give the same files. Written into a temporary folder renamed at the
end (`data_tools.shard_writer.AtomicShardDir`).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from hvd_partialfc.verification.align import apply_transform, arcface_template, warp
from hvd_partialfc.verification.ijb import meta_paths

from .pair_sets import load_shard_set
from .shard_writer import AtomicShardDir

INFO = "glyph_ijb.json"


def _frame(sample: np.ndarray, rng: np.random.Generator, canvas: int, rotation: float,
           scale: Tuple[float, float]) -> Tuple[Image.Image, np.ndarray]:
    """(loose crop, (2, 3) transform sample -> crop): ``sample`` rolled, scaled and placed on the canvas."""
    h, w = sample.shape[:2]
    theta, s = math.radians(rng.uniform(-rotation, rotation)), rng.uniform(*scale)
    rot = s * np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    corners = np.array([[-0.5, -0.5], [w - 0.5, -0.5], [-0.5, h - 0.5], [w - 0.5, h - 0.5]])
    centre = np.array([(w - 1) / 2.0, (h - 1) / 2.0])
    span = np.abs((corners - centre) @ rot.T).max(axis=0)            # half extent of the placed sample
    slack = np.maximum(canvas / 2.0 - 0.5 - span, 0.0)
    target = np.array([(canvas - 1) / 2.0] * 2) + rng.uniform(-slack, slack)
    m = np.c_[rot, target - rot @ centre]
    return warp(Image.fromarray(sample), m, (canvas, canvas)), m


def _impostors(template_class: np.ndarray, want: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``want`` distinct (i, j), i < j, template index pairs of different classes."""
    n = len(template_class)
    same_class = np.bincount(np.unique(template_class, return_inverse=True)[1].reshape(-1))
    total = n * (n - 1) // 2 - int((same_class * (same_class - 1) // 2).sum())
    if total <= want:
        i, j = np.triu_indices(n, 1)
        keep = template_class[i] != template_class[j]
        return np.stack([i[keep], j[keep]], 1)
    chosen: set = set()
    while len(chosen) < want:
        i, j = rng.integers(0, n, (2, 2 * (want - len(chosen)) + 16))
        for a, b in zip(np.minimum(i, j).tolist(), np.maximum(i, j).tolist()):
            if a != b and template_class[a] != template_class[b]:
                chosen.add((a, b))
                if len(chosen) == want:
                    break
    return np.array(sorted(chosen), dtype=np.int64)


def _write_templates(tmp: str, images: np.ndarray, labels: np.ndarray, rng: np.random.Generator, templates: int,
                     max_media: int, max_frames: int, canvas: int, rotation: float, scale: Tuple[float, float],
                     landmark_noise: float) -> Tuple[List[str], List[str], List[int], int]:
    """Each class's ``templates`` templates (1..``max_media`` media of 1..``max_frames`` loose crops each), the
    crops written to ``tmp/loose_crop``: the 5-point rows, the (file, template, media) rows, each template's
    class and the media count. One generator in one order, so a seed gives the same set."""
    h, w = images.shape[1:3]
    tmpl = arcface_template(h, w)
    rows_5pts: List[str] = []
    rows_tid: List[str] = []
    template_class: List[int] = []
    media_id = 0
    for c in np.unique(labels):
        pool = rng.permutation(np.flatnonzero(labels == c))
        used = 0
        for _ in range(templates):
            template_class.append(int(c))
            tid = len(template_class)
            for _ in range(int(rng.integers(1, max_media + 1))):
                media_id += 1
                sample = images[pool[used % len(pool)]]
                used += 1
                for _ in range(int(rng.integers(1, max_frames + 1))):
                    crop, m = _frame(sample, rng, canvas, rotation, scale)
                    pts = apply_transform(m, tmpl) + rng.normal(0.0, landmark_noise, (5, 2)) * np.sqrt(
                        abs(np.linalg.det(m[:, :2])))
                    file = f"{len(rows_5pts) + 1}.png"
                    crop.save(os.path.join(tmp, "loose_crop", file))
                    score = rng.uniform(0.6, 1.0)
                    rows_5pts.append(file + " " + " ".join(f"{v:.3f}" for v in pts.reshape(-1)) + f" {score:.4f}")
                    rows_tid.append(f"{file} {tid} {media_id}")
    return rows_5pts, rows_tid, template_class, media_id


def write_glyph_ijb(images: np.ndarray, labels: Sequence[int], out: str, name: str = "IJBC", seed: int = 0,
                    templates: int = 3, max_media: int = 2, max_frames: int = 2, rotation: float = 25.0,
                    scale: Tuple[float, float] = (0.8, 1.5), landmark_noise: float = 0.3,
                    impostor_pairs: int = 100_000, overwrite: bool = False,
                    source: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write the IJB-shaped set of aligned ``images`` (uint8 (N, H, W[, C])) with class ``labels`` (N,) to
    ``out``; returns the summary also written to ``out/glyph_ijb.json``."""
    images, labels = np.asarray(images), np.asarray(labels, dtype=np.int64)
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or len(images) != len(labels):
        raise ValueError(f"need uint8 (N, H, W[, C]) images and (N,) labels; got {images.dtype} {images.shape} "
                         f"and {labels.shape}")
    if len(np.unique(labels)) < 2:
        raise ValueError("an IJB-shaped set needs at least two classes")
    rng = np.random.default_rng(seed)
    h, w = images.shape[1:3]
    canvas = int(math.ceil(max(h, w) * scale[1] * math.sqrt(2))) + 4
    paths = meta_paths(out, name)
    with AtomicShardDir(out, overwrite) as tmp:
        os.makedirs(os.path.join(tmp, "loose_crop"))
        os.makedirs(os.path.join(tmp, "meta"))
        rows_5pts, rows_tid, template_class, media_id = _write_templates(
            tmp, images, labels, rng, templates, max_media, max_frames, canvas, rotation, scale, landmark_noise)
        cls = np.asarray(template_class)
        gi, gj = np.triu_indices(len(cls), 1)
        genuine = np.stack([gi, gj], 1)[cls[gi] == cls[gj]]
        impostor = _impostors(cls, impostor_pairs, rng)
        pairs = np.r_[np.c_[genuine + 1, np.ones(len(genuine), np.int64)],
                      np.c_[impostor + 1, np.zeros(len(impostor), np.int64)]]
        rel = {k: os.path.relpath(p, out) for k, p in paths.items()}
        with open(os.path.join(tmp, rel["5pts"]), "w") as f:
            f.write("\n".join(rows_5pts) + "\n")
        with open(os.path.join(tmp, rel["tid_mid"]), "w") as f:
            f.write("\n".join(rows_tid) + "\n")
        with open(os.path.join(tmp, rel["pairs"]), "w") as f:
            f.write("\n".join(f"{a} {b} {y}" for a, b, y in pairs.tolist()) + "\n")
        info = {"name": name.upper(), "classes": int(len(np.unique(labels))), "templates": int(len(cls)),
                "media": media_id, "images": len(rows_5pts), "same_pairs": int(len(genuine)),
                "different_pairs": int(len(impostor)), "sample_shape": list(images.shape[1:]), "canvas": canvas,
                "seed": seed, "rotation": rotation, "scale": list(scale), "landmark_noise": landmark_noise,
                "source": source or {}}
        with open(os.path.join(tmp, INFO), "w") as f:
            json.dump(info, f, indent=1)
    return info


def glyph_ijb_from_shards(shard_dir: str, out: str, **kwargs: Any) -> Dict[str, Any]:
    """`write_glyph_ijb` of every sample of a (held-out) shard set of images."""
    _, labels, _ = load_shard_set(shard_dir)
    images, _, _ = load_shard_set(shard_dir, np.arange(len(labels)))
    return write_glyph_ijb(images, labels, out, source={"shards": shard_dir}, **kwargs)
