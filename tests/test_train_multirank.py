"""The method's claims under real horovodrun (Gloo, and MPI): no mocked Horovod.

Each test has a timeout, so a hang shows as a failure, not a stuck CI.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import BIN, MR, ROOT, build_shards, make_feature_npz, read_json_lines, run_hvd

pytestmark = pytest.mark.multirank
CLI = os.path.join(BIN, "hvd-partialfc")


def _ranks(out, n):
    return [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(n)]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_np2_identity_averaged_update_no_leakage(image_shards, tmp_path, backend):
    out = tmp_path / "core"
    run_hvd(2, [os.path.join(MR, "scenarios.py"), "core", image_shards, out, 4], backend=backend)
    r0, r1 = _ranks(out, 2)
    # each rank's classifier is exactly as wide as its slice, and starts from its own rows of the global init
    assert r0["slice"] == [0, 6] and r1["slice"] == [6, 12]
    assert r0["classifier_shape"][0] == 6 and r1["classifier_shape"][0] == 6
    assert r0["classifier_init_max_abs_err"] == 0.0 and r1["classifier_init_max_abs_err"] == 0.0
    # identical starts: the ranks built *different* backbones (parameters and buffers); after the Trainer
    # is built, every rank holds rank 0's pre-broadcast state, bitwise (not merely each other's)
    assert r0["init_digest_before_broadcast"] != r1["init_digest_before_broadcast"]
    assert r0["init_buffer_digest_before_broadcast"] != r1["init_buffer_digest_before_broadcast"]
    assert r0["init_digest_after_broadcast"] == r0["init_digest_before_broadcast"]
    assert r1["init_digest_after_broadcast"] == r0["init_digest_before_broadcast"]
    # steps 0 and 1 (SGD, momentum, weight decay): the backbone update applied = offline update from the
    # mean of the two ranks' local gradients (which differ from each rank's own)
    assert r0["local_grad_differs_from_mean"] and r1["local_grad_differs_from_mean"]
    for r in (r0, r1):
        assert len(r["update_max_abs_err"]) == 2 and max(r["update_max_abs_err"]) < 1e-5
    # No leakage, both ranks training with the same lr: each classifier's update over the two steps =
    # the offline update from its OWN local gradient (of the global batch's mean loss: 1/N of the local
    # batch's mean, as np=1 and `global` mode compute it). The other rank's batch holds other classes;
    # an update that used it (the classifier gradient averaged like the backbone's), or the N-times-larger
    # local-mean gradient, would be far outside the tolerance.
    assert set(sum(r0["batch_labels"], [])) <= set(range(0, 6))
    assert set(sum(r1["batch_labels"], [])) <= set(range(6, 12))
    for r in (r0, r1):
        assert len(r["classifier_update_max_abs_err"]) == 2 and max(r["classifier_update_max_abs_err"]) < 1e-6
        assert min(r["classifier_step_change"]) > 1e-4          # it trained, at each step
        assert r["classifier_update_vs_averaged_grad"] > 1e-4
        assert r["classifier_update_vs_local_mean"] > 1e-4
    # parameters bitwise identical after every step
    assert r0["param_digests"] == r1["param_digests"] and len(set(r0["param_digests"])) == 4
    # BatchNorm buffers differ before averaging (each rank sees its own classes) ...
    assert r0["buffer_digest_before_averaging"] != r1["buffer_digest_before_averaging"]
    # ... the checkpoint leaves every layer's pooled statistics of the union (mean of means; mean of
    # variances + mean of squared means - squared mean), computed offline from both ranks' values before;
    # rank 0's own values (a broadcast) or the plain mean of the variances would not pass ...
    for r in (r0, r1):
        assert r["bn_layers"] >= 5 and r["bn_pooled_max_err"] < 1e-6
        assert r["bn_rank0_vs_pooled"] > 1e-3 and r["bn_mean_of_vars_vs_pooled"] > 1e-4
    # ... and the whole state (parameters and buffers) is bitwise identical after it
    assert r0["full_digest_after_checkpoint"] == r1["full_digest_after_checkpoint"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_np1_equals_plain_pytorch_loop(feature_shards, tmp_path, accumulate):
    # SGD with momentum and weight decay, gradient clipping, and (accumulate=2) backward_passes_per_step
    out = tmp_path / "np1"
    run_hvd(1, [os.path.join(MR, "scenarios.py"), "np1", feature_shards, out, 6, accumulate])
    r = _ranks(out, 1)[0]
    assert r["classifier_moved"] > 0
    assert r["backbone_max_abs_err"] < 1e-5 and r["classifier_max_abs_err"] < 1e-5


def _train_cli(np_, shards, out, *sets, steps=None, backend="gloo", check=True, timeout=180):
    args = ["-m", "hvd_partialfc.cli", "train", "--shards", shards, "--out", out]
    if steps is not None:
        args += ["--steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    return run_hvd(np_, args, backend=backend, check=check, timeout=timeout)


def test_cli_train_loss_falls_then_info_and_export(feature_shards, tmp_path):
    run = str(tmp_path / "run")
    _train_cli(2, feature_shards, run, "model.name=mlp", "data.batch_size=16", "train.log_every=5",
               "head.loss=cosface", "head.scale=16", "head.margin=0.2", "train.epochs=12")
    metrics = read_json_lines(os.path.join(run, "metrics.jsonl"))
    assert metrics[-1]["step"] == 12 * (24 * 20 // 16)  # epochs x steps per epoch
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    info = json.loads(subprocess.run([CLI, "info", run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["world_size"] == 2 and info["digests_agree"]
    assert [r["classifier_shape"] for r in info["ranks"]] == [[20, 128], [20, 128]]
    assert [(r["label_start"], r["label_end"]) for r in info["ranks"]] == [(0, 20), (20, 40)]
    out = tmp_path / "backbone.pt"
    subprocess.run([CLI, "export", run, "--rank", "1", "--out", str(out)], check=True, capture_output=True)
    # the exported file loads with plain torch (no Horovod in this process) and rebuilds the model
    code = ("import torch, sys; d = torch.load(sys.argv[1], weights_only=True); "
            "from hvd_partialfc.tools.export import load_backbone; m, a = load_backbone(sys.argv[1]); "
            "assert 'horovod' not in sys.modules; print(a['name'], d['digest'][:8])")
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "mlp"

    # a run whose ranks recorded different digests: export refuses with a clear error
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    ck = os.path.join(bad, "checkpoints", open(os.path.join(bad, "checkpoints", "latest")).read().strip())
    meta = json.load(open(os.path.join(ck, "meta.json")))
    meta["digests"][1] = "0" * 64
    json.dump(meta, open(os.path.join(ck, "meta.json"), "w"))
    r = subprocess.run([CLI, "export", str(bad), "--rank", "0", "--out", str(tmp_path / "x.pt")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "backbones differ" in r.stderr
    assert not (tmp_path / "x.pt").exists()


def test_uneven_shards_same_steps_no_hang(tmp_path):
    # rank 1 holds 3x the samples of rank 0: steps are agreed (min over ranks), and a fixed --steps
    # longer than rank 0's epoch makes rank 0 cycle its data instead of stopping early.
    shards = build_shards(make_feature_npz(tmp_path / "u.npz", [10] * 10 + [30] * 10), tmp_path / "s", 2)
    run = str(tmp_path / "epochs")
    _train_cli(2, shards, run, "model.name=mlp", "data.batch_size=10", "train.epochs=2", timeout=120)
    info = json.loads(subprocess.run([CLI, "info", run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["step"] == 2 * (100 // 10)  # the smaller rank's epoch decides
    run = str(tmp_path / "fixed")
    _train_cli(2, shards, run, "model.name=mlp", "data.batch_size=10", steps=25, timeout=120)
    info = json.loads(subprocess.run([CLI, "info", run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["step"] == 25 and info["digests_agree"]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_label_outside_slice_fails_on_every_rank(tmp_path, backend):
    import h5py
    shards = build_shards(make_feature_npz(tmp_path / "b.npz", [12] * 8), tmp_path / "s", 2)
    with h5py.File(os.path.join(shards, "shard-00001-of-00002.h5"), "r+") as f:
        y = f["labels"][:]
        y[5] = 1  # a class of rank 0 in rank 1's shard
        f["labels"][:] = y
    proc = _train_cli(2, shards, str(tmp_path / "run"), "model.name=mlp", "data.batch_size=8", steps=5,
                      backend=backend, check=False, timeout=90)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[rank 0] error" in text and "[rank 1] error" in text   # every rank reports, none waits
    assert "shard-00001-of-00002.h5 holds label 1" in text and "rank 1:" in text


def test_truncated_shard_on_one_rank_fails_on_every_rank(tmp_path):
    # h5py alone says "truncated file: eof = ..." without a file name; every rank must name the file, the
    # rank that holds it and the command that checks the set, and exit at start-up.
    shards = build_shards(make_feature_npz(tmp_path / "t.npz", [12] * 8), tmp_path / "s", 2)
    path = os.path.join(shards, "shard-00001-of-00002.h5")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    t0 = time.monotonic()
    proc = _train_cli(2, shards, str(tmp_path / "run"), "model.name=mlp", "data.batch_size=8", steps=5,
                      check=False, timeout=90)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert "[rank 0] error" in text and "[rank 1] error" in text   # every rank reports, none waits
    assert f"rank 1: {path}: cannot open shard file (h5py: " in text
    assert "the file is truncated or not HDF5; copy the set again" in text
    assert f"`hvd-partialfc-shards inspect {shards}`" in text
    ranks_output = [line for line in text.splitlines() if line.startswith(("[0]", "[1]"))]
    assert not any("Traceback" in line for line in ranks_output)   # (horovodrun itself prints one)
    assert not os.path.exists(os.path.join(tmp_path, "run", "checkpoints"))


@pytest.mark.parametrize("options", [
    ["optim.fp16_compression=true", "optim.backward_passes_per_step=2", "train.precision=bf16"],
    ["train.precision=fp16", "optim.name=adamw", "optim.backbone_lr=0.003", "optim.classifier_lr=0.003",
     "optim.clip_grad_norm=1.0", "optim.schedule=poly", "optim.warmup_steps=3", "train.loss_scale_growth=4",
     "train.log_every=1"],
])
def test_options_train_and_stay_identical(image_shards, tmp_path, options):
    run = str(tmp_path / "run")
    _train_cli(2, image_shards, run, "data.batch_size=8", "model.kwargs={width: 8}", "head.scale=16",
               "train.log_every=2", *options, steps=12)
    info = json.loads(subprocess.run([CLI, "info", run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["step"] == 12 and info["digests_agree"]
    metrics = read_json_lines(os.path.join(run, "metrics.jsonl"))
    assert all(np.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    # the options were applied, not only accepted: the lr follows the configured schedule, fp16 keeps a
    # loss scale, AdamW keeps its moments
    from hvd_partialfc.config import load_config
    from hvd_partialfc.run.step import lr_factor
    o = load_config(None, ["data.shards=x", *options]).optim
    for m in metrics:
        f = lr_factor(m["step"] - 1, 12, o.warmup_steps, o.schedule, o.min_lr_ratio, o.poly_power)
        assert m["lr"] == pytest.approx(o.backbone_lr * f, rel=1e-9)
    assert ("loss_scale" in metrics[-1]) == ("train.precision=fp16" in options)
    if "train.precision=fp16" in options:      # replayed from the logged skips: from 2^16, halved at a skipped
        scale, good, skipped, want = 2.0 ** 16, 0, 0, []            # step, doubled after 4 finite ones in a row
        for m in metrics:                                            # (train.loss_scale_growth=4)
            if m["skipped_steps"] > skipped:
                scale, good, skipped = scale / 2, 0, m["skipped_steps"]
            else:
                good += 1
                scale *= 2 if good % 4 == 0 else 1
            want.append(scale)
        assert [m["loss_scale"] for m in metrics] == want and max(want) > min(want) * 2, metrics
    from hvd_partialfc.run.checkpoint_files import load_file, resolve_checkpoint
    state = load_file(os.path.join(resolve_checkpoint(run), "backbone.pt"))["optimizer"]["state"]
    assert ("exp_avg" in next(iter(state.values()))) == ("optim.name=adamw" in options)


def test_evaluation_during_training_np2(image_shards, tmp_path):
    # rank 0 evaluates every 5 steps and at the end, after all ranks averaged BatchNorm buffers
    from hvd_partialfc.verification.verify_pairs import evaluate_backbone
    from hvd_partialfc.tools.export import load_backbone
    from data_tools.pair_sets import write_pairs_h5
    from hvd_partialfc.data.pair_files import read_pairs
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 32, 32), dtype=np.uint8)
    pairs = rng.integers(0, 40, size=(60, 2))
    write_pairs_h5(str(tmp_path / "held.h5"), images, pairs, np.arange(60) % 2 == 0)
    run = str(tmp_path / "run")
    _train_cli(2, image_shards, run, "data.batch_size=8", "model.kwargs={width: 8}", "eval.every=5",
               f"eval.pairs=[{tmp_path / 'held.h5'}]", steps=12, timeout=120)
    evals = read_json_lines(os.path.join(run, "eval.jsonl"))
    assert [e["step"] for e in evals] == [5, 10, 12] and all(e["set"] == "held" for e in evals)
    assert all(0.0 <= e["auc"] <= 1.0 for e in evals)
    info = json.loads(subprocess.run([CLI, "info", run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert info["digests_agree"]
    # the final evaluation saw the averaged statistics: it scores as the final checkpoint's backbone (whose
    # BatchNorm buffers are the pooled ones, checked in the core scenario) does offline; rank 0's own
    # statistics would move every score, hence the best threshold
    model, _ = load_backbone(run)
    from hvd_partialfc.run.startup import rank_threads
    threads = torch.get_num_threads()     # the ranks' count (2 ranks on this host): the convolutions round
    torch.set_num_threads(rank_threads(2))  # differently with another, and a score's round-off moved a fold's
    try:                                    # threshold
        ref = evaluate_backbone(model, read_pairs(str(tmp_path / "held.h5")), roc=False)
    finally:
        torch.set_num_threads(threads)
    assert evals[-1]["best_threshold"] == pytest.approx(ref["best_threshold"], abs=1e-5)
    assert evals[-1]["auc"] == pytest.approx(ref["auc"], abs=1e-9)
    assert evals[-1]["acc"] == pytest.approx(ref["acc"], abs=1e-9)
    # a pair set that does not exist: an agreed error before training, on every rank
    proc = _train_cli(2, image_shards, str(tmp_path / "bad"), "data.batch_size=8", "model.kwargs={width: 8}",
                      f"eval.pairs=[{tmp_path / 'missing.h5'}]", steps=3, check=False, timeout=90)
    assert proc.returncode != 0 and "missing.h5" in proc.stdout + proc.stderr
