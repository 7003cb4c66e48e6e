"""Training-time augmentation of image batches (``data.augment``), run in the loader's workers on uint8.

Contract:
* ``parse_augment(specs)``: each entry of ``data.augment`` is ``name`` or ``name:key=value,...``; an unknown
  name or key, or a value out of range, is a ``ValueError`` naming the known ones (config.py turns it into
  a config error before anything starts). The list order is the order of application.
* ``BatchAugment(specs, seed, rank)(batch_index, samples)``: uint8 (B, H, W[, C]) in, uint8 of the same
  shape out (worker-to-trainer traffic stays uint8; normalisation stays in ``data.prepare_batch``).
* Randomness: one numpy generator per batch, seeded from (train seed, rank, batch index in the rank's
  stream) by ``seeds.stream_entropy`` (stream ``AUGMENT``), never from torch's global generator or the
  worker seeds. A batch is augmented the same whichever worker reads it, with 0 or 8 workers, and after a
  resume (the resumed stream starts at the checkpoint's batch index), so a resumed run stays bitwise the
  uninterrupted one. Each operation draws a fixed count of numbers per sample whatever the pixels, so
  the draws of one operation never shift another's.
* Empty list (the default): batches pass through untouched. Glyph classes are not flip-invariant, hence
  no default; the face recipes (configs/) turn ``flip`` on.

The operations, for aligned 112x112 faces (parameters and defaults):
* ``flip`` (p=0.5): horizontal mirror. A face's identity is mirror-invariant; arcface_torch flips with
  p=0.5 in both its torchvision and DALI pipelines.
* ``lowres`` (p=0.1, min_scale=0.5, max_scale=0.8): shrink to a side of U(min_scale, max_scale) x the size, bilinear, and back:
  low-resolution probes. The fractions are arcface_torch's DALI ``dali_aug`` (p 0.1, side 56 to 89 px).
* ``blur`` (p=0.2, min_sigma=0.5, max_sigma=1.0): Gaussian blur of standard deviation U(min_sigma,
  max_sigma) px (PIL). The
  probability is the DALI pipeline's; it draws a 3 or 5 px window, we draw the sigma.
* ``jitter`` (p=0.2, brightness=0.2, contrast=0.2, saturation=0.2): colour jitter, each factor
  U(1 - x, 1 + x), applied in that order (x=0 turns one off). The DALI pipeline jitters saturation and
  hue with p=0.2; hue shifts skin colour, so we jitter the photometric factors instead.
* ``gray`` (p=0.1): replace by the BT.601 luminance (the weights of PIL's ``convert("L")``) in every
  channel; the DALI pipeline's probability.
No random crop: alignment put the eyes, nose and mouth corners on fixed pixels, and verification embeds
the aligned crop, so a shifted crop trains on a geometry the evaluation never shows.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
from PIL import Image, ImageFilter

from ..config import did_you_mean
from ..seeds import AUGMENT, stream_entropy

LUMA = np.array([0.299, 0.587, 0.114], np.float32)   # ITU-R BT.601, as PIL's convert("L")


def _coins(rng: np.random.Generator, n: int, p: float) -> np.ndarray:
    return rng.random(n) < p


def _luma(y: np.ndarray) -> np.ndarray:
    """(..., C) float -> (..., 1) luminance; a single channel is its own luminance."""
    return y @ LUMA[:, None] if y.shape[-1] == 3 else y.mean(-1, keepdims=True)


def _as_pil(img: np.ndarray) -> Image.Image:
    return Image.fromarray(img.reshape(img.shape[:2]) if img.ndim == 3 and img.shape[2] == 1 else img)


def _flip(x: np.ndarray, rng: np.random.Generator, p: float) -> np.ndarray:
    hit = _coins(rng, len(x), p)
    # a pixel's C bytes as one item: reversing items moves whole pixels, twice as fast as uint8 strides
    px = x.view(np.dtype((np.void, x.shape[3]))) if x.ndim == 4 else x
    px[hit] = px[hit, :, ::-1]
    return x


def _lowres(x: np.ndarray, rng: np.random.Generator, p: float, min_scale: float, max_scale: float) -> np.ndarray:
    hit, frac = _coins(rng, len(x), p), rng.uniform(min_scale, max_scale, len(x))
    h, w = x.shape[1:3]
    for i in np.flatnonzero(hit):
        small = _as_pil(x[i]).resize((max(1, round(w * frac[i])), max(1, round(h * frac[i]))), Image.BILINEAR)
        x[i] = np.asarray(small.resize((w, h), Image.BILINEAR)).reshape(x.shape[1:])
    return x


def _blur(x: np.ndarray, rng: np.random.Generator, p: float, min_sigma: float, max_sigma: float) -> np.ndarray:
    hit, sigma = _coins(rng, len(x), p), rng.uniform(min_sigma, max_sigma, len(x))
    for i in np.flatnonzero(hit):
        x[i] = np.asarray(_as_pil(x[i]).filter(ImageFilter.GaussianBlur(float(sigma[i])))).reshape(x.shape[1:])
    return x


def _jitter(x: np.ndarray, rng: np.random.Generator, p: float, brightness: float, contrast: float,
            saturation: float) -> np.ndarray:
    hit = _coins(rng, len(x), p)
    lo = np.array([brightness, contrast, saturation])
    f = rng.uniform(1 - lo, 1 + lo, (len(x), 3))           # (B, 3): brightness, contrast, saturation
    for i in np.flatnonzero(hit):
        y = x[i].astype(np.float32).reshape(x.shape[1], x.shape[2], -1)   # (H, W, C)
        y *= f[i, 0]
        m = _luma(y).mean()
        y = (y - m) * f[i, 1] + m
        lum = _luma(y)
        y = (y - lum) * f[i, 2] + lum
        x[i] = np.rint(np.clip(y, 0, 255)).astype(np.uint8).reshape(x.shape[1:])
    return x


def _gray(x: np.ndarray, rng: np.random.Generator, p: float) -> np.ndarray:
    hit = _coins(rng, len(x), p)
    if x.ndim == 4 and x.shape[3] == 3 and hit.any():
        x[hit] = np.rint(_luma(x[hit].astype(np.float32))).astype(np.uint8)   # (h, H, W, 1) -> every channel
    return x


# name -> (function, default parameters, check of the parameters)
AUGMENTATIONS: Dict[str, Tuple[Callable, Dict[str, float], Callable[[Dict[str, float]], bool]]] = {
    "flip": (_flip, {"p": 0.5}, lambda a: 0 <= a["p"] <= 1),
    "lowres": (_lowres, {"p": 0.1, "min_scale": 0.5, "max_scale": 0.8},
               lambda a: 0 <= a["p"] <= 1 and 0 < a["min_scale"] <= a["max_scale"] <= 1),
    "blur": (_blur, {"p": 0.2, "min_sigma": 0.5, "max_sigma": 1.0},
             lambda a: 0 <= a["p"] <= 1 and 0 <= a["min_sigma"] <= a["max_sigma"]),
    "jitter": (_jitter, {"p": 0.2, "brightness": 0.2, "contrast": 0.2, "saturation": 0.2},
               lambda a: 0 <= a["p"] <= 1 and all(0 <= a[k] < 1 for k in ("brightness", "contrast", "saturation"))),
    "gray": (_gray, {"p": 0.1}, lambda a: 0 <= a["p"] <= 1),
}
IMAGE_KINDS = ("images", "encoded")


def parse_augment(specs: Sequence[str], kind: str = "images") -> List[Tuple[str, Callable, Dict[str, float]]]:
    """``["flip", "jitter:p=0.5,saturation=0.3"]`` -> [(name, function, parameters)]; errors name what is known.
    ``kind``: the shard set's sample kind (features cannot be augmented)."""
    ops = []
    for spec in specs:
        if not isinstance(spec, str):
            raise ValueError(f"{spec!r}: expected a string 'name' or 'name:key=value,...'")
        name, _, rest = spec.partition(":")
        name = name.strip()
        if name not in AUGMENTATIONS:
            raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTATIONS)}"
                             f"{did_you_mean(name, AUGMENTATIONS)}")
        fn, defaults, valid = AUGMENTATIONS[name]
        params = dict(defaults)
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if key.strip() not in defaults or not eq:
                raise ValueError(f"{spec!r}: unknown parameter {key.strip()!r} of {name}; "
                                 f"known: {', '.join(f'{k}={v}' for k, v in defaults.items())}")
            try:
                params[key.strip()] = float(value)
            except ValueError:
                raise ValueError(f"{spec!r}: {key.strip()}={value!r} is not a number") from None
        if not valid(params):
            raise ValueError(f"{spec!r}: parameters out of range ({params})")
        ops.append((name, fn, params))
    if ops and kind not in IMAGE_KINDS:
        raise ValueError(f"data.augment={list(specs)} needs image samples; this shard set holds {kind}")
    return ops


class BatchAugment:
    """The augmentation of one rank's batches: ``(batch index, uint8 samples) -> uint8 samples``."""

    def __init__(self, specs: Sequence[str], seed: int, rank: int, kind: str = "images"):
        self.ops = parse_augment(specs, kind)
        self.seed, self.rank = seed, rank

    def __bool__(self) -> bool:
        return bool(self.ops)

    def _rng(self, batch_index: int) -> np.random.Generator:
        return np.random.default_rng(stream_entropy(self.seed, self.rank, batch_index, AUGMENT))

    @property
    def flip_only(self) -> bool:
        """True for an empty list or a list of one ``flip``: all ``data.decode: gpu`` can apply (on the device)."""
        return [name for name, _, _ in self.ops] in ([], ["flip"])

    def flip_coins(self, batch_index: int, n: int) -> np.ndarray:
        """The flip decisions (bool (n,)) that ``self(batch_index, samples)`` takes on a batch of ``n``, drawn
        from the same generator, for a ``flip_only`` list: ``data.decode: gpu`` flips on the device with them,
        so a seed and a resume point mean the same batches under either decode."""
        if not self.flip_only:
            raise ValueError(f"only flip can be applied on the device; data.augment has "
                             f"{', '.join(name for name, _, _ in self.ops)}")
        if not self.ops:
            return np.zeros(n, bool)
        return _coins(self._rng(batch_index), n, self.ops[0][2]["p"])

    def __call__(self, batch_index: int, samples: np.ndarray) -> np.ndarray:
        if not self.ops:
            return samples
        rng = self._rng(batch_index)
        x = np.array(samples, dtype=np.uint8, copy=True)   # (B, H, W[, C]), ours to modify
        for _, fn, params in self.ops:
            x = fn(x, rng, **params)
        return x
