"""``data.decode: gpu``: JPEG shards decoded on the training device, a batch at a time, and flipped there.

Contract:
* the loader's workers read the stored bytes only (``EncodedBatches``) and send an ``EncodedBatch``: the
  batch's JPEG bytes end to end, their offsets, and the flip decisions that ``data.augment: [flip]`` would
  take on the CPU, drawn from the same generator (``BatchAugment.flip_coins``: seed, rank, batch index), so a
  seed and a resume point select the same samples and the same mirrors under either decode;
* ``decode_batch`` (called by ``loader.prepare_batch`` on the trainer's side) decodes the batch with one
  ``torchvision.io.decode_jpeg(list, device=...)`` call (nvJPEG on CUDA, libjpeg-turbo on the CPU), mirrors
  the flipped samples, and normalises exactly as the CPU path does (``x / 127.5 - 1``, fp32, (B, C, H, W));
* ``data.on_bad_sample: skip``: the workers replace an empty or truncated blob (``bad_samples.looks_whole``,
  then PIL on the suspect ones only); a sample the device refuses is decoded with PIL like the others below,
  and one PIL refuses too stops the run naming it (docs/gpu.md says what waits for a GPU here);
* what nvJPEG cannot give as the CPU path would is decoded with PIL on the host, per sample, and put in
  the batch: bytes that are not JPEG (PNG), and images whose size differs from the manifest's
  ``sample_shape`` (the CPU path resizes them bilinearly). Where torchvision cannot load (a CPU machine
  with the CUDA-only wheel), every sample goes that way: the CPU path's pixels, bitwise;
* ``choose_decode`` decides once per run: ``gpu`` on a CUDA device with torchvision, for encoded shards
  whose first sample is a JPEG of the stored size, with no augmentation but ``flip``. Other augmentations
  run on uint8 in the workers (augment.py): asking for both is a ConfigError. A CPU device, a PNG or a
  resized set fall back to the CPU path with one line of log.
nvJPEG's pixels are not PIL's (another IDCT and chroma upsampling): the measured distance is in
docs/evidence/gpu.md, "nvJPEG against PIL".
"""
from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .augment import BatchAugment
from .bad_samples import BadSample, Batch, describe, looks_whole
from .shards import ShardError, decode_image

DECODES = ("cpu", "gpu")
JPEG_MAGIC = (0xFF, 0xD8, 0xFF)   # SOI marker and the first marker's 0xFF


@functools.lru_cache(maxsize=1)
def torchvision_decoder() -> Tuple[Optional[Callable], str]:
    """(a decoder, "") when torchvision loads, else (None, why). The decoder: ``(list of uint8 byte tensors on
    the CPU, channels 1 | 3, device) -> list of uint8 (C, H, W) on device``, one ``torchvision.io.decode_jpeg``
    call. Any exception counts as not loading: a torchvision built for another torch fails inside its import
    with a RuntimeError, not an ImportError (PyPI's Linux wheels are CUDA builds; against a ``+cpu`` torch:
    "operator torchvision::nms does not exist")."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:
        return None, f"torchvision does not load ({type(e).__name__}: {e})"

    def decode(blobs: List[torch.Tensor], channels: int, device: torch.device) -> List[torch.Tensor]:
        mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB
        return decode_jpeg(blobs, mode=mode, device=device)
    return decode, ""


def _channels(shape: Sequence[int]) -> int:
    return 1 if len(shape) == 2 or shape[-1] == 1 else 3


def is_jpeg(blob: np.ndarray) -> bool:
    return len(blob) > 3 and tuple(int(b) for b in blob[:3]) == JPEG_MAGIC


@dataclass
class EncodedBatch:
    """One batch as its workers send it: bytes, not pixels (a 112x112 face is ~7 kB of JPEG, 37 kB of uint8).

    One byte tensor with offsets rather than a tensor per sample: a worker hands a tensor to the trainer
    through one shared-memory file each, so 2 per batch instead of 128."""

    data: torch.Tensor          # uint8 (total,): the samples' encoded bytes, end to end
    offsets: torch.Tensor       # int64 (B + 1,): sample i is data[offsets[i]:offsets[i + 1]]
    flips: torch.Tensor         # bool (B,): mirror sample i (data.augment: [flip])
    shape: Tuple[int, ...]      # the manifest's sample_shape: (H, W) or (H, W, C)
    where: List[str]            # "rank r: FILE: sample s" of each sample, for errors

    @classmethod
    def pack(cls, blobs: Sequence[np.ndarray], flips: np.ndarray, shape: Sequence[int],
             where: List[str]) -> "EncodedBatch":
        sizes = np.array([len(b) for b in blobs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        data = np.concatenate([np.asarray(b, np.uint8).reshape(-1) for b in blobs]) if len(blobs) else \
            np.zeros(0, np.uint8)
        return cls(torch.from_numpy(data), torch.from_numpy(offsets), torch.from_numpy(np.asarray(flips, bool)),
                   tuple(int(d) for d in shape), list(where))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def blobs(self) -> List[torch.Tensor]:
        o = self.offsets.tolist()
        return [self.data[o[i]:o[i + 1]] for i in range(len(self))]


def _pil(batch: EncodedBatch, i: int, blob: torch.Tensor, c: int) -> torch.Tensor:
    """Sample i decoded as the CPU path does (PIL, bilinear resize to the stored shape): uint8 (C, H, W)."""
    try:
        img = decode_image(blob.numpy(), batch.shape)
    except Exception as e:
        raise ShardError(f"{batch.where[i]} cannot be decoded ({describe(blob.numpy(), e)}); on the GPU path "
                         f"data.on_bad_sample=skip replaces only empty or truncated images: see docs/gpu.md") from e
    return torch.from_numpy(np.array(img).reshape(batch.shape[0], batch.shape[1], c)).permute(2, 0, 1)


def _device_decode(decoder: Callable, blobs: List[torch.Tensor], idx: List[int], device: torch.device,
                   c: int) -> List[Optional[torch.Tensor]]:
    """One batched decode of samples ``idx``; on an error, sample by sample, and None for each sample the
    device refuses: those go through PIL as the CPU path would (``_pil`` names one that fails there too)."""
    try:
        return decoder([blobs[i] for i in idx], c, device)
    except RuntimeError:
        out: List[Optional[torch.Tensor]] = []
        for i in idx:
            try:
                out.append(decoder([blobs[i]], c, device)[0])
            except RuntimeError:
                out.append(None)
        return out


def decode_batch(batch: EncodedBatch, device: torch.device, decoder: Optional[Callable] = None) -> torch.Tensor:
    """The batch as model input on ``device``: float32 (B, C, H, W) in [-1, 1], flipped samples mirrored.

    ``decoder``: ``torchvision_decoder()``'s by default (None where torchvision cannot load: every sample
    then through PIL). JPEG bytes go to it in one call; non-JPEG bytes, and JPEGs not of the stored size,
    through PIL on the host (module docstring)."""
    if decoder is None:
        decoder, _ = torchvision_decoder()
    h, w, c = batch.shape[0], batch.shape[1], _channels(batch.shape)
    blobs = batch.blobs()
    out: List[Optional[torch.Tensor]] = [None] * len(blobs)
    jpeg = [i for i, b in enumerate(blobs) if is_jpeg(b)] if decoder is not None else []
    if jpeg:
        for i, img in zip(jpeg, _device_decode(decoder, blobs, jpeg, device, c)):
            if img is not None and tuple(img.shape) == (c, h, w):
                out[i] = img
    for i in [i for i, img in enumerate(out) if img is None]:
        out[i] = _pil(batch, i, blobs[i], c).to(device)
    x = torch.stack(out)                                              # uint8 (B, C, H, W)
    flips = batch.flips.to(device, non_blocking=True)
    x = torch.where(flips[:, None, None, None], x.flip(-1), x)
    return x.float().div_(127.5).sub_(1.0)                            # as loader.prepare_batch


class EncodedBatches:
    """The loader's source under ``data.decode: gpu``: ``(k, positions)`` -> (``EncodedBatch``, local labels),
    read in the worker, decoded nowhere there."""

    def __init__(self, dataset, augment: BatchAugment):
        if dataset.kind != "encoded" or not augment.flip_only:
            raise ValueError("data.decode=gpu needs encoded shards and no augmentation but flip")
        self.dataset, self.augment = dataset, augment

    def __getitem__(self, item: Tuple[int, Sequence[int]]) -> Batch:
        k, positions = item
        blobs, labels = self.dataset.read_stored(positions)
        bad = self._replace_bad(positions, blobs, labels) if self.dataset.on_bad_sample == "skip" else []
        batch = EncodedBatch.pack(blobs, self.augment.flip_coins(k, len(positions)),
                                  self.dataset.manifest.sample_shape, [self.dataset.where(p) for p in positions])
        return Batch(batch, torch.from_numpy(labels), bad)

    def _replace_bad(self, positions: Sequence[int], blobs: List[np.ndarray], labels: np.ndarray) -> List[BadSample]:
        """``data.on_bad_sample: skip``: a blob that is not ``looks_whole`` is decoded with PIL here; one that
        fails is replaced in ``blobs`` and ``labels`` (in place) by its stand-in's bytes. A whole-looking
        JPEG corrupt inside is left to the device (``_device_decode``: PIL, then named)."""
        shape, bad = self.dataset.manifest.sample_shape, []

        def check(blob: np.ndarray) -> np.ndarray:
            if not looks_whole(blob):
                decode_image(blob, shape)
            return blob
        for i, (pos, blob) in enumerate(zip(positions, blobs)):
            try:
                check(blob)
            except Exception as e:
                blobs[i], labels[i], record = self.dataset.stand_in(int(pos), blob, e, check)
                bad.append(record)
        return bad


def _first_sample_fits(dataset) -> str:
    """"" when the rank's first sample is a JPEG of the stored size; else what it is (PNG, other size)."""
    (blob,), _ = dataset.read_stored([0])
    if not is_jpeg(blob):
        return "its shards hold PNG (or other non-JPEG) bytes"
    from PIL import Image
    with Image.open(io.BytesIO(bytes(blob))) as img:             # the header only
        size = (img.height, img.width)
    shape = tuple(dataset.manifest.sample_shape[:2])
    return "" if size == shape else f"its JPEGs are {size[0]}x{size[1]}, resized to {shape[0]}x{shape[1]} on the CPU"


def choose_decode(requested: str, device: torch.device, dataset, augment: BatchAugment) -> Tuple[str, str]:
    """(``cpu`` | ``gpu``, the line to log when ``gpu`` was asked for and the CPU path is taken, else "").

    ConfigError-worthy (raised as ValueError, for the caller to wrap): an augmentation other than flip with
    ``gpu``; ``gpu`` on a CUDA device where torchvision cannot load. Fallbacks (logged): a CPU device, shards
    that are not encoded, PNG bytes, a stored size that needs resizing."""
    if requested == "cpu":
        return "cpu", ""
    if not augment.flip_only:
        raise ValueError(f"data.decode=gpu applies only flip (on the device); data.augment has "
                         f"{', '.join(name for name, _, _ in augment.ops)}, which run on the CPU in the loader's "
                         f"workers: set data.decode=cpu, or keep only flip")
    why = ""
    if device.type != "cuda":
        why = f"the training device is {device.type}"
    elif dataset.kind != "encoded":
        why = f"the shards hold {dataset.kind}, not encoded images"
    else:
        decoder, missing = torchvision_decoder()
        if decoder is None:
            raise ValueError("data.decode=gpu needs torchvision (scripts/setup/install.sh pins the one matching "
                             f"torch): {missing}; or set data.decode=cpu")
        why = _first_sample_fits(dataset)
    if why:
        return "cpu", f"data.decode=gpu: {why}; decoding with PIL in the loader's workers (the CPU path)"
    return "gpu", ""
