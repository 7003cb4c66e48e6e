"""Build once: from (config, engine) to a ``Trainer`` ready to loop. A collective: every rank calls it.

    cfg --> device, threads
        --> the run folder's lock (rank 0; run_lock.py: one job a run folder)
        --> manifest --> layout (every rank's slice and shards) --> dataset (this rank's shards)
        --> build_parts(cfg, comm, layout)                     (parts.py: backbone, head, optimizers)
        --> evaluator                                           (pair sets read and checked on rank 0)
        [every error so far agreed across ranks]
        --> node memory (snapshots/node_memory.py: checkpoint.memory_every; the node's room checked)
        --> resume (ckpt/resume.py; the newest snapshot node memory offers, else the disk)
        --> the snapshots take the node over (snapshots/memory.py)   model.init_backbone (a fresh start only)
        [every error so far is about the user's input: ``checking_input``, exit 2]
        --> backbone broadcast from rank 0, digests checked     (identical starts)
        --> steps agreed (uneven shards never deadlock) --> loader, checkpointer --> Trainer

``cfg`` is read here and by the parts it builds; nothing below this point reaches back for it.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Optional, Tuple

import torch

from .ckpt import checkpoint as ckpt
from . import progress
from .watch import run_lock
from ..data import class_identity
from ..data.augment import BatchAugment, parse_augment
from ..config import ConfigError
from ..data.device_decode import choose_decode
from ..data.loader import RankShardDataset, make_loader, resolve_workers
from ..data.layout import RankLayout
from ..engine.base import RankFailure
from ..engine.device import select_device
from .snapshots.memory import MemorySnapshots
from .snapshots.node_memory import NodeMemory
from .metrics_log import tensorboard_missing
from .parts import build_parts
from ..models.pretrained import load_initial_backbone
from .ckpt.resume import DataIdentity, resume
from ..data.shards import check_shard_file, data_digest, manifest_digest, rank_layout, read_manifest
from .speed import compile_note, set_device_flags
from .step import Step
from .trainer import BuiltRun, RunData, Trainer
from ..verification.evaluator import Evaluator
from ..verification.verify_pairs import check_input_shape


def rank_threads(local_size: int) -> int:
    """A CPU rank's default intra-op threads: the host's cores shared by its ``local_size`` ranks, at least 1."""
    return max(1, (os.cpu_count() or 1) // local_size)


def pick_device(cfg, comm) -> torch.device:
    """This rank's device for ``train.device`` (engine/device.py's rule, which the engine applied already)."""
    return select_device(cfg.train.device, comm.rank, comm.local_rank)


def check_runtime_options(cfg, kind: str) -> None:
    """ConfigError for options the config alone cannot check: the augmentations (registered names, and none
    on features), and TensorBoard when asked for (installed?). Before the first step, not at the first log."""
    try:
        parse_augment(cfg.data.augment, kind)
    except ValueError as e:
        raise ConfigError(f"data.augment: {e}") from None
    if cfg.train.tensorboard:
        missing = tensorboard_missing()
        if missing:
            raise ConfigError(f"train.tensorboard: {missing}")


def _choose_decode(cfg, device, dataset):
    """``data.decode`` on this rank (device_decode.choose_decode): (cpu | gpu, the fallback's log line)."""
    try:
        return choose_decode(cfg.data.decode, device, dataset,
                             BatchAugment(cfg.data.augment, cfg.train.seed, dataset.rank, dataset.kind))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _read_data(cfg, comm) -> RunData:
    """The shard set, the layout on this world size, this rank's dataset (checked), the data's identity."""
    manifest = read_manifest(cfg.data.shards)
    layout: RankLayout = rank_layout(manifest, comm.size)
    dataset = RankShardDataset(cfg.data.shards, comm.rank, comm.size, manifest, layout=layout,
                               on_bad_sample=cfg.data.on_bad_sample)
    check_runtime_options(cfg, manifest.kind)
    if cfg.data.verify_sha256:
        for i in layout.shard_blocks[comm.rank]:
            check_shard_file(cfg.data.shards, manifest, i, verify_sha256=True)
    batches = len(dataset) // cfg.data.batch_size
    if batches < cfg.optim.backward_passes_per_step:
        raise ValueError(f"rank {comm.rank}: {len(dataset)} samples make fewer than one step of "
                         f"{cfg.optim.backward_passes_per_step} x {cfg.data.batch_size}")
    return RunData(manifest, layout, dataset, data_identity(cfg, manifest), batches)


def data_identity(cfg, manifest) -> DataIdentity:
    """What resume compares of the shard set at ``cfg.data.shards`` (resume.py ``check_data``)."""
    return DataIdentity(data_digest(manifest), manifest_digest(cfg.data.shards), manifest.num_classes,
                        tuple((s.start, s.end) for s in manifest.shard_slices()), class_identity.of_run(manifest))


def run_info_of(cfg, m, identity: Optional[DataIdentity] = None) -> Dict[str, Any]:
    """What meta.json records about the run besides its state (``Checkpointer``'s ``run_info``)."""
    identity = identity or data_identity(cfg, m)
    return {"num_classes": m.num_classes, "embedding_dim": cfg.model.embedding_dim,
            "shard_slices": [[s.start, s.end] for s in m.shard_slices()],
            "shard_samples": [s.num_samples for s in m.shards],   # re-sharding balances blocks by them
            "manifest_sha256": identity.manifest_sha256, "data_sha256": identity.data_sha256,
            "class_identity": identity.classes, "config": cfg.to_dict()}


def _init_backbone(cfg, comm, parts) -> None:
    """``model.init_backbone``: rank 0 reads the file; the broadcast that follows gives it to all ranks."""
    error = None
    if comm.is_main:
        try:
            info = load_initial_backbone(parts.backbone, cfg.model.init_backbone, parts.model_args)
            print(f"backbone initialised from {info['path']} ({info['format']}, {info['tensors']} tensors)",
                  flush=True)
        except Exception as e:
            error = f"model.init_backbone: {type(e).__name__}: {e}"
    comm.agree(error, name="init_backbone")


def _length_record(resumed_from, manifest):
    """The resumed checkpoint's run length (progress.py), or None for a fresh start; a checkpoint from
    before it was recorded is read as one segment at its world size."""
    if resumed_from is None:
        return None
    meta = resumed_from["meta"]
    return meta.get("length") or progress.legacy_record(
        meta, meta.get("shard_samples") or [s.num_samples for s in manifest.shards])


@contextmanager
def checking_input():
    """Start-up's checks of what the user gave (shards, config, checkpoint, pair sets, the run folder, the snapshot
    folder): an agreed failure inside is a user's mistake, tagged ``before_training`` (cli_support.rank_error:
    exit 2), while one later is the run's own failure (exit 1)."""
    try:
        yield
    except RankFailure as e:
        e.before_training = bool(e.failures)
        raise


def _set_up_device(cfg, comm) -> torch.device:
    """This rank's device, its flags and its intra-op threads."""
    device = pick_device(cfg, comm)
    set_device_flags(cfg, device)
    set_threads(cfg, device.type, comm.local_size)
    return device


def set_threads(cfg, device_type: str, local_size: int) -> None:
    """This rank's intra-op threads: ``train.threads``, else on the CPU the host's cores shared by its
    ``local_size`` ranks (ranks sharing a host share its cores; oversubscription thrashes)."""
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    elif device_type == "cpu":
        torch.set_num_threads(rank_threads(local_size))


def _build(cfg, comm, device, say) -> Tuple[RunData, Any, Any, str]:
    """The run folder's lock, the data, the parts and the evaluator, every error agreed: (data, parts, evaluator,
    where JPEGs are decoded)."""
    comm.agree(run_lock.hold(cfg.out, cfg.checkpoint.lock_wait, say) if comm.is_main else None, name="run.lock")
    error = data = parts = evaluator = None
    decode, decode_note = "cpu", ""
    try:
        data = _read_data(cfg, comm)
        decode, decode_note = _choose_decode(cfg, device, data.dataset)
        parts = build_parts(cfg, comm, data.layout, data.manifest.sample_shape, device)
        # Verification during training: every rank holds the evaluator (it averages BatchNorm buffers, a
        # collective), rank 0 reads and checks the pair sets here, so a bad path fails before training.
        evaluator = Evaluator.from_config(cfg.eval, cfg.out, comm=comm)
        for pairset in evaluator.sets:
            check_input_shape(parts.model_args, pairset)
    except Exception as e:  # reported with the rank, agreed below
        error = f"{type(e).__name__}: {e}"
    comm.agree(error, name="setup")
    for note in (decode_note, compile_note(parts.compiled)):
        if note:
            say(note)
    return data, parts, evaluator, decode


def _resume(cfg, comm, parts, data: RunData, node) -> Optional[Dict[str, Any]]:
    """``checkpoint.resume``: the resume point (resume.py; a newer memory snapshot first, ``node``'s offer), its
    restore time recorded; None for a fresh start."""
    if not cfg.checkpoint.resume:
        return None
    t0 = time.perf_counter()
    point = resume(cfg, comm, parts, data.layout, data.identity, node)
    if point:
        point["restore_s"] = time.perf_counter() - t0   # finding, gathering, loading: disk against memory
    return point


def _identical_start(comm, parts, point) -> None:
    """Rank 0's backbone (parameters and buffers) everywhere, then verified; then this rank's own BatchNorm
    statistics, where its checkpoint file kept them."""
    comm.broadcast_module(parts.backbone, name="backbone.init")
    comm.check_identical(parts.backbone, name="start")
    if point:
        ckpt.restore_buffers(parts.backbone, point["own_buffers"])


def start_trainer(cfg, comm) -> Trainer:
    """Build this rank's run and agree on it with the other ranks (see the module's docstring)."""
    device = _set_up_device(cfg, comm)
    say = (lambda msg: print(msg, flush=True)) if comm.is_main else (lambda msg: None)
    with checking_input():
        data, parts, evaluator, decode = _build(cfg, comm, device, say)
        node = NodeMemory.open(cfg, comm, parts, log=say)
        point = _resume(cfg, comm, parts, data, node)
        start_step = point["step"] if point else 0
        snapshots = MemorySnapshots.take_over(node, start_step) if node is not None else None
        if cfg.model.init_backbone and point is None:   # a fresh start only
            _init_backbone(cfg, comm, parts)
    _identical_start(comm, parts, point)
    passes, m = cfg.optim.backward_passes_per_step, data.manifest
    min_spe = int(comm.allreduce_scalar(data.local_batches // passes, "min", name="steps_per_epoch"))
    length = progress.plan(cfg, comm.size, min_spe, start_step, _length_record(point, m), log=say)
    loader, _ = make_loader(data.dataset, cfg.data.batch_size, cfg.train.seed,
                            resolve_workers(cfg.data.workers, comm.local_size),
                            start=length.loader_start(start_step, data.local_batches, passes),
                            pin_memory=device.type == "cuda", augment=cfg.data.augment, decode=decode)
    checkpointer = ckpt.Checkpointer(cfg.out, cfg.checkpoint.every, cfg.checkpoint.keep, comm,
                                     run_info_of(cfg, m, data.identity), cfg.checkpoint.every_minutes)
    with checking_input():   # checkpoints of this run folder newer than where it starts: moved aside, never deleted
        checkpointer.prepare(start_step, log=lambda msg: print(msg, flush=True))
    step = Step(cfg, comm, parts, device, m.kind, length)
    return Trainer(cfg, comm, BuiltRun(parts, step, data, loader, checkpointer, evaluator, snapshots, start_step,
                                       point))
