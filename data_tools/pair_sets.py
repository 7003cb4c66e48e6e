"""Verification pairs from a shard set of held-out classes, and ``.bin`` <-> ``.h5`` conversion.

``make_pairs`` draws ``num_pairs`` pairs, half "same" (two distinct samples of one class) and half
"different" (one sample from each of two distinct classes), from a seeded generator: the same shard set and
seed give the same file. Only the images the pairs use are written, in shard order. The output formats
are those of `hvd_partialfc.data.pair_files` (the evaluation reads both); `write_pairs_h5` and `write_bin` write them.
"""
from __future__ import annotations

import os
import pickle
from typing import List, Optional, Sequence, Tuple

import h5py
import numpy as np

from hvd_partialfc.atomic import atomic_file, atomic_path
from hvd_partialfc.data.pair_files import FORMAT, VERSION, read_pairs
from hvd_partialfc.data.shards import ShardError, open_shard, read_manifest, read_shard_labels, unreadable_shard


def load_shard_set(shard_dir: str, positions: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray, List[str]]:
    """(uint8 images (M, H, W[, C]) at ``positions`` (all when None), global labels (all), class names)."""
    from hvd_partialfc.data.shards import decode_image
    m = read_manifest(shard_dir)
    labels = []
    for s in m.shards:
        labels.append(read_shard_labels(os.path.join(shard_dir, s.file)))
    labels = np.concatenate(labels)
    if positions is None:
        return np.zeros((0,)), labels, m.class_names
    offsets = np.cumsum([0] + [s.num_samples for s in m.shards])
    out = []
    for i, s in enumerate(m.shards):
        local = positions[(positions >= offsets[i]) & (positions < offsets[i + 1])] - offsets[i]
        if not len(local):
            continue
        path = os.path.join(shard_dir, s.file)
        with open_shard(path) as f:
            try:
                block = f[m.kind][np.sort(local)]
            except (KeyError, OSError) as e:
                raise unreadable_shard(path, "samples", e) from e
        if m.kind == "encoded":
            block = np.stack([decode_image(b, m.sample_shape) for b in block])
        elif m.kind != "images":
            raise ShardError(f"{shard_dir}: pairs need image samples, the set holds {m.kind}")
        out.append(block)
    return np.concatenate(out), labels, m.class_names


def sample_pairs(labels: np.ndarray, num_pairs: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(pairs int64 (P, 2) of sample positions, same bool (P,)); P/2 same (rounded up), the rest different."""
    classes, counts = np.unique(labels, return_counts=True)
    multi = classes[counts >= 2]
    if len(multi) == 0:
        raise ShardError("no class has two samples: cannot form 'same' pairs")
    if len(classes) < 2:
        raise ShardError("only one class: cannot form 'different' pairs")
    by_class = {c: np.flatnonzero(labels == c) for c in classes}
    rng = np.random.default_rng(seed)
    n_same = (num_pairs + 1) // 2
    pairs, same = [], []
    for _ in range(n_same):
        i, j = rng.choice(by_class[multi[rng.integers(len(multi))]], 2, replace=False)
        pairs.append((i, j))
        same.append(True)
    for _ in range(num_pairs - n_same):
        a, b = rng.choice(len(classes), 2, replace=False)
        pairs.append((rng.choice(by_class[classes[a]]), rng.choice(by_class[classes[b]])))
        same.append(False)
    order = rng.permutation(num_pairs)          # interleave same/different
    return np.asarray(pairs, dtype=np.int64)[order], np.asarray(same, dtype=bool)[order]


def make_pairs(shard_dir: str, out: str, num_pairs: int, seed: int = 0, as_bin: bool = False) -> dict:
    if num_pairs < 2:
        raise ValueError(f"--num-pairs must be >= 2, got {num_pairs}")
    _, labels, names = load_shard_set(shard_dir)
    pairs, same = sample_pairs(labels, num_pairs, seed)
    used, inverse = np.unique(pairs.reshape(-1), return_inverse=True)
    images, _, _ = load_shard_set(shard_dir, used)
    local = inverse.reshape(-1, 2).astype(np.int64)
    if as_bin or out.endswith(".bin"):
        from .storage import encode_png
        blobs = [encode_png(images[k]) for pair in local for k in pair]
        write_bin(out, blobs, same.tolist())
    else:
        write_pairs_h5(out, images, local, same, labels=labels[used], class_names=names)
    return {"out": out, "pairs": int(num_pairs), "same": int(same.sum()), "images": int(len(used)),
            "classes": int(len(np.unique(labels[used])))}


def convert_pairs(src: str, out: str) -> dict:
    """``.bin`` -> ``.h5`` or ``.h5`` -> ``.bin`` (the format follows ``out``'s extension)."""
    ps = read_pairs(src)
    if out.endswith(".bin"):
        from .storage import encode_png
        blobs = [encode_png(ps.images[k]) for pair in zip(ps.left, ps.right) for k in pair]
        write_bin(out, blobs, ps.same.tolist())
    else:
        write_pairs_h5(out, ps.images, np.stack([ps.left, ps.right], 1), ps.same)
    return {"out": out, "pairs": ps.num_pairs, "same": int(ps.same.sum()), "images": int(len(ps.images))}


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
    with atomic_file(path) as f:
        pickle.dump((list(encoded_images), list(bool(s) for s in issame)), f, protocol=4)
