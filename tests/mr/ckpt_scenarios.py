"""Checkpoint and step-decision scenarios run by tests/test_checkpoints.py (each an item of its two-rank launch)
under real ``horovodrun`` (or alone, as one rank). Each writes ``OUT/rank-<r>.json`` with what it observed.

    python ckpt_scenarios.py diverged   SHARDS OUT   # backbones differ at a save: aside, latest untouched
    python ckpt_scenarios.py skips      SHARDS OUT   # classifier skips counted; consecutive skips stop the run
    python ckpt_scenarios.py replicated SHARDS OUT   # replicated: the classifier's averaged grad is clipped
    python ckpt_scenarios.py nonfinite  SHARDS OUT   # a NaN on one rank: skip (nothing changes), stop (every rank)
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.engine.select import start_engine  # noqa: E402
from hvd_partialfc.run_files import CheckpointError  # noqa: E402
from hvd_partialfc.config_io import load_config  # noqa: E402
from hvd_partialfc.digest import state_dict_digest  # noqa: E402
from hvd_partialfc.run.startup import start_trainer  # noqa: E402
from hvd_partialfc.run.skips import NonFiniteError, SkippedStepsError  # noqa: E402

BASE = ["model.name=mlp", "data.batch_size=8", "optim.schedule=constant", "head.negatives_every=0",
        "train.log_every=1"]


def _write(out, comm, rec):
    with open(os.path.join(out, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(rec, f)


def scenario_diverged(shards, out):
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}/run", "train.steps=10", "checkpoint.keep=1",
                             *BASE])
    comm = start_engine("auto", os.environ, "cpu")   # Horovod under horovodrun; alone: Horovod, else torch
    trainer = start_trainer(cfg, comm)
    batches = iter(trainer.loader)
    for step in range(2):
        trainer.train_step(step, batches)
    good = trainer.save_checkpoint(2)
    if comm.rank == 1:  # a rank whose backbone drifted (a bad GPU, a non-deterministic kernel)
        with torch.no_grad():
            next(trainer.parts.backbone.parameters()).add_(1e-3)
    rec = {"good": os.path.basename(good)}
    try:
        trainer.save_checkpoint(3)
        rec["raised"] = None
    except CheckpointError as e:
        rec["raised"] = str(e)
    _write(out, comm, rec)


def scenario_skips(shards, out):
    """Rank 1's classifier gradient is NaN at steps 1 and 2 (counted, training goes on); then every
    rank's loss is NaN from step 5 on (skipped: train.on_nonfinite=skip, the same counter as fp16's loss-scale
    back-offs) until the limit stops every rank."""
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}/run", "train.steps=40", "train.on_nonfinite=skip",
                             "train.max_consecutive_skips=3", *BASE])
    comm = start_engine("auto", os.environ, "cpu")   # Horovod under horovodrun; alone: Horovod, else torch
    trainer = start_trainer(cfg, comm)
    state = {"step": 0}
    if comm.rank == 1:
        trainer.parts.head.weight.register_hook(
            lambda g: torch.full_like(g, float("nan")) if state["step"] in (1, 2) else g)
    real_step = trainer.train_step

    def step_fn(step, batches):
        state["step"] = step
        if step >= 5:  # a NaN in every rank's features from here on
            x, y = next(batches)
            x = x.clone()
            x[0, 0] = float("nan")
            return real_step(step, iter([(x, y)]))
        return real_step(step, batches)

    trainer.train_step = step_fn
    rec = {}
    try:
        trainer.fit()
        rec["raised"] = None
    except SkippedStepsError as e:
        rec["raised"] = str(e)
    rec.update({"skipped_steps": trainer.parts.counters.skipped_steps, "classifier_skipped_steps": trainer.parts.counters.classifier_skipped_steps,
                "loss_scale": trainer.parts.loss_scale.scale, "stopped_at": state["step"]})
    _write(out, comm, rec)


def scenario_replicated(shards, out):
    """One SGD step (no momentum, no weight decay) with a tiny clip norm: the whole averaged update
    (backbone and the replicated classifier) has norm lr x clip."""
    clip, lr = 1e-3, 0.1
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}/run", "train.steps=1", "head.mode=replicated",
                             f"optim.clip_grad_norm={clip}", f"optim.backbone_lr={lr}", f"optim.classifier_lr={lr}",
                             "optim.backbone_momentum=0", "optim.classifier_momentum=0",
                             "optim.backbone_weight_decay=0", "optim.classifier_weight_decay=0", *BASE])
    comm = start_engine("auto", os.environ, "cpu")   # Horovod under horovodrun; alone: Horovod, else torch
    trainer = start_trainer(cfg, comm)
    before = [p.detach().clone() for p in trainer.parts.backbone_opt_params()]
    cls_before = trainer.parts.head.weight.detach().clone()
    trainer.train_step(0, iter(trainer.loader))
    sq = sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(trainer.parts.backbone_opt_params(), before))
    _write(out, comm, {"update_norm": sq ** 0.5, "expected": lr * clip,
                       "classifier_update_norm": float((trainer.parts.head.weight.detach() - cls_before).norm())})


def scenario_nonfinite(shards, out):
    """Two trainers in one launch. ``skip`` (train.on_nonfinite=skip): a NaN sample on rank 1 at step 2;
    the parameters' digests after each of 5 steps. ``stop`` (the default): a NaN sample on rank 1 at step 0;
    what each rank raised and how long after the step began."""
    comm = start_engine("auto", os.environ, "cpu")   # Horovod under horovodrun; alone: Horovod, else torch
    digest = lambda module: state_dict_digest(dict(module.named_parameters()))  # noqa: E731
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}/skip", "train.steps=5", "data.batch_size=8",
                             "model.name=mlp", "train.on_nonfinite=skip", "optim.schedule=constant"])
    trainer = start_trainer(cfg, comm)
    batches = iter(trainer.loader)
    rec = {"rank": comm.rank, "backbone": [], "classifier": []}
    for step in range(5):
        batch = next(batches)
        if step == 2 and comm.rank == 1:
            batch[0][0, 0] = float("nan")  # one bad sample on one rank only
        trainer.train_step(step, iter([batch]))
        rec["backbone"].append(digest(trainer.parts.backbone))
        rec["classifier"].append(digest(trainer.parts.head))
    rec["skipped_steps"] = trainer.parts.counters.skipped_steps
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}/stop", "train.steps=5", "data.batch_size=8",
                             "model.name=mlp"])
    trainer = start_trainer(cfg, comm)
    batch = next(iter(trainer.loader))
    if comm.rank == 1:
        batch[0][0, 0] = float("nan")
    t0 = time.time()
    try:
        trainer.train_step(0, iter([batch]))
        rec["stop"] = None
    except NonFiniteError as e:
        rec["stop"] = f"{type(e).__name__}: {e}"
    rec["stop_seconds"] = time.time() - t0
    _write(out, comm, rec)


if __name__ == "__main__":
    name, shards, out = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    {"diverged": scenario_diverged, "skips": scenario_skips, "replicated": scenario_replicated,
     "nonfinite": scenario_nonfinite}[name](shards, out)
