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

import json
import math
import os
import time
from contextlib import nullcontext
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from tqdm import tqdm

from . import comm as comm_lib
from . import faults
from .checkpoint import (Checkpointer, classifier_file, gather_classifier_rows, read_meta, resolve_checkpoint,
                         rng_state, set_rng_state)
from .config import Config, diff_configs, dump_config
from .data import RankShardDataset, make_loader, prepare_batch
from . import modes
from .models import create_model
from .shards import manifest_digest, read_manifest

# Config keys that may change between a checkpoint and its resume (they do not change the numbers).
RESUME_FREE_KEYS = ("out", "checkpoint", "train.log_every", "train.threads", "train.device", "data.workers",
                    "data.verify_sha256", "data.shards", "eval.batch_size")
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


def make_optimizer(params, name: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
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


class LossScale:
    """Dynamic loss scale for fp16 (a no-op otherwise). Its decisions use the *averaged* backbone gradient
    norm, which is identical on every rank, so the scale stays identical everywhere without a collective."""

    def __init__(self, enabled: bool, init: float = 2.0 ** 16, growth_interval: int = 1000):
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
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))
        error = None
        try:
            self._build()
        except Exception as e:  # reported with the rank, agreed below
            error = f"{type(e).__name__}: {e}"
        comm.agree(error, name="setup")
        self.start_step, self.resumed_from = 0, None
        if cfg.checkpoint.resume:
            self._resume()
        # Identical starts: rank 0's backbone (parameters and buffers) everywhere, then verified.
        comm.broadcast_module(self.backbone, name="backbone.init")
        comm.check_identical(self.backbone, name="start")
        steps_per_epoch = self.local_batches_per_epoch // cfg.optim.backward_passes_per_step
        min_spe = int(comm.allreduce_scalar(steps_per_epoch, "min", name="steps_per_epoch"))
        self.total_steps = cfg.train.steps or max(1, int(cfg.train.epochs * min_spe))
        self.loader, _ = make_loader(self.dataset, cfg.data.batch_size, cfg.train.seed, cfg.data.workers,
                                     start=self.start_step * cfg.optim.backward_passes_per_step,
                                     pin_memory=self.device.type == "cuda")
        self.checkpointer = Checkpointer(cfg.out, cfg.checkpoint.every, cfg.checkpoint.keep, comm)

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
        self.dataset = RankShardDataset(cfg.data.shards, comm.rank, comm.size, self.manifest)
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
        # Verification during training runs on rank 0 only; its pair sets are read (and checked) here, so
        # a bad path fails before training, agreed like every other setup error.
        self.evaluator = None
        if cfg.eval.pairs and comm.is_main:
            from .evaluate import Evaluator, check_input_shape
            self.evaluator = Evaluator.from_config(cfg.eval, cfg.out)
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
            self.classifier_opt = make_optimizer([modes.classifier_group(cfg.head.mode, self.classifier, o)],
                                                 o.name, o.classifier_lr, o.classifier_momentum,
                                                 o.classifier_weight_decay)
        self.backbone_opt = comm.distributed_optimizer(
            backbone_opt, averaged, fp16_compression=o.fp16_compression,
            backward_passes_per_step=o.backward_passes_per_step)
        self.loss_scale = LossScale(cfg.train.precision == "fp16")
        self.skipped_steps = 0
        # `local` mode's loss is the mean over this rank's batch, so its classifier's gradient is N times
        # the one np=1 (or `global` mode, whose loss is the mean over the gathered batch) computes for the
        # same rows; "global" divides it back (`replicated` already averages it with the backbone's).
        self.classifier_grad_scale = (1.0 / comm.size if cfg.head.mode == "local"
                                      and o.classifier_grad_mean == "global" else 1.0)

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
        self.backbone_opt.synchronize()          # backbone grads are now the mean over ranks
        bb_params = [p for p in self.backbone.parameters() if p.grad is not None]
        cls_params = [p for p in self.classifier.parameters() if p.grad is not None]
        if self.loss_scale.enabled:
            for p in bb_params:
                p.grad.div_(self.loss_scale.scale)
        if self.loss_scale.enabled or self.classifier_grad_scale != 1.0:
            for p in cls_params:
                p.grad.mul_(self.classifier_grad_scale / self.loss_scale.scale)
        norm_t = torch.nn.utils.get_total_norm([p.grad for p in bb_params])  # identical on all ranks
        grad_norm = float(norm_t)
        finite = math.isfinite(grad_norm)
        self.loss_scale.update(finite)
        if finite:
            if self.cfg.optim.clip_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(bb_params, self.cfg.optim.clip_grad_norm, norm_t)
            comm_lib.step_synchronized(self.backbone_opt)
            cls_norm = float(torch.nn.utils.get_total_norm([p.grad for p in cls_params]))
            if math.isfinite(cls_norm):  # local decision: the classifier is local
                self.classifier_opt.step()
        elif self.loss_scale.enabled or self.cfg.train.on_nonfinite == "skip":
            self.skipped_steps += 1      # every rank skips: the averaged norm is the same everywhere
        else:
            raise NonFiniteError(f"rank {self.comm.rank}: non-finite backbone gradient at step {step} "
                                 f"(local loss {loss_sum}); set train.on_nonfinite=skip to skip such steps")
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr_factor": lr_f,
                "data_time": data_time, "step_time": time.perf_counter() - t0}

    # --- the loop -----------------------------------------------------------------------------------
    def fit(self) -> str:
        cfg, comm = self.cfg, self.comm
        if comm.is_main:
            os.makedirs(cfg.out, exist_ok=True)
            dump_config(cfg, os.path.join(cfg.out, "config.yaml"))
        metrics = open(os.path.join(cfg.out, "metrics.jsonl"), "a") if comm.is_main else None
        samples_per_step = cfg.data.batch_size * cfg.optim.backward_passes_per_step * comm.size
        bar = tqdm(total=self.total_steps, initial=self.start_step, disable=not comm.is_main,
                   dynamic_ncols=True, desc=f"train np={comm.size}")
        if comm.is_main and comm.size > 1 and hasattr(self.classifier, "describe"):
            bar.write(self.classifier.describe(comm_lib.gradient_bytes(self.backbone.parameters(),
                                                                       cfg.optim.fp16_compression)))
        if self.resumed_from and comm.is_main:
            r = self.resumed_from
            bar.write(f"resumed from {r['path']} at step {r['step']} (written by {r['world_size']} ranks)")
        batches = iter(self.loader)
        last_log, last_t = self.start_step, time.perf_counter()
        ckpt_dir = None
        try:
            for step in range(self.start_step, self.total_steps):
                faults.before_step(step, comm.rank)
                out = self.train_step(step, batches)
                done = step + 1
                if done % cfg.train.log_every == 0 or done == self.total_steps:
                    mean_loss = comm.allreduce_scalar(out["loss"], "average", name="log.loss")
                    now = time.perf_counter()
                    sps = samples_per_step * (done - last_log) / max(now - last_t, 1e-9)
                    last_log, last_t = done, now
                    if metrics:
                        rec = {"step": done, "loss": mean_loss, "rank0_loss": out["loss"],
                               "lr": cfg.optim.backbone_lr * out["lr_factor"], "grad_norm": out["grad_norm"],
                               "samples_per_s": sps, "skipped_steps": self.skipped_steps, "time": time.time()}
                        metrics.write(json.dumps(rec) + "\n")
                        metrics.flush()
                    bar.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{cfg.optim.backbone_lr * out['lr_factor']:.4g}",
                                    sps=f"{sps:.0f}")
                bar.update(1)
                self.maybe_evaluate(done, final=done == self.total_steps, bar=bar, metrics=metrics)
                ckpt_dir = self.checkpointer.maybe_save(done, self, final=done == self.total_steps) or ckpt_dir
        finally:
            bar.close()
            if metrics:
                metrics.close()
        if ckpt_dir is None:  # resumed at the end already: nothing left to train
            ckpt_dir = self.checkpointer.save(self.total_steps, self)
        return ckpt_dir

    def eval_due(self, step: int, final: bool) -> bool:
        """The same answer on every rank (it depends on the config only): evaluation needs a collective."""
        e = self.cfg.eval
        return bool(e.pairs) and (final or (e.every > 0 and step % e.every == 0))

    def maybe_evaluate(self, step: int, final: bool, bar=None, metrics=None) -> Optional[Dict[str, Any]]:
        """Average BatchNorm buffers on all ranks (collective), then verify on rank 0."""
        if not self.eval_due(step, final):
            return None
        self.comm.average_buffers(self.backbone, name=f"eval.{step}")
        if self.evaluator is None:
            return None
        records = self.evaluator.run(step, self.backbone)
        if metrics:
            for rec in records.values():
                metrics.write(json.dumps({"eval": rec, "step": step}) + "\n")
            metrics.flush()
        if bar is not None:
            bar.write(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in self.evaluator.summary(records).items()))
        return records

    # --- checkpoint contents --------------------------------------------------------------------------
    def backbone_state(self) -> Dict[str, Any]:
        return {"format": "hvd_partialfc.backbone", "model": self.model_args,
                "state_dict": {k: v.detach().cpu() for k, v in self.backbone.state_dict().items()},
                "optimizer": self.backbone_opt.state_dict()}

    def rank_state(self, digest: str) -> Dict[str, Any]:
        return {"rank": self.comm.rank, "world_size": self.comm.size,
                "label_start": self.label_slice.start, "label_end": self.label_slice.end,
                "weight": self.classifier.weight.detach().cpu(), "optimizer": self.classifier_opt.state_dict(),
                "rng": rng_state(), "loss_scale": vars(self.loss_scale), "skipped_steps": self.skipped_steps,
                "backbone_digest": digest, "head_state": self.classifier.extra_state_for_checkpoint()}

    def checkpoint_meta(self, step: int) -> Dict[str, Any]:
        return {"format": "hvd_partialfc.checkpoint", "step": step, "total_steps": self.total_steps,
                "world_size": self.comm.size, "num_classes": self.manifest.num_classes,
                "slices": [[s.start, s.end] for s in _all_slices(self.manifest, self.comm.size)],
                "shard_slices": [[s.start, s.end] for s in self.manifest.shard_slices()],
                "loss_scale": vars(self.loss_scale), "skipped_steps": self.skipped_steps,
                "classifier_files": [classifier_file(r, self.comm.size) for r in range(self.comm.size)],
                "model": self.model_args, "embedding_dim": self.cfg.model.embedding_dim,
                "manifest_sha256": self.manifest_sha256, "config": self.cfg.to_dict()}

    def _resume(self) -> None:
        """Load the checkpoint named by checkpoint.resume ('auto': the run's latest, if any)."""
        cfg, comm = self.cfg, self.comm
        error, path = None, None
        try:
            if cfg.checkpoint.resume == "auto":
                try:
                    path = resolve_checkpoint(cfg.out)
                except FileNotFoundError:
                    path = None
            else:
                path = resolve_checkpoint(cfg.checkpoint.resume)
            if path:
                self._load(path)
        except Exception as e:
            error = f"cannot resume from {path or cfg.checkpoint.resume}: {type(e).__name__}: {e}"
        comm.agree(error, name="resume")

    def _load(self, path: str) -> None:
        """Restore the backbone, this rank's classifier rows, optimizer states, RNG and loss scale.

        Same world size: each rank reads its own file (bitwise resume). Another world size (re-sharding,
        when the shard count allows it): each rank cuts its new slice's rows and their optimizer state
        out of the old files; RNG streams cannot be mapped and are re-seeded from (seed, rank, step).
        """
        meta = read_meta(path)
        if meta["manifest_sha256"] != self.manifest_sha256:
            raise ValueError("the shard set differs from the checkpoint's (manifest sha256 "
                             f"{meta['manifest_sha256'][:12]} != {self.manifest_sha256[:12]})")
        diffs = [d for d in diff_configs(meta["config"], self.cfg.to_dict())
                 if not any(d.startswith(k + ".") or d.startswith(k + ":") for k in RESUME_FREE_KEYS)]
        extended = [d for d in diffs if any(d.startswith(k + ":") for k in RESUME_EXTEND_KEYS)]
        diffs = [d for d in diffs if d not in extended]
        if extended and self.comm.is_main:
            print(f"resume: {'; '.join(extended)}: the run is extended, its lr schedule recomputed", flush=True)
        if diffs:
            raise ValueError("incompatible config (field: checkpoint != now): " + "; ".join(diffs))
        if len(set(meta["digests"])) != 1:
            raise ValueError("the checkpoint's backbones differ across ranks; there is no single state to resume")
        bb = torch.load(os.path.join(path, "backbone.pt"), map_location="cpu", weights_only=False)
        self.backbone.load_state_dict(bb["state_dict"])
        self.backbone_opt.load_state_dict(bb["optimizer"])
        start, end = self.label_slice.start, self.label_slice.end
        if meta["world_size"] == self.comm.size:
            mine = torch.load(os.path.join(path, classifier_file(self.comm.rank, self.comm.size)),
                              map_location="cpu", weights_only=False)
            if (mine["label_start"], mine["label_end"]) != (start, end):
                raise ValueError(f"classifier file covers [{mine['label_start']}, {mine['label_end']}), "
                                 f"this rank owns [{start}, {end})")
        elif self.cfg.head.mode == "replicated":
            # every rank's file holds the same full C x D matrix (its momentum lives in backbone.pt)
            mine = torch.load(os.path.join(path, meta["classifier_files"][0]), map_location="cpu", weights_only=False)
            mine.update({"rng": None, "label_start": start, "label_end": end})
        else:
            mine = gather_classifier_rows(path, meta, start, end)
            mine["rng"] = None
        with torch.no_grad():
            self.classifier.weight.copy_(mine["weight"])
        self.classifier_opt.load_state_dict(mine["optimizer"])
        if meta["world_size"] == self.comm.size:  # other ranks' centres mean nothing at another world size
            self.classifier.load_extra_state(mine.get("head_state") or {})
        if mine.get("rng") is not None:
            set_rng_state(mine["rng"])
        else:
            torch.manual_seed((self.cfg.train.seed * 1_000_003 + self.comm.rank) * 10_007 + meta["step"])
        self.loss_scale.__dict__.update(meta["loss_scale"])
        self.skipped_steps = meta["skipped_steps"]
        self.start_step = meta["step"]
        self.resumed_from = {"path": path, "step": meta["step"], "world_size": meta["world_size"]}


def _all_slices(manifest, world_size: int):
    from .partition import group_slices
    return group_slices(manifest.shard_slices(), world_size)
