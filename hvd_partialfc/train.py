"""The training loop: one loop for every mode, read top to bottom.

Per step, on every rank (DESIGN.md §1):
  1. draw ``backward_passes_per_step`` batches of *this rank's* classes from its dedicated loader;
  2. backbone(x) -> features -> local classifier (width = slice) -> margin loss on local labels;
  3. backward: gradients for the backbone and for the local classifier;
  4. the backbone optimizer (Horovod DistributedOptimizer over backbone parameters only) averages the
     backbone gradients across ranks; they are clipped / checked after that average, so every rank
     takes the same decision without another collective;
  5. the classifier optimizer (plain torch) steps with the local gradient only;
  6. the learning rate of both follows one schedule (warmup, then cosine / poly), one step per step.
Before the first step: errors are agreed, the backbone is broadcast from rank 0 and its digest checked
on every rank, and the number of steps is agreed (uneven shards never deadlock).
"""
from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from tqdm import tqdm

from . import checkpoint as ckpt
from . import comm as comm_lib
from . import faults
from .augment import parse_augment
from .config import Config, diff_configs, dump_config, saved_config
from .data import RankShardDataset, make_loader, prepare_batch
from .logging_sinks import LoaderWatch, MetricsLog
from . import modes
from .models import create_model
from .models.recompute import set_activation_checkpointing
from .pretrained import load_initial_backbone
from .preempt import StopSignals
from .rowsparse import SampledRowsOptimizer, grad_values
from .seeds import RESHARD_RESEED, derive_seed
from .syncbn import convert_sync_batchnorm
from .shards import data_digest, manifest_digest, read_manifest
from .verification.evaluator import Evaluator
from .verification.pairs import check_input_shape

# Config keys that may change between a checkpoint and its resume (they do not change the numbers).
RESUME_FREE_KEYS = ("out", "checkpoint", "train.log_every", "train.threads", "train.device", "data.workers",
                    "data.verify_sha256", "data.shards", "eval.batch_size", "train.max_consecutive_skips",
                    "model.checkpoint_activations", "train.tensorboard")
# Keys that may change to *extend* a run (train longer): allowed, but the lr schedule is then recomputed,
# so the result is no longer the uninterrupted run's; resume says so.
RESUME_EXTEND_KEYS = ("train.steps", "train.epochs")


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float, power: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based): linear warmup, then decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        decay = 0.5 * (1 + math.cos(math.pi * progress))
    elif schedule == "poly":
        decay = (1 - progress) ** power
    else:
        decay = 1.0
    return min_ratio + (1 - min_ratio) * decay


def make_optimizer(params, name: str, lr: float, momentum: float, weight_decay: float,
                   sampled_rows: str = "") -> torch.optim.Optimizer:
    """torch's SGD / AdamW; ``sampled_rows`` ("exact" / "lazy"): the step over the rows of a row-sparse
    gradient only, with that rule (`rowsparse.SampledRowsOptimizer`, the classifier of sampled ``local``)."""
    if sampled_rows:
        return SampledRowsOptimizer(params, name, lr, momentum=momentum, weight_decay=weight_decay, rule=sampled_rows)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; known: sgd, adamw")


def init_classifier_rows(weight: torch.Tensor, start: int, seed: int, block: int = 4096) -> None:
    """N(0, 0.01) rows seeded by *global* row blocks: class c starts the same whatever the world size.

    Each block of ``block`` global rows has its own generator; a rank draws only the blocks overlapping its
    slice and keeps its rows, so re-sharding and np=1 vs np=N comparisons start from the same centres.
    """
    width, dim = weight.shape
    end = start + width
    with torch.no_grad():
        for b0 in range((start // block) * block, end, block):
            g = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 + b0 // block)
            rows = torch.empty(block, dim).normal_(0, 0.01, generator=g)  # (block, D)
            lo, hi = max(start, b0), min(end, b0 + block)
            weight[lo - start:hi - start].copy_(rows[lo - b0:hi - b0])


class NonFiniteError(RuntimeError):
    pass


class SkippedStepsError(NonFiniteError):
    """Too many steps in a row skipped (``train.max_consecutive_skips``): the run is no longer training."""


def rank_threads(local_size: int) -> int:
    """A CPU rank's default intra-op threads: the host's cores shared by its ``local_size`` ranks, at least 1."""
    return max(1, (os.cpu_count() or 1) // local_size)


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


class Trainer:
    """Builds a rank's components, agrees on them with the other ranks, and runs the loop."""

    def __init__(self, cfg: Config, comm: comm_lib.Comm):
        self.cfg, self.comm = cfg, comm
        self.device = self._device()
        if cfg.train.threads > 0:
            torch.set_num_threads(cfg.train.threads)
        elif self.device.type == "cpu":  # ranks sharing a host share its cores; oversubscription thrashes
            torch.set_num_threads(rank_threads(comm.local_size))
        error = None
        try:
            self._build()
        except Exception as e:  # reported with the rank, agreed below
            error = f"{type(e).__name__}: {e}"
        comm.agree(error, name="setup")
        self.start_step, self.resumed_from = 0, None
        if cfg.checkpoint.resume:
            self._resume()
        if cfg.model.init_backbone and self.resumed_from is None:   # a fresh start only
            self._init_backbone()
        # Identical starts: rank 0's backbone (parameters and buffers) everywhere, then verified.
        comm.broadcast_module(self.backbone, name="backbone.init")
        comm.check_identical(self.backbone, name="start")
        steps_per_epoch = self.local_batches_per_epoch // cfg.optim.backward_passes_per_step
        min_spe = int(comm.allreduce_scalar(steps_per_epoch, "min", name="steps_per_epoch"))
        self.total_steps = cfg.train.steps or max(1, int(cfg.train.epochs * min_spe))
        self.loader, _ = make_loader(self.dataset, cfg.data.batch_size, cfg.train.seed, cfg.data.workers,
                                     start=self.start_step * cfg.optim.backward_passes_per_step,
                                     pin_memory=self.device.type == "cuda", augment=cfg.data.augment)
        run_info = {"num_classes": self.manifest.num_classes, "embedding_dim": cfg.model.embedding_dim,
                    "shard_slices": [[s.start, s.end] for s in self.manifest.shard_slices()],
                    "manifest_sha256": self.manifest_sha256, "data_sha256": self.data_sha256,
                    "config": cfg.to_dict()}
        self.checkpointer = ckpt.Checkpointer(cfg.out, cfg.checkpoint.every, cfg.checkpoint.keep, comm, run_info)
        # Checkpoints of this run folder newer than where it starts are moved aside (never deleted).
        self.checkpointer.prepare(self.start_step, log=lambda m: print(m, flush=True))
        self.stopped_by: Optional[str] = None   # the signal that stopped fit(), if one did
        self.loader_watch = LoaderWatch(cfg.data.workers)

    @classmethod
    def for_synthetic(cls, cfg: Config, comm, slices, num_classes: int, sample_shape) -> "Trainer":
        """The trainer's own components (backbone, the mode's head, both optimizers) for rank ``comm.rank``
        of ``slices`` (every rank's label slice), without shards, loader or checkpointer: ``train_step``
        then runs on batches of features the caller supplies (``bench`` does). CPU, no agreement step."""
        self = cls.__new__(cls)
        self.cfg, self.comm, self.device = cfg, comm, torch.device("cpu")
        self.all_slices = list(slices)
        self.label_slice = self.all_slices[comm.rank]
        self.manifest = SimpleNamespace(kind="features", num_classes=num_classes)
        self._build_model(list(sample_shape), num_classes)
        return self

    # --- construction -------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        want = self.cfg.train.device
        if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
            torch.cuda.set_device(self.comm.local_rank)
            return torch.device("cuda", self.comm.local_rank)
        return torch.device("cpu")

    def _build(self) -> None:
        cfg, comm = self.cfg, self.comm
        self.manifest = read_manifest(cfg.data.shards)
        self.manifest_sha256 = manifest_digest(cfg.data.shards)
        self.data_sha256 = data_digest(self.manifest)
        self.dataset = RankShardDataset(cfg.data.shards, comm.rank, comm.size, self.manifest)
        parse_augment(cfg.data.augment, self.manifest.kind)   # features cannot be augmented: an agreed error
        if cfg.data.verify_sha256:
            from .shards import check_shard_file
            for i in self._rank_shard_indices():
                check_shard_file(cfg.data.shards, self.manifest, i, verify_sha256=True)
        self.label_slice = self.dataset.label_slice
        self.local_batches_per_epoch = len(self.dataset) // cfg.data.batch_size
        if self.local_batches_per_epoch < cfg.optim.backward_passes_per_step:
            raise ValueError(f"rank {comm.rank}: {len(self.dataset)} samples make fewer than one step of "
                             f"{cfg.optim.backward_passes_per_step} x {cfg.data.batch_size}")
        self.all_slices = _all_slices(self.manifest, comm.size)
        self._build_model(self.manifest.sample_shape, self.manifest.num_classes)
        # Verification during training: every rank holds the evaluator (it averages BatchNorm buffers, a
        # collective), rank 0 reads and checks the pair sets here, so a bad path fails before training,
        # agreed like every other setup error.
        self.evaluator = Evaluator.from_config(cfg.eval, cfg.out, comm=comm)
        for pairset in self.evaluator.sets:
            check_input_shape(self.model_args, pairset)

    def _build_model(self, sample_shape, num_classes: int) -> None:
        """Backbone, the mode's classifier and the optimizers; the mode (``head.mode``, see modes.py)
        decides only the head, its loss and which optimizer owns the classifier.

        Needs ``self.label_slice`` and reads no data (the benchmark calls it with synthetic batches).
        """
        cfg, comm, o = self.cfg, self.comm, self.cfg.optim
        torch.manual_seed(cfg.train.seed)  # same backbone init everywhere (and broadcast anyway)
        self.model_args = {"name": cfg.model.name, "in_shape": list(sample_shape),
                           "embedding_dim": cfg.model.embedding_dim, "kwargs": dict(cfg.model.kwargs)}
        self.backbone = create_model(cfg.model.name, in_shape=sample_shape,
                                     embedding_dim=cfg.model.embedding_dim, **cfg.model.kwargs).to(self.device)
        if cfg.model.checkpoint_activations:
            set_activation_checkpointing(self.backbone, True)
        if cfg.model.sync_batchnorm:
            convert_sync_batchnorm(self.backbone, comm)
        widths = [sl.width for sl in self.all_slices] if getattr(self, "all_slices", None) else None
        self.classifier = modes.create_head(cfg.head.mode, self.label_slice, num_classes, cfg.model.embedding_dim,
                                            cfg.head, comm, slice_widths=widths, seed=cfg.train.seed)
        init_classifier_rows(self.classifier.weight, self.classifier.row_start, cfg.train.seed)
        self.classifier.to(self.device)
        torch.manual_seed(cfg.train.seed * 1_000_003 + comm.rank)  # per-rank stream (dropout, sampling)
        backbone_opt = make_optimizer(self.backbone.parameters(), o.name, o.backbone_lr, o.backbone_momentum,
                                      o.backbone_weight_decay)
        averaged: nn.Module = self.backbone
        if cfg.head.mode == "replicated":
            # Classic data parallel: the full classifier's gradient is averaged with the backbone's.
            backbone_opt.add_param_group(modes.classifier_group(cfg.head.mode, self.classifier, o))
            averaged = nn.ModuleDict({"backbone": self.backbone, "classifier": self.classifier})
            self.classifier_opt = modes.NoOptimizer()
        else:
            # The classifier: a plain optimizer, local gradient only, never communicated.
            # Sampled `local`: the gradient is row-sparse and the step touches the sampled rows only.
            rule = self._sampled_rule()
            self.classifier_opt = make_optimizer([modes.classifier_group(cfg.head.mode, self.classifier, o)],
                                                 o.name, o.classifier_lr, o.classifier_momentum,
                                                 o.classifier_weight_decay, sampled_rows=rule)
            if rule == "exact":
                self.classifier.before_gather = self.classifier_opt.catch_up
        self.backbone_opt = comm.distributed_optimizer(
            backbone_opt, averaged, fp16_compression=o.fp16_compression,
            backward_passes_per_step=o.backward_passes_per_step)
        self.loss_scale = LossScale(cfg.train.precision == "fp16", growth_interval=cfg.train.loss_scale_growth)
        self.skipped_steps = 0             # steps whose averaged backbone gradient was not finite (all ranks)
        self.consecutive_skips = 0
        self.classifier_skipped_steps = 0  # this rank's classifier steps skipped for a non-finite gradient
        self.classifier_consecutive_skips = 0
        # `local` mode's loss is the mean over this rank's batch, so its classifier's gradient is N times
        # the one np=1 (or `global` mode, whose loss is the mean over the gathered batch) computes for the
        # same rows; "global" divides it back (`replicated` already averages it with the backbone's).
        self.classifier_grad_scale = (1.0 / comm.size if cfg.head.mode == "local"
                                      and o.classifier_grad_mean == "global" else 1.0)

    def _init_backbone(self) -> None:
        """``model.init_backbone``: rank 0 reads the file; the broadcast that follows gives it to all ranks."""
        error = None
        if self.comm.is_main:
            try:
                info = load_initial_backbone(self.backbone, self.cfg.model.init_backbone, self.model_args)
                print(f"backbone initialised from {info['path']} ({info['format']}, {info['tensors']} tensors)",
                      flush=True)
            except Exception as e:
                error = f"model.init_backbone: {type(e).__name__}: {e}"
        self.comm.agree(error, name="init_backbone")

    def _sampled_rule(self) -> str:
        """The sampled-rows optimizer's rule for the classifier ("" : a plain torch optimizer). AdamW has
        no exact rule (its zero-gradient steps are not linear): "exact" means "lazy" there (rowsparse.py)."""
        h = self.cfg.head
        if h.mode != "local" or h.sample_rate >= 1.0 or h.sampled_step == "dense":
            return ""
        return "lazy" if self.cfg.optim.name == "adamw" else h.sampled_step

    def _rank_shard_indices(self) -> List[int]:
        from .shards import rank_shards
        return rank_shards(self.manifest, self.comm.rank, self.comm.size)[0]

    # --- one step -----------------------------------------------------------------------------------
    def _set_lr(self, step: int) -> float:
        o = self.cfg.optim
        f = lr_factor(step, self.total_steps, o.warmup_steps, o.schedule, o.min_lr_ratio, o.poly_power)
        for opt, peak in ((self.backbone_opt, o.backbone_lr), (self.classifier_opt, o.classifier_lr)):
            for g in opt.param_groups:
                # lr_from: the classifier's group names its peak lr (it sits in backbone_opt in `replicated`)
                g["lr"] = (getattr(o, g["lr_from"]) if "lr_from" in g else peak) * f
        return f

    def _autocast(self):
        p = self.cfg.train.precision
        if p == "fp32":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if p == "bf16" else torch.float16)

    def train_step(self, step: int, batches: Iterator) -> Dict[str, float]:
        """One optimizer step over ``backward_passes_per_step`` local batches; returns its figures."""
        k = self.cfg.optim.backward_passes_per_step
        lr_f = self._set_lr(step)
        self.backbone.train(), self.classifier.train()
        self.backbone_opt.zero_grad()  # Horovod: set_to_none is torch 2 default
        self.classifier_opt.zero_grad(set_to_none=True)
        self.classifier.before_step(step)        # the head's periodic work (cross-shard negatives), a collective
        t0, data_time, loss_sum = time.perf_counter(), 0.0, 0.0
        for _ in range(k):
            td = time.perf_counter()
            x, y = prepare_batch(*next(batches), self.device, self.manifest.kind)  # x: (B, ...), y: (B,) local
            data_time += time.perf_counter() - td
            with self._autocast():
                features = self.backbone(x)                                         # (B, D)
            loss = self.classifier(features.float(), y) / k                         # the mode's loss
            (loss * self.loss_scale.scale).backward()
            loss_sum += loss.item()
        self.backbone_opt.synchronize()          # averaged grads are now the mean over ranks
        # Averaged: the backbone's (and in `replicated` the classifier's, which the same DistributedOptimizer
        # averages): identical on all ranks, so the finite check and the clipping decide the same everywhere.
        averaged = [p for p in self.backbone_opt_params() if p.grad is not None]
        local = [p for p in self.classifier_opt_params() if p.grad is not None]
        if self.loss_scale.enabled:
            for p in averaged:
                p.grad.div_(self.loss_scale.scale)
        if self.loss_scale.enabled or self.classifier_grad_scale != 1.0:
            for p in local:
                p.grad.mul_(self.classifier_grad_scale / self.loss_scale.scale)
        norm_t = torch.nn.utils.get_total_norm([p.grad for p in averaged])  # identical on all ranks
        grad_norm = float(norm_t)
        finite = math.isfinite(grad_norm)
        self.loss_scale.update(finite)
        if finite:
            self.consecutive_skips = 0
            if self.cfg.optim.clip_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(averaged, self.cfg.optim.clip_grad_norm, norm_t)
            comm_lib.step_synchronized(self.backbone_opt)
            if local:
                cls_norm = float(torch.nn.utils.get_total_norm([grad_values(p.grad) for p in local]))
                if math.isfinite(cls_norm):  # local decision: the classifier is local
                    self.classifier_opt.step()
                    self.classifier_consecutive_skips = 0
                else:
                    self.classifier_skipped_steps += 1
                    self.classifier_consecutive_skips += 1
                    self._check_skips(self.classifier_consecutive_skips, step, "this rank's classifier gradient")
        elif self.loss_scale.enabled or self.cfg.train.on_nonfinite == "skip":
            self.skipped_steps += 1      # every rank skips: the averaged norm is the same everywhere
            self.consecutive_skips += 1
            self._check_skips(self.consecutive_skips, step, "the averaged gradient")
        else:
            raise NonFiniteError(f"rank {self.comm.rank}: non-finite backbone gradient at step {step} "
                                 f"(local loss {loss_sum}); set train.on_nonfinite=skip to skip such steps")
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr_factor": lr_f,
                "data_time": data_time, "step_time": time.perf_counter() - t0}

    def _check_skips(self, consecutive: int, step: int, what: str) -> None:
        limit = self.cfg.train.max_consecutive_skips
        if limit and consecutive >= limit:
            scale = f"; fp16 loss scale now {self.loss_scale.scale:g}" if self.loss_scale.enabled else ""
            raise SkippedStepsError(
                f"rank {self.comm.rank}: {consecutive} steps in a row skipped up to step {step}: {what} is not "
                f"finite{scale}. The run is not training; stopping (train.max_consecutive_skips="
                f"{limit}). Lower the learning rate, check the data, or resume from an earlier checkpoint")

    def backbone_opt_params(self) -> List[nn.Parameter]:
        """The parameters the averaging optimizer steps (backbone; + classifier in `replicated`)."""
        return [p for g in self.backbone_opt.param_groups for p in g["params"]]

    def classifier_opt_params(self) -> List[nn.Parameter]:
        """The parameters of the local classifier optimizer (none in `replicated`)."""
        return [p for g in self.classifier_opt.param_groups for p in g["params"]]

    # --- the loop -----------------------------------------------------------------------------------
    def startup_notes(self) -> List[str]:
        """The lines rank 0 prints before the first step: the negatives' exchange and its cost against the
        backbone gradient (more than one rank), and a warning when sampled ``local`` scores few rows."""
        notes = []
        if self.comm.size > 1 and hasattr(self.classifier, "describe"):
            notes.append(self.classifier.describe(comm_lib.gradient_bytes(self.backbone.parameters(),
                                                                          self.cfg.optim.fp16_compression)))
        warning = self.classifier.sampling_warning() if hasattr(self.classifier, "sampling_warning") else None
        return notes + ([warning] if warning else [])

    def fit(self) -> str:
        """Train to ``total_steps`` (or until a stop signal, then ``self.stopped_by`` names it); returns the
        last checkpoint folder."""
        cfg, comm = self.cfg, self.comm
        if comm.is_main:
            os.makedirs(cfg.out, exist_ok=True)
            dump_config(cfg, os.path.join(cfg.out, "config.yaml"))
        if self.start_step >= self.total_steps:
            return self._nothing_to_train()
        metrics = MetricsLog(cfg.out, cfg.train.tensorboard) if comm.is_main else None
        interval = {"data_time": 0.0, "step_time": 0.0}   # seconds summed since the last log line
        samples_per_step = cfg.data.batch_size * cfg.optim.backward_passes_per_step * comm.size
        bar = tqdm(total=self.total_steps, initial=self.start_step, disable=not comm.is_main,
                   dynamic_ncols=True, desc=f"train np={comm.size}")
        if comm.is_main:
            for line in self.startup_notes():
                bar.write(line)
        if self.resumed_from and comm.is_main:
            r = self.resumed_from
            bar.write(f"resumed from {r['path']} at step {r['step']} (written by {r['world_size']} ranks)")
        last_log, last_t = self.start_step, time.perf_counter()
        last_save = time.monotonic()
        every_s = 60.0 * cfg.checkpoint.every_minutes
        ckpt_dir, vote = None, None
        try:
            with StopSignals() as signals:
                batches = iter(self.loader)   # after the handlers: forked workers inherit them
                for step in range(self.start_step, self.total_steps):
                    faults.before_step(step, comm.rank)
                    out = self.train_step(step, batches)
                    for key in interval:
                        interval[key] += out[key]
                    done = step + 1
                    final = done == self.total_steps
                    # The vote started after the previous step: did any rank get a stop signal, is rank 0's
                    # time-based checkpoint due? Every rank reads the same answer at the same step.
                    stop, time_due = (v > 0 for v in vote.result()) if vote is not None else (False, False)
                    vote = None
                    if done % cfg.train.log_every == 0 or final:
                        last_log, last_t = self._log(done, out, samples_per_step, last_log, last_t, metrics, bar,
                                                     interval)
                    bar.update(1)
                    self.maybe_evaluate(done, final=final, bar=bar, metrics=metrics)
                    if self.checkpointer.due(done, final) or stop or time_due:
                        ckpt_dir = self.save_checkpoint(done)
                        last_save = time.monotonic()
                    if stop:
                        self.stopped_by = signals.received or "a stop signal on another rank"
                        bar.write(f"step {done}: stopping on {self.stopped_by}; checkpoint {ckpt_dir} written, "
                                  f"resume with --resume auto")
                        break
                    if not final:  # after the save, so a time-based checkpoint is not due twice in a row
                        due = comm.is_main and every_s > 0 and time.monotonic() - last_save >= every_s
                        vote = comm.vote_async([signals.received is not None, due], name="step")
        finally:
            bar.close()
            if metrics:
                metrics.close()
        return ckpt_dir

    def _log(self, done: int, out: Dict[str, float], samples_per_step: int, last_log: int, last_t: float,
             metrics, bar, interval: Dict[str, float]) -> Tuple[int, float]:
        """The log line of step ``done`` (collectives: the mean loss, the classifier skips over ranks).
        ``interval``: rank 0's data and step seconds summed since the last line (reset here); the record
        holds their means per step, and the first interval after a (re)start, which includes the workers'
        start-up, never warns."""
        cfg = self.cfg
        mean_loss = self.comm.allreduce_scalar(out["loss"], "average", name="log.loss")
        cls_skips = int(self.comm.allreduce_scalar(self.classifier_skipped_steps, "sum", name="log.cls_skips"))
        now = time.perf_counter()
        sps = samples_per_step * (done - last_log) / max(now - last_t, 1e-9)
        lr = cfg.optim.backbone_lr * out["lr_factor"]
        data_t, step_t = (interval[k] / max(1, done - last_log) for k in ("data_time", "step_time"))
        interval.update(data_time=0.0, step_time=0.0)
        if metrics:
            rec = {"step": done, "loss": mean_loss, "rank0_loss": out["loss"], "lr": lr,
                   "grad_norm": out["grad_norm"], "samples_per_s": sps, "skipped_steps": self.skipped_steps,
                   "classifier_skipped_steps": cls_skips, "data_time": data_t, "step_time": step_t,
                   "time": time.time()}
            if self.loss_scale.enabled:
                rec["loss_scale"] = self.loss_scale.scale
            metrics.write(rec)
        bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.4g}", sps=f"{sps:.0f}", data=f"{data_t:.3f}/{step_t:.3f}s")
        warning = self.loader_watch.check(done, data_t, step_t, first=last_log == self.start_step)
        if warning and self.comm.is_main:   # rank 0's figures, said by rank 0 (tqdm.write ignores `disable`)
            bar.write(warning)
        return done, now

    def _nothing_to_train(self) -> str:
        """Resumed at (or past) the last step: nothing is rewritten. A checkpoint loaded from elsewhere or
        re-sharded to this world size is saved into this run (that is a new file, not a rewrite)."""
        r = self.resumed_from
        own = r and r["world_size"] == self.comm.size and os.path.realpath(os.path.dirname(r["path"])) == \
            os.path.realpath(self.checkpointer.base)
        if own:
            if self.comm.is_main:
                print(f"nothing to train: {r['path']} is at step {r['step']} of {self.total_steps}", flush=True)
            return r["path"]
        return self.save_checkpoint(self.start_step)

    def maybe_evaluate(self, step: int, final: bool, bar=None, metrics=None) -> Optional[Dict[str, Any]]:
        """The evaluator decides and averages the buffers (every rank); rank 0 logs its records."""
        records = self.evaluator.maybe_run(step, final, self.backbone)
        if records is None:
            return None
        if metrics:
            for rec in records.values():
                metrics.write({"eval": rec, "step": step})
        if bar is not None:
            bar.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in self.evaluator.summary(records).items()))
        return records

    # --- checkpoints ----------------------------------------------------------------------------------
    def training_state(self) -> ckpt.TrainingState:
        """What a checkpoint saves and restores, passed explicitly to ``checkpoint.py``."""
        return ckpt.TrainingState(
            backbone=self.backbone, backbone_opt=self.backbone_opt, head=self.classifier,
            head_opt=self.classifier_opt, label_slice=(self.label_slice.start, self.label_slice.end),
            slices=[(s.start, s.end) for s in self.all_slices], rank=self.comm.rank, world_size=self.comm.size,
            model_args=self.model_args, replicated=self.cfg.head.mode == "replicated",
            counters={"loss_scale": dict(vars(self.loss_scale)), "skipped_steps": self.skipped_steps,
                      "consecutive_skips": self.consecutive_skips,
                      "classifier_skipped_steps": self.classifier_skipped_steps})

    def save_checkpoint(self, step: int) -> str:
        """Write the checkpoint of ``step`` (a collective: every rank calls it at the same step)."""
        return self.checkpointer.save(step, self.training_state(), self.total_steps)

    def _resume(self) -> None:
        """Find the checkpoint named by checkpoint.resume ('auto': the run's latest, if any), agree on it
        across ranks, and load it. Each stage is agreed, so a rank's error stops every rank."""
        cfg, comm = self.cfg, self.comm
        error, path = None, None
        try:
            path = ckpt.find_resume(cfg.out) if cfg.checkpoint.resume == "auto" \
                else ckpt.resolve_checkpoint(cfg.checkpoint.resume)
        except Exception as e:
            error = f"cannot resume from {cfg.checkpoint.resume} (run {cfg.out}): {type(e).__name__}: {e}"
        comm.agree(error, name="resume.find")
        path = ckpt.agree_on_resume(comm, path)
        error = None
        try:
            if path:
                self._load(path)
        except Exception as e:
            error = f"cannot resume from {path}: {type(e).__name__}: {e}"
        comm.agree(error, name="resume")

    def _load(self, path: str) -> None:
        """Check that ``path`` continues this run (shard set, config), then restore it (``checkpoint.load``)."""
        meta = ckpt.read_meta(path)
        self._check_data(meta)
        diffs = [d for d in diff_configs(saved_config(meta["config"], meta["world_size"]), self.cfg.to_dict())
                 if not any(d.startswith(k + ".") or d.startswith(k + ":") for k in RESUME_FREE_KEYS)]
        extended = [d for d in diffs if any(d.startswith(k + ":") for k in RESUME_EXTEND_KEYS)]
        diffs = [d for d in diffs if d not in extended]
        if extended and self.comm.is_main:
            print(f"resume: {'; '.join(extended)}: the run is extended, its lr schedule recomputed", flush=True)
        if diffs:
            raise ValueError("incompatible config (field: checkpoint != now): " + "; ".join(diffs))
        state = self.training_state()
        meta = ckpt.load(path, state)
        c = state.counters
        self.loss_scale.__dict__.update(c["loss_scale"])
        self.skipped_steps, self.consecutive_skips = c["skipped_steps"], c.get("consecutive_skips", 0)
        self.classifier_skipped_steps = c.get("classifier_skipped_steps", 0)
        if not meta["rng_restored"]:  # another world size: streams cannot be mapped, re-seed them
            torch.manual_seed(derive_seed(self.cfg.train.seed, self.comm.rank, meta["step"], RESHARD_RESEED))
        self.start_step = meta["step"]
        self.resumed_from = {"path": path, "step": meta["step"], "world_size": meta["world_size"]}

    def _check_data(self, meta: dict) -> None:
        """Resume continues on the data the checkpoint trained on: the same `data_digest` (what the shard set
        holds; where it was built from may differ). Checkpoints written before it was recorded are compared
        by their manifest's bytes. Other samples on the same classes and shard label ranges are allowed with
        ``checkpoint.allow_other_data`` (cleaned or re-augmented data); other classes or ranges never are:
        a rank's classifier rows would then belong to other classes."""
        key = "data_sha256" if "data_sha256" in meta else "manifest_sha256"
        now = self.data_sha256 if key == "data_sha256" else self.manifest_sha256
        if meta[key] == now:
            return
        what = f"the shard set differs from the checkpoint's ({key.split('_')[0]} sha256 {meta[key][:12]} != {now[:12]})"
        slices = [[s.start, s.end] for s in self.manifest.shard_slices()]
        if meta["num_classes"] != self.manifest.num_classes or meta["shard_slices"] != slices:
            raise ValueError(f"{what}, and so do its classes or shards' label ranges (classes "
                             f"{meta['num_classes']} != {self.manifest.num_classes}, {len(meta['shard_slices'])} "
                             f"!= {len(slices)} shards): the classifiers' rows would name other classes")
        if not self.cfg.checkpoint.allow_other_data:
            raise ValueError(f"{what}; its classes and shards' label ranges are the same: to go on with "
                             "other samples, resume with checkpoint.allow_other_data=true")
        if self.comm.is_main:
            print(f"resume: {what}: going on with these samples (checkpoint.allow_other_data)", flush=True)


def _all_slices(manifest, world_size: int):
    from .partition import group_slices
    return group_slices(manifest.shard_slices(), world_size)
