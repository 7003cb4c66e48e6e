"""Evaluation during training cannot cost a checkpoint: the step's checkpoint comes
first, the BatchNorm buffers are averaged once a step for both, and an evaluation that fails on rank 0 is
agreed, recorded in eval.jsonl and survived (``eval.on_error=log``) or ends the run after a checkpoint
(``stop``). In this process, on the simulator's virtual ranks; the failure is a monkeypatched
``Evaluator.run`` (what a GPU out of memory or `metrics.check_scores` refusing non-finite scores raise)."""
import contextlib
import io
import json
import os
import random

import numpy as np
import pytest
import torch

import pins
from conftest import build_shards, make_image_npz, read_json_lines, simulate_here
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.engine.base import CommBase
from hvd_partialfc.run_files import list_checkpoints, resolve_checkpoint
from hvd_partialfc.verification.evaluator import EvaluationError, Evaluator
from data_tools.pair_sets import write_pairs_h5

# resnet (BatchNorm) of width 4 on 32x32 images; an evaluation and a checkpoint every 2 steps
RUN = ["model.name=resnet", "model.kwargs={width: 4}", "data.batch_size=4", "train.log_every=2", "train.threads=1",
       "head.negatives_every=0", "eval.every=2", "eval.batch_size=16"]
NAN_SCORES = "3 scores are not finite (NaN/inf embeddings?)"       # metrics.check_scores' own words


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """12 classes x 8 images in 3 shards (3 ranks: a world size that is not a power of two), a pair set."""
    d = tmp_path_factory.mktemp("evalerr")
    shards = build_shards(make_image_npz(d / "i.npz", 12, 8), d / "shards", 3)
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 4)
    pairs = rng.integers(0, 40, (20, 2))
    pairs[::2, 1] = pairs[::2, 0] // 4 * 4 + (pairs[::2, 0] + 1) % 4
    images = rng.integers(0, 256, (40, 32, 32), dtype=np.uint8)
    write_pairs_h5(str(d / "p.h5"), images, pairs, labels[pairs[:, 0]] == labels[pairs[:, 1]], labels)
    return {"shards": shards, "pairs": str(d / "p.h5")}


def _cfg(data, out, steps, *sets):
    return load_config(None, RUN + [f"data.shards={data['shards']}", f"out={out}", f"train.steps={steps}",
                                    f"eval.pairs=[{data['pairs']}]"] + list(sets))


def _failing_at(monkeypatch, steps):
    """Evaluator.run raises at ``steps`` (rank 0 alone runs it), evaluates as usual otherwise."""
    real = Evaluator.run

    def run(self, step, backbone):
        if step in steps:
            raise ValueError(NAN_SCORES)
        return real(self, step, backbone)
    monkeypatch.setattr(Evaluator, "run", run)


def test_buffers_averaged_once_a_step_and_the_checkpoint_first(data, tmp_path, monkeypatch):
    """3 ranks, a checkpoint and an evaluation at steps 2 and 4: one averaging per step (there were two,
    ``eval.N`` then ``ckpt.N``), before the checkpoint, which comes before the evaluation; the buffers saved
    are the ones the run went on with, so a resume from step 2 ends bitwise where the uninterrupted run does
    (a second averaging after the checkpoint breaks that at 3 ranks)."""
    calls = []
    real_avg, real_run = CommBase.average_buffers, Evaluator.run

    def average(self, module, name):
        calls.append((self.rank, "avg " + name))
        return real_avg(self, module, name)

    def evaluate(self, step, backbone):
        calls.append((0, f"eval {step}"))
        assert f"step-{step:08d}" in list_checkpoints(self.out_dir)          # the step's checkpoint is in
        return real_run(self, step, backbone)
    monkeypatch.setattr(CommBase, "average_buffers", average)
    monkeypatch.setattr(Evaluator, "run", evaluate)
    full = str(tmp_path / "full")
    simulate_here(_cfg(data, full, 4, "checkpoint.every=2", "checkpoint.keep=3"), 3)
    assert [c for r, c in calls if r == 0] == ["avg ckpt.2", "eval 2", "avg ckpt.4", "eval 4"]
    assert sorted(c for r, c in calls if r > 0) == ["avg ckpt.2"] * 2 + ["avg ckpt.4"] * 2
    assert [e["step"] for e in read_json_lines(os.path.join(full, "eval.jsonl"))] == [2, 4]
    resumed = str(tmp_path / "resumed")
    simulate_here(_cfg(data, resumed, 4, "checkpoint.every=2",
                       f"checkpoint.resume={os.path.join(full, 'checkpoints', 'step-00000002')}"), 3)
    assert pins.checkpoint_digests(resolve_checkpoint(resumed)) == pins.checkpoint_digests(resolve_checkpoint(full))


def _cli_simulate(argv):
    """``hvd-partialfc simulate ARGV`` in this process: (exit code, printed text); the torch threads and
    random streams put back after (as conftest.simulate_here does)."""
    from hvd_partialfc.cli import main
    threads, rngs = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["simulate"] + argv)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rngs[0]), np.random.set_state(rngs[1]), random.setstate(rngs[2])
    return rc, out.getvalue(), err.getvalue()


def test_failed_final_evaluation_is_logged_and_the_run_ends_well(data, tmp_path, monkeypatch):
    """on_error=log (the default): the final evaluation raises on rank 0; the final checkpoint is written,
    eval.jsonl records the error with its reason, the run exits 0 and its last line says so. Before, the
    exception ended the run (exit 1) before the final checkpoint."""
    _failing_at(monkeypatch, {4})
    out = str(tmp_path / "run")
    argv = ["--ranks", "2", "--shards", data["shards"], "--out", out, "--steps", "4"]
    for s in RUN + [f"eval.pairs=[{data['pairs']}]", "checkpoint.every=0"]:
        argv += ["--set", s]
    rc, printed, err = _cli_simulate(argv)
    assert rc == 0, err[-3000:]
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"done: {os.path.join(out, 'checkpoints', 'step-00000004')}; but the final evaluation "
                           f"at step 4 failed: ValueError: {NAN_SCORES}"), last
    assert list_checkpoints(out) == ["step-00000004"]
    recs = read_json_lines(os.path.join(out, "eval.jsonl"))
    assert [r["step"] for r in recs] == [2, 4] and recs[0]["set"] == "p" and "error" not in recs[0]
    assert recs[1]["error"] == f"ValueError: {NAN_SCORES}" and recs[1]["sets"] == ["p"]
    from hvd_partialfc.tools.report import plot_curves        # the demo's report skips the error record
    assert plot_curves(out, str(tmp_path / "curves.png")) == str(tmp_path / "curves.png")
    said = err + printed
    assert "step 4: evaluation at step 4 failed" in said and "training goes on (eval.on_error=log)" in said


def test_failed_evaluation_with_stop_ends_the_run_after_a_checkpoint(data, tmp_path, monkeypatch):
    """on_error=stop: the evaluation of step 2 (no checkpoint due there) fails; every rank stops with the
    agreed EvaluationError, after a checkpoint of step 2. A bad value is one ConfigError line."""
    from hvd_partialfc.run.simulate import SimFailure
    _failing_at(monkeypatch, {2})
    out = str(tmp_path / "run")
    with pytest.raises(SimFailure) as failed:
        simulate_here(_cfg(data, out, 6, "checkpoint.every=0", "eval.on_error=stop"), 2)
    assert isinstance(failed.value.error, EvaluationError), failed.value
    assert f"evaluation at step 2 failed: ValueError: {NAN_SCORES}; checkpoint " in str(failed.value.error)
    assert list_checkpoints(out) == ["step-00000002"]
    assert json.load(open(os.path.join(out, "checkpoints", "step-00000002", "meta.json")))["step"] == 2
    assert [r.get("error") for r in read_json_lines(os.path.join(out, "eval.jsonl"))] == [f"ValueError: {NAN_SCORES}"]
    with pytest.raises(ConfigError, match="eval.on_error='maybe': expected one of log, stop"):
        load_config(None, [f"data.shards={data['shards']}", "eval.on_error=maybe"])
