"""Verification pair sets: reading the two formats the evaluation takes (`data_tools.pair_sets` writes them).

* ``*.h5`` (written by ``hvd-partialfc-shards pairs``): datasets ``images`` uint8 (M, H, W[, C]) — or
  ``encoded`` variable-length uint8 (M,) with attribute ``sample_shape`` — plus ``pairs`` int64 (P, 2)
  (indices into the images) and ``same`` bool (P,); attributes ``format`` = "hvd_partialfc.pairs",
  ``version`` = 1, and optional ``class_names`` / ``labels`` (int64 (M,)) of the images.
* ``*.bin`` (the LFW / CFP / AgeDB files face users already have, InsightFace's ``load_bin``): a pickle
  of ``(list of encoded images, list of bools)`` where images 2k and 2k+1 form pair k.

Both read into one `PairSet` with decoded uint8 images. A file that cannot be read is a `PairSetError`
(a missing one a ``FileNotFoundError``) naming the file and what to do; the trainer's agreement step adds
the rank.

``.bin`` files come from third parties and rank 0 reads ``eval.pairs`` during training, and a plain
``pickle.load`` runs whatever callable the file names. So they load through `_BinUnpickler`, which hands
out only the few globals real bins use (numpy arrays and bool scalars, and ``_codecs.encode``, which
Python 3 uses for bytes below protocol 3) and refuses any other before anything is called; the loaded
object is then checked to be (list of bytes, list of bools). Python 2 bins load with ``encoding="bytes"``,
so their ``str`` images arrive as bytes.
"""
from __future__ import annotations

import codecs
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import h5py
import numpy as np

from .shards import decode_image

try:                                    # numpy >= 2
    from numpy._core import multiarray as _multiarray, numeric as _numeric
except ImportError:                     # pragma: no cover - numpy 1.x
    from numpy.core import multiarray as _multiarray, numeric as _numeric

FORMAT = "hvd_partialfc.pairs"
VERSION = 1
BIN_CONTENT = "a .bin pair file holds only lists of image bytes and bools"


class PairSetError(ValueError):
    """A pair set that is damaged, malformed, or (a ``.bin``) asks to run code; the message names the file."""


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


class _Refused(Exception):
    """A ``.bin`` asked for a global outside `_BIN_GLOBALS` (the message is the global's name)."""


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes below protocol 3 (``encode(text, 'latin1')``), and no
    other codec: a bin has no reason to run zlib or rot13 at load time."""
    if encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode with encoding {encoding!r}")
    return codecs.encode(text, "latin1")


# (module, name) -> object: everything real InsightFace bins ask for, under both numpy spellings.
_BIN_GLOBALS: Dict[Tuple[str, str], Callable[..., Any]] = {
    ("_codecs", "encode"): _latin1_encode,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
for _pkg in ("numpy.core", "numpy._core"):     # the names numpy 1.x and numpy 2.x pickles use
    _BIN_GLOBALS[(f"{_pkg}.multiarray", "_reconstruct")] = _multiarray._reconstruct   # arrays, protocol < 5
    _BIN_GLOBALS[(f"{_pkg}.multiarray", "scalar")] = _multiarray.scalar               # numpy bools
    _BIN_GLOBALS[(f"{_pkg}.numeric", "_frombuffer")] = _numeric._frombuffer           # arrays, protocol 5


class _BinUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `_BIN_GLOBALS`: lists, tuples, bytes, str, bools and ints need no
    global at all, and every opcode that calls something (REDUCE, NEWOBJ, INST, OBJ, EXT*) gets its
    callable through ``find_class``, so refusing here refuses before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _BIN_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


def _load_bin(path: str) -> Tuple[List[Any], List[Any]]:
    """(blobs, issame) of a ``.bin``, loaded through `_BinUnpickler` and checked for shape."""
    with open(path, "rb") as f:
        try:
            obj = _BinUnpickler(f, encoding="bytes").load()
        except _Refused as e:
            raise PairSetError(f"{path}: refused to load: the pickle asks for {e}; {BIN_CONTENT}") from None
        except Exception as e:      # whatever malformed bytes make the unpickler raise
            raise PairSetError(f"{path}: cannot read the .bin pair file ({type(e).__name__}: {e}); the file is "
                               f"truncated or not an InsightFace pair pickle; download or write it again") from e
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise PairSetError(f"{path}: holds a {type(obj).__name__}, not (images, issame); {BIN_CONTENT}")
    blobs, issame = obj
    if not isinstance(blobs, (list, tuple)):
        raise PairSetError(f"{path}: the images are a {type(blobs).__name__}, not a list; {BIN_CONTENT}")
    for k, b in enumerate(blobs):
        if not (isinstance(b, (bytes, bytearray)) or (isinstance(b, np.ndarray) and b.dtype == np.uint8
                                                      and b.ndim == 1)):
            raise PairSetError(f"{path}: image {k} is a {type(b).__name__}, not encoded bytes; {BIN_CONTENT}")
    if isinstance(issame, np.ndarray) and issame.ndim == 1:
        issame = issame.tolist()
    if not isinstance(issame, (list, tuple)):
        raise PairSetError(f"{path}: the same/different flags are a {type(issame).__name__}, not a list; "
                           f"{BIN_CONTENT}")
    for k, flag in enumerate(issame):
        if not isinstance(flag, (bool, int, np.bool_, np.integer)) or flag not in (0, 1):
            raise PairSetError(f"{path}: flag {k} is {flag!r}, not a bool; {BIN_CONTENT}")
    return list(blobs), list(issame)


def _decode_all(path: str, blobs: Sequence[Any], shape: Optional[Sequence[int]]) -> np.ndarray:
    """Decode every blob to one uint8 array; an undecodable one is named by its index."""
    if not len(blobs):
        raise PairSetError(f"{path}: holds no images")
    images = []
    for k, blob in enumerate(blobs):
        try:
            images.append(decode_image(blob, shape))
        except Exception as e:      # PIL raises several types for broken images
            raise PairSetError(f"{path}: image {k} cannot be decoded ({type(e).__name__}: {e})") from e
        if shape is None:           # a .bin: every image is decoded to the first one's shape
            shape = images[0].shape
    return np.stack(images)


def read_pairs(path: str) -> PairSet:
    """Read a ``.h5`` pair set or an LFW-style ``.bin`` file (see the module docstring for the errors)."""
    name = os.path.splitext(os.path.basename(path))[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such pair set file; check the path given to --pairs / eval.pairs")
    if path.endswith(".bin"):
        blobs, issame = _load_bin(path)
        if len(blobs) != 2 * len(issame):
            raise PairSetError(f"{path}: {len(blobs)} images for {len(issame)} pairs (expected 2 per pair)")
        idx = np.arange(len(issame), dtype=np.int64)
        return PairSet(name, _decode_all(path, blobs, None), 2 * idx, 2 * idx + 1, np.asarray(issame, dtype=bool))
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise PairSetError(f"{path}: cannot open pair set (h5py: {e}); the file is truncated or not HDF5; "
                           f"write it again with `hvd-partialfc-shards pairs`") from e
    with f:
        if f.attrs.get("format") != FORMAT:
            raise PairSetError(f"{path}: not a hvd_partialfc pair set (format={f.attrs.get('format')!r})")
        try:
            if "images" in f:
                images = f["images"][:]
            else:
                images = _decode_all(path, f["encoded"][:], [int(s) for s in f.attrs["sample_shape"]])
            pairs = f["pairs"][:].astype(np.int64)
            same = f["same"][:].astype(bool)
        except (KeyError, OSError) as e:
            raise PairSetError(f"{path}: cannot read the pair set ({type(e).__name__}: {e}); the file is damaged; "
                               f"write it again with `hvd-partialfc-shards pairs`") from e
    if pairs.ndim != 2 or pairs.shape[1] != 2 or len(pairs) != len(same):
        raise PairSetError(f"{path}: pairs must be (P, 2) with P flags, got {pairs.shape} and {same.shape}")
    if len(pairs) and (pairs.min() < 0 or pairs.max() >= len(images)):
        raise PairSetError(f"{path}: pair indices outside [0, {len(images)})")
    return PairSet(name, images, pairs[:, 0].copy(), pairs[:, 1].copy(), same)
