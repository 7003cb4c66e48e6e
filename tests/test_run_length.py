"""A run keeps its length and its learning-rate schedule at any world size (run/progress.py).

The length of a run is the samples it consumes: an epoch-based run resumed at another world size ends when its
epochs of samples are consumed, and the schedule goes on from the fraction consumed. Checked against an
independent computation from the samples (not from the code's steps): each logged lr against the cosine
of the fraction of the budget consumed, the final samples against the budget. Runs in this process through
the simulator (virtual ranks; startup and the loop are the real ones), 4 feature shards, an MLP.

Before run/progress.py, both failed: shrunk 4 -> 2 at 50% the run went on for 90 more steps of 16 samples
(2,400 of a 1,920-sample budget) with its lr back at 25% of the cosine; grown 2 -> 4 at 60% it said
"nothing to train" after 60% of its samples.
"""
from __future__ import annotations

import json
import math
import os

import pytest

from conftest import build_shards, make_feature_npz, simulate_here
from hvd_partialfc.run.progress import RunLength, Segment, legacy_record, plan

SETS = ["model.name=mlp", "model.embedding_dim=8", "model.kwargs={hidden_dim: 8}", "data.batch_size=8",
        "train.log_every=1", "train.threads=1", "data.workers=0", "head.negatives_every=0",
        "optim.warmup_steps=0", "optim.schedule=cosine", "optim.min_lr_ratio=0.0", "checkpoint.keep=10"]
# 40 classes x 24 samples on 4 shards: 240 samples a rank at 4 ranks (30 batches of 8), 480 at 2 (60)


@pytest.fixture(scope="module")
def shards4(tmp_path_factory):
    d = tmp_path_factory.mktemp("len")
    return build_shards(make_feature_npz(d / "f.npz", [24] * 40, dim=8), d / "shards", 4)


def _run(shards, out, ranks, *sets, fault=None):
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, SETS + list(sets), {"data": {"shards": shards}, "out": str(out)})
    if fault:
        os.environ["HVD_PARTIALFC_FAULT"] = fault
    try:
        return simulate_here(cfg, ranks)
    finally:
        os.environ.pop("HVD_PARTIALFC_FAULT", None)


def _interrupted(shards, out, ranks, at, *sets):
    """Train at ``ranks`` until the checkpoint of step ``at`` (an injected error right after it)."""
    from hvd_partialfc.run.simulate import SimFailure
    with pytest.raises(SimFailure):
        _run(shards, out, ranks, f"checkpoint.every={at}", *sets, fault=f"raise@{at}")


def _meta(run):
    base = os.path.join(run, "checkpoints")
    with open(os.path.join(base, open(os.path.join(base, "latest")).read().strip(), "meta.json")) as f:
        return json.load(f)


def _lrs(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}


def _cosine(fraction, peak):
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, fraction)))


def _check_by_samples(run, budget, per_step):
    """Every logged lr (the lr of step s, logged at s + 1 done) is the cosine of the samples consumed before
    the step over the budget; ``per_step``: [(first step, last step, samples a step)] of the run's segments."""
    from hvd_partialfc.config_io import load_config
    peak = load_config(None, SETS, {"data": {"shards": "unused"}}).optim.backbone_lr
    lrs, samples = _lrs(run), 0
    for first, last, g in per_step:
        for step in range(first, last):
            if step + 1 in lrs:
                assert lrs[step + 1] == pytest.approx(_cosine(samples / budget, peak), rel=1e-9, abs=1e-12), step
            samples += g
    return samples


def test_shrink_4_to_2_keeps_length_and_schedule(shards4, tmp_path):
    run = tmp_path / "run"
    _interrupted(shards4, run, 4, 30, "train.epochs=2", "train.steps=0")     # 2 epochs of 30 steps x 32
    _run(shards4, run, 2, "train.epochs=2", "train.steps=0", "checkpoint.resume=auto", "checkpoint.every=0")
    meta = _meta(run)
    assert meta["step"] == 90 and meta["total_steps"] == 90                  # 30 at 4 ranks, 60 at 2
    assert meta["length"]["samples"] == meta["length"]["budget_samples"] == 1920
    assert [s["world_size"] for s in meta["length"]["segments"]] == [4, 2]
    assert _check_by_samples(run, 1920, [(0, 30, 32), (30, 90, 16)]) == 1920


def test_grow_2_to_4_trains_to_the_end(shards4, tmp_path):
    run = tmp_path / "run"
    _interrupted(shards4, run, 2, 72, "train.epochs=2", "train.steps=0")     # 60% of 120 steps x 16
    _run(shards4, run, 4, "train.epochs=2", "train.steps=0", "checkpoint.resume=auto", "checkpoint.every=0")
    meta = _meta(run)
    assert meta["step"] == 72 + 24 and meta["length"]["samples"] == 1920      # 768 samples left, 32 a step
    assert _check_by_samples(run, 1920, [(0, 72, 16), (72, 96, 32)]) == 1920


def test_explicit_steps_count_steps_of_the_first_world_size(shards4, tmp_path):
    """``train.steps``: steps of the world size the run started at (its budget in samples); documented."""
    run = tmp_path / "run"
    _interrupted(shards4, run, 4, 10, "train.steps=40")                      # 40 x 32 = 1280 samples
    _run(shards4, run, 2, "train.steps=40", "checkpoint.resume=auto", "checkpoint.every=0")
    meta = _meta(run)
    assert meta["step"] == 10 + 60 and meta["length"]["samples"] == 1280
    assert _check_by_samples(run, 1280, [(0, 10, 32), (10, 70, 16)]) == 1280


def test_a_checkpoint_without_length_resumes_as_one_with_it(shards4, tmp_path):
    """A checkpoint from before ``length`` was recorded (removed from its meta.json) resumes at another world
    size to the same final state, bitwise, as the same checkpoint with it."""
    import shutil
    import pins
    a, b = tmp_path / "a", tmp_path / "b"
    _interrupted(shards4, a, 4, 12, "train.epochs=1", "train.steps=0")
    shutil.copytree(a, b)
    meta_path = os.path.join(b, "checkpoints", "step-00000012", "meta.json")
    meta = json.load(open(meta_path))
    assert legacy_record(meta, [240] * 4) == meta.pop("length")
    json.dump(meta, open(meta_path, "w"))
    for run in (a, b):
        _run(shards4, run, 2, "train.epochs=1", "train.steps=0", "checkpoint.resume=auto", "checkpoint.every=0")
    last = "checkpoints/step-00000048"                                        # 12 x 32 + 36 x 16 = 960
    assert pins.checkpoint_digests(str(a / last)) == pins.checkpoint_digests(str(b / last))


# --- the arithmetic, against hand-computed values --------------------------------------------------------

def test_loader_starts_at_the_runs_fraction_of_each_ranks_epoch():
    """Segment 1 opens at 960 samples of a 640-sample epoch (1.5 epochs): a rank with 60 batches an epoch
    starts at batch 90, one with 45 at 67 (floor of 67.5); the first segment draws from batch 0."""
    length = RunLength(1920, 32, 640, [Segment(0, 0, 4, 32), Segment(30, 960, 2, 16)])
    assert length.loader_start(30, 60, 1) == 90 and length.loader_start(30, 45, 1) == 67
    assert length.loader_start(35, 60, 2) == 100                              # then 2 batches a step
    assert RunLength(1920, 32, 640, [Segment(0, 0, 4, 32)]).loader_start(17, 30, 3) == 51


def test_position_and_total_are_the_steps_at_one_world_size():
    """At the first world size the schedule sees exactly (step, total): the same floats as before."""
    length = RunLength(7 * 48, 48, 3 * 48, [Segment(0, 0, 3, 48)])
    assert [length.position(s) for s in range(8)] == [float(s) for s in range(8)]
    assert length.schedule_total == 7.0 and length.total_steps == 7


def test_the_end_is_the_nearest_step_of_the_current_segment():
    """Budget 1000, 320 consumed at step 10, 96 a step now: 680 / 96 = 7.08 -> 7 steps (672; 8 left 768)."""
    length = RunLength(1000, 32, 320, [Segment(0, 0, 1, 32), Segment(10, 320, 3, 96)])
    assert length.total_steps == 17 and abs(length.samples_at(17) - 1000) <= 96 / 2


def test_plan_continues_the_segment_at_the_same_size_and_refuses_an_inconsistent_record():
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, SETS + ["train.steps=50"], {"data": {"shards": "unused"}})
    fresh = plan(cfg, 2, 30)
    rec = fresh.record(20)
    again = plan(cfg, 2, 30, 20, rec)
    assert len(again.segments) == 1 and again.total_steps == 50
    with pytest.raises(ValueError, match="inconsistent"):
        plan(cfg, 2, 30, 20, dict(rec, samples=rec["samples"] + 1))
    lines = []
    other = plan(cfg, 4, 15, 20, rec, log=lines.append)
    assert other.total_steps == 20 + 15 and "2 -> 4 ranks at step 20" in lines[0]
    per_rank = cfg.data.batch_size * cfg.optim.backward_passes_per_step
    assert lines[0].endswith(f"train.steps=50 counts steps of its first world size (2 ranks x {per_rank} samples: "
                             f"{2 * per_rank} a step)"), lines[0]
