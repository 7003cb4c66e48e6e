"""Re-sharding a sampled ``local`` run with the exact rule after a rank-local classifier skip:
the old ranks' ``lrs`` histories differ, and each rank's rows must be brought up with their own. Checked
against an offline float64 catch-up of every row written here from the rule's definition (not the package's
tables); the same-size resume stays bitwise against the uninterrupted run (no sweep at a save). In this
process under ``simulate`` (2 virtual ranks), seconds."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import build_shards, make_feature_npz, simulate_here

# 40 rows a rank, 10 scored a step (sample_rate 0.25): most rows lag; warm-up: every step its own lr
BASE = ["model.name=mlp", "model.embedding_dim=8", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
        "train.log_every=50", "data.workers=0", "head.negatives_every=0", "train.threads=1",
        "head.mode=local", "head.sample_rate=0.25", "head.sampled_step=exact", "optim.warmup_steps=4"]
SKIPPED = (1, 2)          # rank 0's classifier gradient is NaN before these steps: its classifier step is skipped


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    return build_shards(make_feature_npz(d / "f.npz", [4] * 80, dim=8, seed=7), d / "s2", 2)


@pytest.fixture
def rank0_skips(monkeypatch):
    """Every trainer ``simulate`` starts gets, on rank 0, a NaN classifier gradient at the steps SKIPPED."""
    from hvd_partialfc.run import simulate as sim_module
    real = sim_module.start_trainer

    def start(cfg, comm):
        trainer = real(cfg, comm)
        if comm.rank == 0:
            now, step_fn = {"step": -1}, trainer.train_step

            def train_step(step, batches):
                now["step"] = step
                return step_fn(step, batches)
            trainer.train_step = train_step
            trainer.parts.head.weight.register_hook(lambda g: g * float("nan") if now["step"] in SKIPPED else g)
        return trainer
    monkeypatch.setattr(sim_module, "start_trainer", start)


def _sim(ranks, shards, out, steps, *sets, fault=None):
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.run.watch.faults import ENV
    cfg = load_config(None, [*BASE, *sets, f"data.shards={shards}", f"out={out}", f"train.steps={steps}"])
    if fault:
        os.environ[ENV] = fault
    try:
        return simulate_here(cfg, ranks, 120)
    finally:
        os.environ.pop(ENV, None)


def _files(ckpt):
    from hvd_partialfc.run_files import load_file, read_meta
    meta = read_meta(ckpt)
    return meta, [load_file(os.path.join(ckpt, f), "classifier") for f in meta["classifier_files"]]


def _current(f):
    """(weight, momentum) of a classifier file with every row brought up to the file's last step, in
    float64: the exact rule's zero-gradient steps m <- mu m + wd w, w <- w - lr m, one at a time, over the
    lrs a row has not seen (``since_base`` counts the ones it has)."""
    st, group = f["optimizer"]["state"][0], f["optimizer"]["param_groups"][0]
    mu, wd = group["momentum"], group["weight_decay"]
    w, m = f["weight"].double().clone(), st["momentum_buffer"].double().clone()
    since = st["since_base"].long().tolist()
    for i, s in enumerate(since):
        for lr in st["lrs"][s:]:
            m[i] = mu * m[i] + wd * w[i]
            w[i] = w[i] - lr * m[i]
    return w, m


def test_rank_local_skip_reshards_to_the_rows_current_values_and_resumes_bitwise(shards, tmp_path, rank0_skips):
    from hvd_partialfc.run.ckpt.reshard import reshard_checkpoint
    straight = _sim(2, shards, tmp_path / "straight", 8).checkpoint
    meta, files = _files(straight)
    assert meta["classifier_skipped_steps"] == 2                # summed over ranks: rank 0's two
    lrs = [len(f["optimizer"]["state"][0]["lrs"]) for f in files]
    assert lrs == [6, 8]                                   # rank 0 skipped 2 classifier steps: other histories
    assert any(int(s) < 6 for s in files[0]["optimizer"]["state"][0]["since_base"])   # rows that lag
    # the same size: checkpoints at steps 2 and 4, killed at 5 and resumed, bitwise the uninterrupted run (a
    # sweep at the save, or numbers that depend on checkpoint.every, would show here)
    run = tmp_path / "killed"
    with pytest.raises(Exception, match="injected failure"):
        _sim(2, shards, run, 8, "checkpoint.every=2", fault="raise@5")
    resumed = _sim(2, shards, run, 8, "checkpoint.every=2", "checkpoint.resume=auto").checkpoint
    for a, b in zip(files, _files(resumed)[1]):
        assert torch.equal(a["weight"], b["weight"])
        sa, sb = a["optimizer"]["state"][0], b["optimizer"]["state"][0]
        assert sa["lrs"] == sb["lrs"] and all(torch.equal(sa[k], sb[k]) for k in ("momentum_buffer", "since_base"))
    # re-sharded to 1 rank: every row's current value is its old rank's, to float32 round-off
    want_w, want_m = (torch.cat(x) for x in zip(*(_current(f) for f in files)))
    one = reshard_checkpoint(straight, str(tmp_path / "one"), 1)
    got_w, got_m = _current(_files(one)[1][0])
    scale = float(want_w.abs().max())
    assert float((got_w - want_w).abs().max()) < 1e-6 * scale
    assert float((got_m - want_m).abs().max()) < 1e-6 * float(want_m.abs().max())
    # a 2-rank checkpoint resumed at 1 rank (resume's own cut, the same function): it trains on, finite
    # (before: rank 1's rows indexed past rank 0's shorter table, IndexError at the first step)
    on = _sim(1, shards, tmp_path / "on", 10, f"checkpoint.resume={straight}").checkpoint
    w_on = _files(on)[1][0]["weight"]
    assert torch.isfinite(w_on).all() and not torch.equal(w_on, _files(one)[1][0]["weight"])
