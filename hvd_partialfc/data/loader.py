"""The dedicated per-rank loader: rank r reads only the samples of its own label slice.

Contract:
* a rank opens only its block of shards (`layout.RankLayout`), checks on construction that each file
  opens and that every label lies in its slice (an error names the rank, the file and what to do), and
  yields *local* labels ``y - start``;
* batches are drawn from a permutation seeded by (base seed, rank, epoch): reproducible, different per
  rank, and a position (the number of batches drawn) is all that is needed to resume exactly;
* the stream is endless (epochs follow each other), so the trainer decides the number of steps and every
  rank runs the same number regardless of how many samples it holds (no deadlock on uneven shards);
* an encoded sample that does not decode (empty, corrupt) stops the run naming it, or under
  ``data.on_bad_sample: skip`` is replaced by a stand-in and listed in the batch (bad_samples.py);
* h5py handles are opened lazily in the process that reads (DataLoader workers are forked after
  construction, and an HDF5 handle must not cross a fork);
* samples leave the loader as stored (uint8 images, float32 features): normalisation happens on the
  training device (`prepare_batch`), which keeps worker-to-trainer traffic 4x smaller for images; under
  ``data.decode: gpu`` JPEG shards leave it still encoded, with their flip decisions (device_decode.py);
* ``data.augment`` (augment.py) runs in the workers, on uint8, with randomness drawn from (seed, rank,
  batch index): the sampler numbers its batches, so a batch's augmentation does not depend on the worker
  that reads it, on the number of workers, or on a resume.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .augment import BatchAugment
from .bad_samples import MAX_TRIES, BadSample, Batch, Replacements, decode_failure_hint, describe
from .device_decode import EncodedBatch, EncodedBatches, decode_batch
from ..forking import workers_keep_inherited_objects
from ..seeds import LOADER_WORKERS, derive_seed
from .shards import (Manifest, ShardError, decode_image, open_shard, rank_layout, read_manifest, read_shard_labels,
                     unreadable_shard)

# data.workers = -1: at most this many (resolve_workers): 8 x ~3,200 faces/s with flip, >5x what a GPU consumes
AUTO_WORKERS_CAP = 8


class RankShardDataset:
    """Random access to one rank's samples, indexed by *lists* of positions (one call per batch).

    Reading a whole batch per call lets h5py read sorted positions per shard in one request instead of
    one request per sample.
    """

    def __init__(self, shard_dir: str, rank: int, world_size: int, manifest: Optional[Manifest] = None,
                 layout=None, on_bad_sample: str = "stop"):
        """``layout``: the run's ``layout.RankLayout`` (computed from ``manifest`` and ``world_size`` if not
        given); the shards and the slice are rank ``rank``'s in it, so blocks of unequal size need nothing
        here. A layout of another world size is refused (it would read another rank's shards).
        ``on_bad_sample``: ``data.on_bad_sample`` (``stand_in``)."""
        self.shard_dir, self.on_bad_sample = shard_dir, on_bad_sample
        self.manifest = manifest or read_manifest(shard_dir)
        self.rank = rank
        layout = layout or rank_layout(self.manifest, world_size)
        if layout.world_size != world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of {world_size}: the layout is for {layout.world_size} ranks")
        indices, self.label_slice = layout.shard_blocks[rank], layout.slices[rank]
        self.files = [os.path.join(shard_dir, self.manifest.shards[i].file) for i in indices]
        self.kind = self.manifest.kind
        labels, sizes = [], []
        for path in self.files:
            y = read_shard_labels(path, rank)   # missing, truncated, not HDF5: named with the rank
            bad = (y < self.label_slice.start) | (y >= self.label_slice.end)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ShardError(
                    f"rank {rank}: {path} holds label {int(y[i])} (sample {i}, {int(bad.sum())} such samples) "
                    f"outside this rank's slice [{self.label_slice.start}, {self.label_slice.end})")
            labels.append(y)
            sizes.append(len(y))
        self.labels = np.concatenate(labels) if labels else np.zeros(0, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._replacements = Replacements(self.labels)
        self._handles: Optional[List[h5py.File]] = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.labels)

    def _open(self) -> List[h5py.File]:
        if self._handles is None or self._pid != os.getpid():
            self._handles = [open_shard(p, self.rank) for p in self.files]
            self._pid = os.getpid()
        return self._handles

    def where(self, position: int) -> str:
        """``rank r: FILE: sample s``: where the rank's sample at ``position`` is stored (for error messages)."""
        file, sample = self.locate(position)
        return f"rank {self.rank}: {file}: sample {sample}"

    def read_stored(self, positions: Sequence[int]) -> Tuple[List[np.ndarray], np.ndarray]:
        """(the samples as stored, in the order given: arrays, or encoded bytes as uint8 arrays; local labels)."""
        positions = np.asarray(positions, dtype=np.int64)
        handles = self._open()
        shard_of = np.searchsorted(self.offsets, positions, side="right") - 1
        out: List[Optional[np.ndarray]] = [None] * len(positions)
        for s in np.unique(shard_of):
            where = np.flatnonzero(shard_of == s)
            local = positions[where] - self.offsets[s]
            order = np.argsort(local, kind="stable")
            uniq, inverse = np.unique(local[order], return_inverse=True)   # h5py wants increasing indices
            try:
                block = handles[s][self.kind][uniq]
            except (KeyError, OSError) as e:   # a file damaged (or replaced) after start-up
                raise unreadable_shard(self.files[s], "samples", e, self.rank) from e
            for k, w in enumerate(where[order]):
                out[w] = block[inverse[k]]
        return out, self.labels[positions] - self.label_slice.start

    def locate(self, position: int) -> Tuple[str, int]:
        """(the file, the index in it) of the rank's sample at ``position``."""
        s = int(np.searchsorted(self.offsets, position, side="right") - 1)
        return self.files[s], position - int(self.offsets[s])

    def stand_in(self, position: int, blob: np.ndarray, error: BaseException,
                 check: Callable[[np.ndarray], Any]) -> Tuple[Any, int, BadSample]:
        """For the bad sample ``blob`` at ``position`` (``error``: why it failed): under ``data.on_bad_sample:
        stop`` a ShardError naming it; under ``skip``, (``check(stored sample)`` of its stand-in, the stand-in's
        local label, the ``BadSample`` record). ``check`` raises on a sample that does not decode."""
        reason = describe(blob, error)
        if self.on_bad_sample != "skip":
            raise ShardError(f"{self.where(position)} cannot be decoded ({reason}); "
                             f"{decode_failure_hint(self.shard_dir)}") from error
        for p in self._replacements.candidates(position):
            (blob,), label = self.read_stored([p])
            try:
                value = check(blob)
            except Exception:
                continue
            file, sample = self.locate(position)
            return value, int(label[0]), BadSample(self.rank, file, sample, reason, self.where(p))
        raise ShardError(f"{self.where(position)} cannot be decoded ({reason}), nor can "
                         f"the {MAX_TRIES} samples tried in its place: the set is broken; list its bad samples "
                         f"with `hvd-partialfc-shards inspect {self.shard_dir} --decode` and rebuild it")

    def __getitem__(self, positions: Sequence[int]) -> Batch:
        """(samples as stored, encoded ones decoded with PIL; local labels) for a batch of positions, in the
        order given; a sample that does not decode is named (stop) or replaced (skip: ``Batch.bad``)."""
        out, local_labels = self.read_stored(positions)
        bad: List[BadSample] = []
        if self.kind == "encoded":
            shape = self.manifest.sample_shape
            decoded = []
            for i, (pos, blob) in enumerate(zip(positions, out)):
                try:
                    decoded.append(decode_image(blob, shape))
                except Exception as e:  # name what is broken: the rank, the file, the sample
                    image, local_labels[i], record = self.stand_in(int(pos), blob, e,
                                                                   lambda b: decode_image(b, shape))
                    decoded.append(image)
                    bad.append(record)
            samples = np.stack(decoded)
        else:
            samples = np.stack(out)
        return Batch(torch.from_numpy(samples), torch.from_numpy(local_labels), bad)


class EpochBatchSampler(Sampler):
    """Endless stream of index batches; epoch e is a permutation seeded by (seed, rank, e).

    ``start`` is the number of batches already drawn (resume). Incomplete batches are dropped, so every
    batch has exactly ``batch_size`` samples.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, rank: int, start: int = 0):
        if num_samples < batch_size:
            raise ShardError(f"rank {rank}: {num_samples} samples, fewer than one batch of {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.seed, self.rank, self.start = seed, rank, start
        self.steps_per_epoch = num_samples // batch_size

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.rank, epoch))
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[List[int]]:
        k = self.start
        while True:
            epoch, pos = divmod(k, self.steps_per_epoch)
            perm = self._perm(epoch)
            for p in range(pos, self.steps_per_epoch):
                yield perm[p * self.batch_size:(p + 1) * self.batch_size].tolist()
            k = (epoch + 1) * self.steps_per_epoch

    def __len__(self) -> int:  # endless; DataLoader only needs this for len(), which we never call
        return 2 ** 62


class NumberedBatches(Sampler):
    """``EpochBatchSampler``'s batches with their index in the rank's stream: ``(k, positions)``, k from
    ``start``. The index is what seeds a batch's augmentation."""

    def __init__(self, batches: EpochBatchSampler):
        self.batches = batches

    def __iter__(self) -> Iterator[Tuple[int, List[int]]]:
        return enumerate(self.batches, start=self.batches.start)

    def __len__(self) -> int:
        return len(self.batches)


class AugmentedBatches:
    """``dataset[positions]``, then ``augment(k, samples)`` (a no-op when the list is empty), in the process
    that reads (a DataLoader worker when there are workers)."""

    def __init__(self, dataset: RankShardDataset, augment: BatchAugment):
        self.dataset, self.augment = dataset, augment

    def __getitem__(self, item: Tuple[int, Sequence[int]]) -> Batch:
        k, positions = item
        batch = self.dataset[positions]
        if self.augment:
            batch.samples = torch.from_numpy(self.augment(k, batch.samples.numpy()))
        return batch


def make_loader(dataset: RankShardDataset, batch_size: int, seed: int, workers: int = 0,
                start: int = 0, pin_memory: bool = False, augment: Sequence[str] = (),
                decode: str = "cpu") -> Tuple[DataLoader, int]:
    """(endless DataLoader over the rank's samples, steps per epoch on this rank). ``augment``: the
    ``data.augment`` list (augment.py), seeded by (``seed``, rank, batch index). ``decode``: ``cpu`` (the
    workers decode and augment) or ``gpu`` (they send the encoded bytes and the flip decisions, decoded by
    ``prepare_batch`` on the device: device_decode.py; ``device_decode.choose_decode`` says when it applies)."""
    batches = EpochBatchSampler(len(dataset), batch_size, seed, dataset.rank, start)
    sampler = NumberedBatches(batches)
    batch_augment = BatchAugment(augment, seed, dataset.rank, dataset.kind)
    source = EncodedBatches(dataset, batch_augment) if decode == "gpu" else AugmentedBatches(dataset, batch_augment)
    # Its own generator: ``iter(loader)`` draws the workers' base seed from it, not from torch's global
    # one, which then stays exactly where a checkpoint restored it (dropout, sampled heads resume bitwise).
    generator = torch.Generator().manual_seed(derive_seed(seed, dataset.rank, start, LOADER_WORKERS))
    if workers > 0:
        workers_keep_inherited_objects()
    loader = DataLoader(source, sampler=sampler, batch_size=None, num_workers=workers,
                        pin_memory=pin_memory, persistent_workers=workers > 0,
                        prefetch_factor=4 if workers > 0 else None, generator=generator)
    return loader, batches.steps_per_epoch


def resolve_workers(workers: int, local_size: int) -> int:
    """``data.workers``, with -1 (auto) resolved: the cores of one local rank minus one (its trainer process),
    at most ``AUTO_WORKERS_CAP``, at least 0. A rank's cores: ``SLURM_CPUS_PER_TASK`` under Slurm (srun binds
    each task to its own), else the cores this process may run on shared by the ``local_size`` ranks.

    Measured reason (docs/evidence/data.md §7.2): one worker-core decodes ~3,200 112x112 JPEG faces/s with flip, and
    an iresnet50 in fp16 consumes ~2,500-4,000 samples/s per GPU: the recipes' former 2 workers gave ~6,400
    at best, no margin on a busy node; 8-16 cores per GPU (64-128-core 8-GPU nodes) give 7 workers, ~22,000/s.
    """
    if workers >= 0:
        return workers
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cores = int(slurm)
    else:
        visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cores = visible // max(1, local_size)
    return max(0, min(AUTO_WORKERS_CAP, cores - 1))


def prepare_batch(samples, labels: torch.Tensor, device: torch.device,
                  kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move a batch to the device and make it model input.

    Images: uint8 (B, H, W[, C]) -> float (B, C, H, W) in [-1, 1] (the InsightFace normalisation); an
    ``EncodedBatch`` (``data.decode: gpu``) is decoded, flipped and normalised on the device the same way.
    Features: float32 as they are.
    """
    labels = labels.to(device, non_blocking=True)
    if isinstance(samples, EncodedBatch):
        return decode_batch(samples, device), labels
    samples = samples.to(device, non_blocking=True)
    if kind in ("images", "encoded"):
        if samples.dim() == 3:                      # (B, H, W) grayscale
            samples = samples.unsqueeze(1)
        else:                                       # (B, H, W, C) -> (B, C, H, W)
            samples = samples.permute(0, 3, 1, 2)
        samples = samples.float().div_(127.5).sub_(1.0)
    return samples.contiguous(), labels
