"""Encoded samples that cannot be decoded (``data.on_bad_sample``): the record, the stand-in rule, the batch.

Contract:
* ``BadSample``: one sample that did not decode (an empty or corrupt image): its rank, file, index in the
  file, the reason, and where its stand-in came from; ``str()`` is the line the log names it with.
* ``Replacements``: which sample stands in for the bad one at rank position ``p``: the next sample of the
  same class after ``p`` in the rank's stored order (wrapping around) that decodes; when none of its class
  does, the next decodable sample of the rank, with its own label; after ``MAX_TRIES`` candidates, an
  error (the set is broken beyond skipping). A function of the stored data alone, with no random stream (so
  nothing for seeds.py to derive): the same stand-in in every worker, at any ``data.workers`` and after a
  resume, so a skip run resumes bitwise.
* ``Batch``: what the loader yields: it unpacks as ``(samples, labels)`` (the contract every caller holds)
  and carries ``bad``, the ``BadSample``s replaced in it. The count travels with the batch because the
  loader's workers are other processes: the trainer sums and agrees it at log steps (run/watch/sample_watch.py),
  with no host synchronisation and no collective per step.
* ``looks_whole``: the check the workers can afford under ``data.decode: gpu`` (they do not decode): an
  empty blob, unknown magic bytes, or a JPEG / PNG without its end marker (a truncated file) is suspect,
  and only a suspect blob is decoded with PIL in the worker to decide.
Imports no torch: ``hvd-partialfc-shards inspect --decode`` (data_tools/decode_scan.py) uses ``describe``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

# candidates tried for one bad sample before giving up: a rank whose next 64 samples of the class and after
# it all fail is not a dirty set but a broken one (`hvd-partialfc-shards inspect --decode` lists it)
MAX_TRIES = 64
JPEG_START, JPEG_END = b"\xff\xd8\xff", b"\xff\xd9"
PNG_START, PNG_END = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


@dataclass(frozen=True)
class BadSample:
    """A sample that did not decode, and its stand-in (``rank r: FILE: sample s`` of the replacement)."""

    rank: int
    file: str
    sample: int
    reason: str
    replacement: str

    @property
    def key(self):
        return self.file, self.sample

    def __str__(self) -> str:
        return (f"rank {self.rank}: {self.file}: sample {self.sample} cannot be decoded ({self.reason}); "
                f"replaced by {self.replacement} (data.on_bad_sample=skip; said once)")


class Replacements:
    """The stand-in candidates for a rank's bad samples (module docstring), from its labels by position."""

    def __init__(self, labels: np.ndarray):
        self.labels = labels
        self._order = None          # positions sorted by label, stable: built on the first bad sample

    def candidates(self, position: int) -> Iterator[int]:
        """Positions to try, in order: the same class after ``position`` (wrapping), then the rank's."""
        if self._order is None:
            self._order = np.argsort(self.labels, kind="stable")
        label, n = self.labels[position], len(self.labels)
        lo, hi = np.searchsorted(self.labels[self._order], [label, label + 1])
        same = self._order[lo:hi]                                   # increasing positions
        k = int(np.searchsorted(same, position, side="right"))
        tried = 0
        for p in list(same[k:]) + list(same[:k]):
            if p != position and tried < MAX_TRIES:
                tried += 1
                yield int(p)
        for step in range(1, min(n, MAX_TRIES + 1)):
            p = (position + step) % n
            if self.labels[p] != label:
                yield int(p)


class Batch:
    """A loader batch: unpacks as ``(samples, labels)``; ``bad`` lists the samples replaced in it.

    Not a tuple: torch's DataLoader turns a tuple into a list of its items (``default_convert``), which
    would drop ``bad``; an object of its own passes through the workers' queue and ``pin_memory`` (this
    class's) whole."""

    __slots__ = ("samples", "labels", "bad")

    def __init__(self, samples, labels, bad: Sequence[BadSample] = ()):
        self.samples, self.labels, self.bad = samples, labels, list(bad)

    def __iter__(self):
        return iter((self.samples, self.labels))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.samples, self.labels)[i]

    def pin_memory(self) -> "Batch":
        """Tensors pinned; an ``EncodedBatch`` as it is (torch's ``pin_memory`` left it so)."""
        samples = self.samples.pin_memory() if hasattr(self.samples, "pin_memory") else self.samples
        return Batch(samples, self.labels.pin_memory(), self.bad)


def looks_whole(blob: np.ndarray) -> bool:
    """True for a JPEG or PNG with its start and end markers; anything else (empty, unknown, truncated) is
    suspect. Reads 8 bytes at each end: nothing of the decode the workers leave to the GPU."""
    if len(blob) < 16:
        return False
    head, tail = bytes(blob[:8]), bytes(blob[-8:])
    return (head.startswith(JPEG_START) and tail.endswith(JPEG_END)) or \
        (head == PNG_START and tail.endswith(PNG_END))


def describe(blob: np.ndarray, error: BaseException) -> str:
    """Why ``blob`` did not decode, the same text on every run: PIL names its in-memory file by its address
    (``<_io.BytesIO object at 0x7f...>``), left out."""
    if len(blob) == 0:
        return "empty: 0 bytes"
    return f"{type(error).__name__}: {re.sub(r' ?<_io.BytesIO object at 0x[0-9a-f]+>', '', str(error))}"


def decode_failure_hint(shard_dir: str) -> str:
    """What to do about an undecodable sample when the run stops on it."""
    return (f"set data.on_bad_sample=skip to replace such samples (each by the next decodable sample of its "
            f"class), or list them all with `hvd-partialfc-shards inspect {shard_dir} --decode`")
