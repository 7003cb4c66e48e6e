"""The one builder of a rank's trainable parts: (config, engine, layout) -> backbone, head, both optimizers,
loss scale and counters. These are exactly what a checkpoint holds (``Parts.training_state``).

The classifier mode (``head.mode``, modes.py) builds its head and says who steps it; the engine (``comm``)
wraps the backbone's optimizer so that its gradients are averaged over ranks. Everything here is built
the same way by a training run, the simulator's virtual ranks and the benchmark. Reads no data.

Order matters for the numbers and is fixed here: the backbone is drawn from ``train.seed`` (the same on
every rank, and broadcast anyway), the head's rows from their global row blocks (``init_classifier_rows``),
then the rank's own process stream is seeded (dropout, sampling) before the optimizers are made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from .ckpt import checkpoint as ckpt
from ..classifier.modes import ClassifierMode, get_mode
from ..models import create_model
from ..models.recompute import set_activation_checkpointing
from ..classifier.optimizers import NoOptimizer, classifier_group, make_optimizer
from ..seeds import classifier_block_seed, rank_process_seed
from ..engine.syncbn import convert_sync_batchnorm
from .skips import DeviceSkips
from .speed import FastPaths, compile_backbone, device_skips_on, resolve_fast_paths, resolve_matmul, to_channels_last


def init_classifier_rows(weight: torch.Tensor, start: int, seed: int, block: int = 4096) -> None:
    """N(0, 0.01) rows seeded by *global* row blocks: class c starts the same whatever the world size.

    Each block of ``block`` global rows has its own generator; a rank draws only the blocks overlapping its
    slice and keeps its rows, so re-sharding and np=1 vs np=N comparisons start from the same centres.
    """
    width, dim = weight.shape
    end = start + width
    with torch.no_grad():
        for b0 in range((start // block) * block, end, block):
            g = torch.Generator().manual_seed(classifier_block_seed(seed, b0 // block))
            rows = torch.empty(block, dim).normal_(0, 0.01, generator=g)  # (block, D)
            lo, hi = max(start, b0), min(end, b0 + block)
            weight[lo - start:hi - start].copy_(rows[lo - b0:hi - b0])


class LossScale:
    """Dynamic loss scale for fp16 (a no-op otherwise). Its decisions use the *averaged* backbone gradient
    norm, which is identical on every rank, so the scale stays identical everywhere without a collective."""

    def __init__(self, enabled: bool, growth_interval: int, init: float = 2.0 ** 16):
        self.enabled, self.scale, self.growth_interval, self.good_steps = enabled, init if enabled else 1.0, growth_interval, 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale, self.good_steps = max(1.0, self.scale / 2.0), 0


@dataclass
class Counters:
    """Skipped steps: of the averaged gradient (every rank alike), and of this rank's classifier."""

    skipped_steps: int = 0
    consecutive_skips: int = 0
    classifier_skipped_steps: int = 0
    classifier_consecutive_skips: int = 0   # not checkpointed (a resume starts the count afresh)


@dataclass
class Parts:
    """A rank's trainable parts (``build_parts``)."""

    mode: ClassifierMode
    backbone: nn.Module
    head: nn.Module
    backbone_opt: Any                 # the engine's averaging optimizer (backbone; + classifier if averaged)
    head_opt: Any                     # the classifier's local optimizer (``NoOptimizer`` if averaged)
    loss_scale: LossScale
    head_grad_scale: float            # the classifier's local gradient is multiplied by this before its step
    model_args: Dict[str, Any]
    counters: Counters = field(default_factory=Counters)
    compiled: Dict[str, Any] = field(default_factory=dict)   # what train.compile compiled (speed.compile_backbone)
    fast: Optional[FastPaths] = None     # the fast-path keys as applied on this device (speed.resolve_fast_paths)
    device_skips: Optional[DeviceSkips] = None   # train.skip_decision=device: the decision's device side (skips.py)

    def backbone_opt_params(self) -> List[nn.Parameter]:
        """The parameters the averaging optimizer steps (backbone; + classifier when the mode averages it)."""
        return [p for g in self.backbone_opt.param_groups for p in g["params"]]

    def head_opt_params(self) -> List[nn.Parameter]:
        """The parameters of the classifier's local optimizer (none when the mode averages it)."""
        return [p for g in self.head_opt.param_groups for p in g["params"]]

    def training_state(self, layout, rank: int) -> ckpt.TrainingState:
        """What a checkpoint saves and restores (checkpoint.py), counters as plain values (their books kept
        up to the last step first, under ``train.skip_decision=device``)."""
        if self.device_skips is not None:
            self.device_skips.settle()
        c = self.counters
        return ckpt.TrainingState(
            backbone=self.backbone, backbone_opt=self.backbone_opt, head=self.head, head_opt=self.head_opt,
            label_slice=(layout.slices[rank].start, layout.slices[rank].end),
            slices=[(s.start, s.end) for s in layout.slices], rank=rank, world_size=layout.world_size,
            model_args=self.model_args, replicated=self.mode.replicated_rows,
            counters={"loss_scale": dict(vars(self.loss_scale)), "skipped_steps": c.skipped_steps,
                      "consecutive_skips": c.consecutive_skips,
                      "classifier_skipped_steps": c.classifier_skipped_steps})

    def restore_counters(self, saved: Dict[str, Any]) -> None:
        """The counters of ``training_state`` after ``checkpoint.load`` filled them."""
        self.loss_scale.__dict__.update(saved["loss_scale"])
        self.counters.skipped_steps = saved["skipped_steps"]
        self.counters.consecutive_skips = saved.get("consecutive_skips", 0)
        self.counters.classifier_skipped_steps = saved.get("classifier_skipped_steps", 0)


def model_args(cfg, sample_shape) -> Dict[str, Any]:
    """How to rebuild the backbone (recorded in checkpoints and exports)."""
    return {"name": cfg.model.name, "in_shape": list(sample_shape), "embedding_dim": cfg.model.embedding_dim,
            "kwargs": dict(cfg.model.kwargs)}


def build_parts(cfg, comm, layout, sample_shape, device: torch.device) -> Parts:
    """Rank ``comm.rank``'s parts for ``cfg`` on ``layout`` (``layout.RankLayout``); not a collective
    (sync BatchNorm's layers are collectives when they run, not when they are made)."""
    o, mode = cfg.optim, get_mode(cfg.head.mode)
    mode.check(cfg.head)
    torch.manual_seed(cfg.train.seed)  # same backbone init everywhere (and broadcast anyway)
    backbone = create_model(cfg.model.name, in_shape=list(sample_shape), embedding_dim=cfg.model.embedding_dim,
                            **cfg.model.kwargs).to(device)
    fast = resolve_fast_paths(cfg, device)
    to_channels_last(backbone, cfg, device)
    if cfg.model.checkpoint_activations:
        set_activation_checkpointing(backbone, True)
    if cfg.model.sync_batchnorm:
        convert_sync_batchnorm(backbone, comm)
    head = mode.create_head(cfg, layout, comm.rank, comm)
    init_classifier_rows(head.weight, head.row_start, cfg.train.seed)
    head.matmul = resolve_matmul(cfg.head.matmul, device)
    head.to(device)
    # before any optimizer hooks the parameters (the compile's probe runs a backward)
    compiled = compile_backbone(backbone, head, cfg, device, sample_shape)
    torch.manual_seed(rank_process_seed(cfg.train.seed, comm.rank))  # per-rank stream (dropout, sampling)
    backbone_opt = make_optimizer(backbone.parameters(), o.name, o.backbone_lr, o.backbone_momentum,
                                  o.backbone_weight_decay, kernel=fast.backbone_kernel)
    averaged: nn.Module = backbone
    head_opt = mode.classifier_optimizer(head, cfg)
    if head_opt is None:
        # the mode's classifier gradient is averaged with the backbone's: one param group more
        backbone_opt.add_param_group(classifier_group(head, o))
        averaged = nn.ModuleDict({"backbone": backbone, "classifier": head})
        head_opt = NoOptimizer()
    on_device = device_skips_on(cfg, fast, {"backbone": backbone_opt, "classifier": head_opt})
    backbone_opt = comm.distributed_optimizer(backbone_opt, averaged, fp16_compression=o.fp16_compression,
                                              backward_passes_per_step=o.backward_passes_per_step)
    parts = Parts(mode=mode, backbone=backbone, head=head, backbone_opt=backbone_opt, head_opt=head_opt,
                  loss_scale=LossScale(cfg.train.precision == "fp16", growth_interval=cfg.train.loss_scale_growth),
                  head_grad_scale=mode.grad_scale(cfg, comm.size), model_args=model_args(cfg, sample_shape),
                  compiled=compiled, fast=fast)
    if on_device:
        parts.device_skips = DeviceSkips(cfg, comm, parts, device)
    return parts
