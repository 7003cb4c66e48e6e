"""Verification metrics against hand-computed cases, embedding, baselines, the training-loop Evaluator and
the ``eval`` CLI on a tiny trained run."""
from __future__ import annotations

import io
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch

from hvd_partialfc.verification.all_pairs import all_pairs_metrics
from hvd_partialfc.verification.embedding import embed, score_pairs
from hvd_partialfc.verification.evaluator import Evaluator
from hvd_partialfc.verification.metrics import (best_threshold, far_key, kfold_accuracy, roc_auc, roc_curve, roc_points,
                                                tar_at_far, verification_metrics)
from hvd_partialfc.verification.verify_pairs import evaluate_backbone, evaluate_baselines
from hvd_partialfc.models import create_model
from data_tools.pair_sets import write_bin, write_pairs_h5
from hvd_partialfc.data.pair_files import PairSet, read_pairs


# ---------------------------------------------------------------------------------------------- metrics

# Six pairs scored by hand: accepting ">= t" walks down the sorted scores.
HAND_SCORES = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
HAND_SAME = np.array([True, True, False, True, False, False])


def test_hand_roc_auc_and_threshold():
    far, tar, thr = roc_curve(HAND_SCORES, HAND_SAME)
    np.testing.assert_allclose(far, [0, 0, 0, 1 / 3, 1 / 3, 2 / 3, 1])
    np.testing.assert_allclose(tar, [0, 1 / 3, 2 / 3, 2 / 3, 1, 1, 1])
    assert thr[0] == math.inf and list(thr[1:]) == list(HAND_SCORES)
    # same > different in 3 + 3 + 2 of the 9 (same, different) combinations
    assert roc_auc(HAND_SCORES, HAND_SAME) == pytest.approx(8 / 9)
    # accepting {0.9, 0.8} and accepting {0.9 .. 0.6} are both 5/6 right: the stricter one wins, and the
    # threshold is the midpoint between the lowest accepted and the highest rejected score
    t, acc = best_threshold(HAND_SCORES, HAND_SAME)
    assert t == pytest.approx(0.75) and acc == pytest.approx(5 / 6)
    r = tar_at_far(HAND_SCORES, HAND_SAME, 0.34)          # one false accept of three allowed
    assert r["tar"] == 1.0 and r["threshold"] == 0.6 and r["far"] == pytest.approx(1 / 3)


def test_ties_count_half():
    scores = np.array([1.0, 0.5, 0.5, 0.0])
    same = np.array([True, True, False, False])
    far, tar, _ = roc_curve(scores, same)
    # the tied pair moves FAR and TAR together: one diagonal segment, not a staircase
    np.testing.assert_allclose(far, [0, 0, 0.5, 1])
    np.testing.assert_allclose(tar, [0, 0.5, 1, 1])
    assert roc_auc(scores, same) == pytest.approx(3.5 / 4)
    assert roc_auc(np.zeros(6), np.array([1, 0, 1, 0, 1, 0], bool)) == pytest.approx(0.5)


def test_auc_equals_pairwise_probability_with_ties():
    rng = np.random.default_rng(3)
    same = rng.random(300) < 0.4
    scores = np.round(rng.normal(size=300) + same, 1)        # rounding makes many ties
    pos, neg = scores[same][:, None], scores[~same][None, :]
    expected = np.mean((pos > neg) + 0.5 * (pos == neg))
    assert roc_auc(scores, same) == pytest.approx(expected, abs=1e-12)


def test_tar_at_far_hand_case():
    neg = np.arange(100) / 100.0                             # 0.00 .. 0.99
    pos = np.array([0.995, 0.985, 0.5])
    scores, same = np.r_[pos, neg], np.r_[np.ones(3, bool), np.zeros(100, bool)]
    r = tar_at_far(scores, same, 1e-2)                    # one false accept allowed (0.99)
    assert r["tar"] == pytest.approx(2 / 3) and r["threshold"] == 0.985 and r["far"] == 0.01


def test_tar_at_far_null_when_too_few_negatives():
    rng = np.random.default_rng(0)
    same = np.r_[np.ones(200, bool), np.zeros(1000, bool)]
    scores = rng.random(len(same)) + same
    m = verification_metrics(scores, same)
    assert m["tar@far=1e-2"] is not None and m["tar@far=1e-3"] is not None   # 1000 negatives: enough
    assert m["tar@far=1e-4"] is None
    assert "1000 different pairs" in m["notes"]["tar@far=1e-4"] and "10000" in m["notes"]["tar@far=1e-4"]
    r = tar_at_far(scores[:-1], same[:-1], 1e-3)          # 999 negatives
    assert r["tar"] is None and r["reason"]


def test_perfect_scorer():
    rng = np.random.default_rng(1)
    same = np.r_[np.ones(1000, bool), np.zeros(10000, bool)]
    same = same[rng.permutation(len(same))]
    scores = np.where(same, rng.uniform(0.5, 1.0, len(same)), rng.uniform(-1.0, 0.4, len(same)))
    m = verification_metrics(scores, same)
    assert m["acc"] == 1.0 and m["acc_std"] == 0.0 and m["auc"] == 1.0 and m["best_acc"] == 1.0
    assert m["tar@far=1e-2"] == m["tar@far=1e-3"] == m["tar@far=1e-4"] == 1.0
    assert 0.4 < m["best_threshold"] < 0.5
    assert json.loads(json.dumps(m)) == m                     # JSON-able as it is


def test_random_scorer():
    rng = np.random.default_rng(2)
    same = rng.random(20000) < 0.5
    m = verification_metrics(rng.random(20000), same)
    assert m["auc"] == pytest.approx(0.5, abs=0.02)           # sd of the AUC here is ~0.004
    assert m["acc"] == pytest.approx(0.5, abs=0.03)


def test_kfold_follows_lfw_fold_order():
    # 23 pairs -> KFold(10, shuffle=False) folds of 3, 3, 3, 2, 2, ...: pair 9 opens the 4th fold.
    same = np.arange(23) % 2 == 0
    scores = same.astype(float)
    scores[9] = 0.0 if same[9] else 1.0                      # one pair that looks like the other class
    r = kfold_accuracy(scores, same)
    expected = [1.0] * 10
    expected[3] = 0.5
    np.testing.assert_allclose(r["fold_acc"], expected)
    assert r["acc"] == pytest.approx(0.95) and r["acc_std"] == pytest.approx(0.15)   # population std
    assert all(t == pytest.approx(0.5) for t in r["fold_threshold"])


def test_metric_input_errors():
    with pytest.raises(ValueError, match="both same and different"):
        verification_metrics(np.arange(20.0), np.ones(20, bool))
    with pytest.raises(ValueError, match="at least 10 pairs"):
        kfold_accuracy(np.arange(6.0), np.arange(6) % 2 == 0)
    with pytest.raises(ValueError, match="not finite"):
        roc_auc(np.array([0.0, np.nan]), np.array([True, False]))


def test_roc_points_thinning_keeps_the_steps():
    rng = np.random.default_rng(4)
    same = rng.random(6000) < 0.3
    scores = rng.normal(size=6000) + 2 * same
    pts = roc_points(scores, same, max_points=300)
    assert len(pts["far"]) <= 300 and pts["far"][0] == 0.0 and pts["far"][-1] == 1.0
    for f in (1e-2, 1e-1):                                   # the sampled curve agrees with TAR@FAR
        i = np.searchsorted(pts["far"], f, side="right") - 1
        assert pts["tar"][i] <= tar_at_far(scores, same, f)["tar"] + 1e-12
        assert pts["far"][i] <= f


# -------------------------------------------------------------------------------------- embedding, sets

def _images(n, seed=0, size=32):
    return (np.random.default_rng(seed).random((n, size, size)) * 255).astype(np.uint8)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return create_model("resnet", in_shape=[32, 32], embedding_dim=16, width=4, **kw)


def test_embed_normalised_batched_and_flip():
    model, imgs = _model(), _images(10)
    e = embed(model, imgs, batch_size=3)
    assert e.shape == (10, 16) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(e, embed(model, imgs, batch_size=256), atol=1e-5)
    # the flip sum is the same for an image and its mirror image, and differs from no flip
    ef = embed(model, imgs, flip=True)
    np.testing.assert_allclose(ef, embed(model, imgs[:, :, ::-1], flip=True), atol=1e-5)
    assert not np.allclose(ef, e, atol=1e-3)


def _png_blobs(images):
    """PNG bytes of each uint8 image (what an LFW-style .bin holds)."""
    from PIL import Image
    out = []
    for im in images:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def test_bin_round_trip_and_evaluate(tmp_path):
    imgs = _images(40, seed=5)
    blobs = _png_blobs(imgs)
    issame = [k % 2 == 0 for k in range(20)]
    write_bin(str(tmp_path / "tiny.bin"), blobs, issame)
    ps = read_pairs(str(tmp_path / "tiny.bin"))
    assert ps.name == "tiny" and ps.num_pairs == 20
    np.testing.assert_array_equal(ps.images, imgs)            # PNG is lossless
    np.testing.assert_array_equal(ps.left, np.arange(0, 40, 2))
    np.testing.assert_array_equal(ps.same, issame)
    m = evaluate_backbone(_model(), ps, batch_size=8)
    assert 0.0 <= m["acc"] <= 1.0 and 0.0 <= m["auc"] <= 1.0 and m["pairs"] == 20
    assert m["tar@far=1e-2"] is None and "tar@far=1e-2" in m["notes"]   # 10 different pairs only
    # scores equal a direct cosine of the embeddings
    e = embed(_model(), ps.images)
    np.testing.assert_allclose(score_pairs(_model(), ps), np.sum(e[0::2] * e[1::2], axis=1), atol=1e-5)


def test_baselines_on_a_set_pixels_can_solve():
    # "same" pairs are the same image up to faint noise: raw pixels must score (nearly) perfectly
    rng = np.random.default_rng(6)
    base = _images(30, seed=6)
    noisy = np.clip(base.astype(int) + rng.integers(-3, 4, base.shape), 0, 255).astype(np.uint8)
    images = np.concatenate([base, noisy])
    left = np.arange(30)
    right = np.where(np.arange(30) % 2 == 0, left + 30, (left + 7) % 30 + 30)
    ps = PairSet("noise", images, left, right, np.arange(30) % 2 == 0)
    args = {"name": "resnet", "in_shape": [32, 32], "embedding_dim": 16, "kwargs": {"width": 4}}
    state = torch.get_rng_state()
    b = evaluate_baselines(args, ps, batch_size=16, seed=1)
    assert torch.equal(state, torch.get_rng_state())          # random init under a forked RNG
    assert set(b) == {"pixels", "pixels_ncc", "random_init"}
    assert b["pixels"]["auc"] == 1.0 and b["pixels_ncc"]["auc"] == 1.0 and b["random_init"]["seed"] == 1
    again = evaluate_baselines(args, ps, batch_size=16, seed=1)["random_init"]
    assert again["acc"] == b["random_init"]["acc"] and again["auc"] == b["random_init"]["auc"]
    with pytest.raises(ValueError, match="shape"):
        evaluate_baselines(dict(args, in_shape=[64, 64]), ps)


# ------------------------------------------------------------------------------------------- Evaluator

def _write_h5_set(path, n_images=40, n_pairs=60, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_images // 4), 4)
    pairs = rng.integers(0, n_images, (n_pairs, 2))
    pairs[::2, 1] = pairs[::2, 0] // 4 * 4 + (pairs[::2, 0] + 1) % 4    # every other pair: same class
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    write_pairs_h5(str(path), _images(n_images, seed), pairs, same, labels)
    return str(path)


def test_evaluator_leaves_model_and_rng_untouched(tmp_path):
    model = _model(dropout=0.5)                               # dropout would draw random numbers in train mode
    model.train()
    model.features.eval()                                     # a caller's frozen BatchNorm stays frozen
    flags = [m.training for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    evaluator = Evaluator([_write_h5_set(tmp_path / "held.h5")], every=5, batch_size=16,
                             out_dir=str(tmp_path / "run"))
    assert [evaluator.due(s, False) for s in (1, 5, 7, 10)] == [False, True, False, True]
    assert evaluator.due(7, True)
    rng = torch.get_rng_state()
    recs = evaluator.run(5, model)
    recs = evaluator.run(10, model)
    assert torch.equal(rng, torch.get_rng_state())
    assert [m.training for m in model.modules()] == flags
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    lines = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["set"]) for r in lines] == [(5, "held"), (10, "held")]
    assert lines[1] == recs["held"]
    assert {"acc", "acc_std", "auc", "tar@far=1e-2", "tar@far=1e-3", "tar@far=1e-4", "best_threshold"} <= set(lines[0])
    assert "held_acc" in Evaluator.summary(recs)


def test_evaluator_checks_sets_up_front(tmp_path):
    assert not Evaluator([], every=5).due(5, True)          # no pair sets: never due
    with pytest.raises(FileNotFoundError):
        Evaluator([str(tmp_path / "missing.h5")], every=0)
    path = str(tmp_path / "one.h5")
    write_pairs_h5(path, _images(4), np.array([[0, 1], [2, 3]] * 6), np.ones(12, bool))
    with pytest.raises(ValueError, match="both same and different"):
        Evaluator([path], every=0)


# ------------------------------------------------------------------------------------------------ CLI

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A backbone trained for 20 steps on 10 classes of noise: one rank, ``hvd-partialfc simulate --ranks 1``
    through the CLI's entry point in this process (no horovodrun, no second torch import); the torch thread
    count and the random streams are put back after."""
    import contextlib
    import random
    from conftest import build_shards
    from hvd_partialfc.cli import main
    d = tmp_path_factory.mktemp("tiny")
    np.savez(d / "img.npz", images=_images(200, seed=7), labels=np.repeat(np.arange(10), 20))
    build_shards(d / "img.npz", d / "shards", 1)
    threads, rngs = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            rc = main(["simulate", "--ranks", "1", "--shards", str(d / "shards"), "--out", str(d / "run"),
                       "--steps", "20", "--set", "data.batch_size=32", "--set", "model.kwargs={width: 8}"])
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rngs[0]), np.random.set_state(rngs[1]), random.setstate(rngs[2])
    assert rc == 0, f"training failed:\n{log.getvalue()[-3000:]}"
    return d


def test_eval_cli_on_a_tiny_run(tiny_run, tmp_path, capsys):
    from hvd_partialfc.cli import main
    h5 = _write_h5_set(tmp_path / "held.h5", seed=8)
    imgs = _images(24, seed=9)
    blobs = _png_blobs(imgs)
    write_bin(str(tmp_path / "lfwlike.bin"), blobs, [k % 2 == 0 for k in range(12)])
    out = tmp_path / "report"
    rc = main(["eval", "--backbone", str(tiny_run / "run"), "--pairs", h5, "--pairs", str(tmp_path / "lfwlike.bin"),
               "--baselines", "--batch-size", "16", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    for row in ("trained backbone", "raw pixels", "random-init backbone", "± ", "held:", "lfwlike:"):
        assert row in printed
    report = json.loads((out / "eval.json").read_text())
    assert set(report["sets"]) == {"held", "lfwlike"}
    assert set(report["sets"]["held"]) == {"backbone", "pixels", "pixels_ncc", "random_init"}
    assert report["model"]["kwargs"] == {"width": 8}
    assert 0.0 <= report["sets"]["held"]["backbone"]["auc"] <= 1.0
    assert (out / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # default output folder: the run folder itself
    assert main(["eval", "--backbone", str(tiny_run / "run"), "--pairs", h5]) == 0
    assert (tiny_run / "run" / "eval.json").is_file() and (tiny_run / "run" / "roc.png").is_file()


def test_eval_cli_refuses_a_wrong_shape(tiny_run, tmp_path, capsys):
    from hvd_partialfc.cli import main
    path = str(tmp_path / "big.h5")
    write_pairs_h5(path, _images(4, size=48), np.array([[0, 1], [2, 3]] * 6), np.arange(12) % 2 == 0)
    assert main(["eval", "--backbone", str(tiny_run / "run"), "--pairs", path]) == 2
    assert "backbone takes [32, 32]" in capsys.readouterr().err


class _Touch:
    """Unpickling this runs ``touch PATH`` (what a malicious LFW.bin can do to a plain ``pickle.load``)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_eval_cli_refuses_a_bin_holding_code(tiny_run, tmp_path, capsys):
    """A .bin whose pickle asks for os.system: refused by name (exit 2, no traceback, no report), and the
    code never runs (the file it would touch does not appear)."""
    from hvd_partialfc.cli import main
    made = tmp_path / "made-by-the-pickle"
    bad = tmp_path / "LFW.bin"
    bad.write_bytes(pickle.dumps((_png_blobs(_images(2)), [True], _Touch(made)), protocol=2))
    rc = main(["eval", "--backbone", str(tiny_run / "run"), "--pairs", str(bad), "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert rc != 0 and not made.exists()
    assert f"{bad}: refused to load: the pickle asks for {os.system.__module__}.system" in out.err
    assert "Traceback" not in out.err + out.out
    assert not (tmp_path / "out" / "eval.json").exists()


# ------------------------------------------------------------------------------------------ all pairs

def test_all_pairs_matches_the_exact_pair_metrics():
    """The histogram form of every-pair verification equals `tar_at_far` / `roc_auc` over the explicit
    upper triangle of pairs, including across block boundaries."""
    rng = np.random.default_rng(0)
    n, k = 700, 30
    y = rng.integers(0, k, n)
    e = rng.normal(size=(k, 16))[y] + 1.5 * rng.normal(size=(n, 16))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    m = all_pairs_metrics(e, y, fars=(1e-2, 1e-3, 1e-6), block=64)
    i, j = np.triu_indices(n, 1)
    scores, same = (e[i] * e[j]).sum(1), y[i] == y[j]
    assert (m["pairs"], m["same_pairs"]) == (len(scores), int(same.sum()))
    for far in (1e-2, 1e-3):
        assert m[far_key(far)] == pytest.approx(tar_at_far(scores, same, far)["tar"], abs=2.0 / same.sum())
    assert m["auc"] == pytest.approx(roc_auc(scores, same), abs=1e-5)
    assert m["tar@far=1e-6"] is None and "needs at least 1000000" in m["notes"]["tar@far=1e-6"]


def test_all_pairs_perfect_and_refusals():
    y = np.repeat(np.arange(4), 3)
    e = np.eye(8)[y]                                   # classes on orthogonal axes: perfect separation
    m = all_pairs_metrics(e, y, fars=(1e-1,))
    assert m["auc"] == 1.0 and m["tar@far=1e-1"] == 1.0
    with pytest.raises(ValueError, match="at least two classes"):
        all_pairs_metrics(e[:3], y[:3])
    with pytest.raises(ValueError, match="n >= 2"):
        all_pairs_metrics(e[:1], y[:1])


def test_collapsed_embeddings_give_tar_0_with_its_reason_in_both_protocols():
    """A diverged run's embeddings all point one way: the top score (bin) alone holds every impostor. The
    binned protocol gave an IndexError, the exact one TAR 0 without a word; both now say TAR 0 and why."""
    y = np.repeat(np.arange(30), 4)                      # 180 same-class and 6,960 different-class pairs
    e = np.full((120, 8), 8 ** -0.5)                     # collapsed: every cosine is 1
    m = all_pairs_metrics(e, y, fars=(1e-2, 1e-3))
    assert m["tar@far=1e-2"] == 0.0 and m["tar@far=1e-3"] == 0.0
    assert "top score bin (width 1e-05) alone holds 6960 of 6960 different pairs" in m["notes"]["tar@far=1e-2"]
    assert "FAR 1e-2 allows (69)" in m["notes"]["tar@far=1e-2"]
    i, j = np.triu_indices(120, 1)
    scores, same = (e[i] * e[j]).sum(1), y[i] == y[j]
    r = tar_at_far(scores, same, 1e-2)
    assert r["tar"] == 0.0 and "top score alone holds 6960 of 6960" in r["reason"]
    assert verification_metrics(scores, same, (1e-2,))["notes"]["tar@far=1e-2"] == r["reason"]
    # a genuine score on top, then a tie of 3 impostors where 1e-1 allows 1: the top's TAR, no reason
    s2 = np.array([0.9, 0.5, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    y2 = np.array([True, True, False, False, False] + [False] * 8)
    assert tar_at_far(s2, y2, 1e-1) == {"tar": 0.5, "threshold": 0.9, "far": 0.0, "reason": None}
    assert all_pairs_metrics(np.eye(30)[y], y, fars=(1e-1,))["notes"] == {}


def test_all_pairs_refuses_non_finite_embeddings_naming_the_backbone(tiny_run, tmp_path, capsys, monkeypatch):
    """One NaN row dropped its impostor pairs from the histogram without a word (116 of 7,140 here); now it
    is one error line that names the backbone, through ``eval``'s usual exit 2."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.verification import all_pairs
    y = np.repeat(np.arange(30), 4)
    e = np.random.default_rng(0).normal(size=(120, 8))
    e[3] = np.nan
    with pytest.raises(ValueError, match="^runs/x: 1 of 120 embeddings are not finite"):
        all_pairs_metrics(e, y, source="runs/x")
    real = all_pairs.embed
    monkeypatch.setattr(all_pairs, "embed", lambda *a: real(*a) * np.where(np.arange(200) == 5, np.inf, 1)[:, None])
    run, shards = str(tiny_run / "run"), str(tiny_run / "shards")
    assert main(["eval", "--backbone", run, "--all-pairs", shards, "--out", str(tmp_path / "ap")]) == 2
    err = capsys.readouterr().err
    assert f"backbone {run} on {shards}: 1 of 200 embeddings are not finite" in err and "Traceback" not in err


def test_eval_cli_all_pairs_of_a_shard_set(tiny_run, tmp_path, capsys):
    from hvd_partialfc.cli import main
    out = tmp_path / "ap"
    assert main(["eval", "--backbone", str(tiny_run / "run"), "--all-pairs", str(tiny_run / "shards"),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "200 samples, 1,900 same-class and 18,000 different-class pairs" in printed
    report = json.loads((out / "eval.json").read_text())
    (m,) = report["all_pairs"].values()
    assert m["pairs"] == 200 * 199 // 2 and m["tar@far=1e-5"] is None and 0.0 <= m["auc"] <= 1.0
    assert main(["eval", "--backbone", str(tiny_run / "run")]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err


def test_demo_report_from_a_run_and_its_evaluation(tiny_run, tmp_path):
    """`hvd_partialfc.tools.report` (what `make demo` writes last): tables, all-pairs line, figures, run facts."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.tools.report import write_report
    h5 = _write_h5_set(tmp_path / "held.h5", seed=8)
    out = tmp_path / "eval"
    assert main(["eval", "--backbone", str(tiny_run / "run"), "--pairs", h5, "--baselines",
                 "--all-pairs", str(tiny_run / "shards"), "--out", str(out)]) == 0
    text = open(write_report(str(tiny_run / "run"), h5, str(out), {"machine": "test"})).read()
    for part in ("| trained backbone |", "baseline: raw pixels", "Every pair of the **200 held-out samples**",
                 "TAR@FAR=1e-3", "digests agree on all ranks: True", "* machine: test", "![pairs](pairs.png)"):
        assert part in text, part
    assert (tiny_run / "run" / "pairs.png").is_file() and (tiny_run / "run" / "curves.png").is_file()


class _RawPixels(torch.nn.Module):
    """A backbone that normalises inside, as MXNet-converted InsightFace models do (Sub, then Mul)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner((x - 127.5) * (1.0 / 127.5))


def test_eval_of_an_onnx_model_scores_as_its_backbone(tiny_run, tmp_path, capsys):
    """``eval --backbone model.onnx``: the tiny run's backbone exported, then evaluated on the same pairs as the
    run itself: the same metrics; a graph that normalises its input itself is fed raw pixels (found from its
    first nodes, or forced), and gives the backbone's embeddings; --baselines is refused with the reason."""
    pytest.importorskip("onnxruntime")
    from hvd_partialfc.cli import main
    from hvd_partialfc.models.pretrained import load_backbone
    from hvd_partialfc.tools.onnx_export import onnx_bytes
    from hvd_partialfc.verification.onnx_backbone import OnnxBackbone
    model, args = load_backbone(str(tiny_run / "run"))
    (tmp_path / "m.onnx").write_bytes(onnx_bytes(model, args["in_shape"]))
    (tmp_path / "raw.onnx").write_bytes(onnx_bytes(_RawPixels(model), args["in_shape"]))
    h5 = _write_h5_set(tmp_path / "held.h5", seed=8)
    reports = {}
    for name, backbone in (("pt", str(tiny_run / "run")), ("onnx", str(tmp_path / "m.onnx")),
                           ("raw", str(tmp_path / "raw.onnx"))):
        assert main(["eval", "--backbone", backbone, "--pairs", h5, "--batch-size", "16",
                     "--out", str(tmp_path / name)]) == 0
        reports[name] = json.loads((tmp_path / name / "eval.json").read_text())
    want = reports["pt"]["sets"]["held"]["backbone"]
    for name in ("onnx", "raw"):
        got = reports[name]["sets"]["held"]["backbone"]
        assert got["auc"] == pytest.approx(want["auc"], abs=1e-6) and got["acc"] == pytest.approx(want["acc"], abs=1e-6)
    assert reports["onnx"]["model"]["input"] == "(pixel - 127.5) / 127.5"
    assert reports["raw"]["model"]["input"] == "pixels 0..255" and reports["raw"]["model"]["in_shape"] == [32, 32]
    x = torch.rand(5, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        ref = model(x)
    assert torch.allclose(OnnxBackbone(str(tmp_path / "raw.onnx"))(x), ref, atol=1e-4)
    forced = OnnxBackbone(str(tmp_path / "raw.onnx"), pixels="normalized")(x)
    assert not torch.allclose(forced, ref, atol=1e-2)                 # fed the wrong pixels: other embeddings
    capsys.readouterr()
    assert main(["eval", "--backbone", str(tmp_path / "m.onnx"), "--pairs", h5, "--baselines"]) == 2
    assert "an ONNX file has none here" in capsys.readouterr().err
