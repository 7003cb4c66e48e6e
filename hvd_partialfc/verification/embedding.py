"""Embedding images and scoring pairs with a backbone, leaving the backbone as it was found.

`embed` / `score_pairs` run a backbone over uint8 images (or feature vectors) held in memory: batched,
``torch.inference_mode``, eval mode, L2-normalised embeddings; they leave the module's parameters,
buffers, train/eval flags and the global torch RNG state as they found them (`frozen`). `embed_batch` is
the one forward pass (the model's input, plus the mirror image's embedding when asked) that `embed` and
the streaming IJB embedding share. `pixel_embed` and `random_init_backbone` are the baselines' embeddings.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.loader import prepare_batch
from ..models import create_model
from ..data.pair_files import PairSet



@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[torch.device]:
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


def embed_batch(model: nn.Module, chunk: torch.Tensor, device: torch.device, kind: str = "images",
                flip: bool = False) -> torch.Tensor:
    """The raw (not normalised) float embeddings (B, D) of one batch of samples as stored (uint8 images
    (B, H, W[, C]) or float features), plus the mirror image's embedding when ``flip``. Call it inside
    `frozen`, which yields ``device``."""
    x, _ = prepare_batch(chunk, torch.zeros(len(chunk), dtype=torch.int64), device, kind)
    e = model(x)                                  # (B, D)
    if flip:
        e = e + model(torch.flip(x, dims=[3]))    # x is (B, C, H, W): mirror along W
    return e.float()


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
    with frozen(model) as device:
        for start in range(0, len(images), batch_size):
            chunk = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size]))
            out.append(F.normalize(embed_batch(model, chunk, device, kind, flip), dim=1).cpu())
    if not out:
        return np.zeros((0, 0), dtype=np.float32)
    return torch.cat(out).numpy()


def pair_scores(embed_fn, pairs: PairSet) -> np.ndarray:
    """Cosine score per pair from an ``embed_fn(images) -> L2-normalised (m, D)``, embedding each used
    image once."""
    used, inv = np.unique(np.r_[pairs.left, pairs.right], return_inverse=True)
    images = pairs.images if len(used) == len(pairs.images) else pairs.images[used]
    e = embed_fn(images)                                 # (m, D), rows of unit length
    n = pairs.num_pairs
    return np.einsum("pd,pd->p", e[inv[:n]], e[inv[n:]]).astype(np.float64)


def score_pairs(model: nn.Module, pairs: PairSet, batch_size: int = 256, flip: bool = False) -> np.ndarray:
    """Cosine similarity float64 (P,) of each pair's embeddings."""
    return pair_scores(lambda im: embed(model, im, batch_size, flip), pairs)


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
    """The same architecture as ``model_args`` (``models.pretrained.load_backbone``'s second value) at a seeded random
    init, in eval mode. Built under a forked RNG so the caller's torch RNG state is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = create_model(model_args["name"], in_shape=model_args["in_shape"],
                             embedding_dim=model_args["embedding_dim"], **model_args.get("kwargs", {}))
    return model.eval()

