"""1:N identification on a tiny hand-made gallery, the seeded gallery/probe split, the blocked search, the
``eval --identification`` command; and the in-training evaluator's own buffer averaging."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

from data_tools.pair_sets import write_pairs_h5
from data_tools.shard_writer import write_shard_set
from hvd_partialfc.data.partition import even_slices
from hvd_partialfc.verification import identification as I
from hvd_partialfc.verification.evaluator import Evaluator
from hvd_partialfc.verification.metrics import rank_accuracy, tpir_at_fpir


def _unit(v):
    v = np.asarray(v, dtype=np.float32)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_metrics_on_a_hand_made_gallery():
    # gallery: 6 classes (ids 10..15) on the first 6 axes of R^12
    ids = np.arange(10, 16)
    gallery = np.eye(6, 12, dtype=np.float32)
    # mated probes: 0 -> its mate first (score 0.8); 1 -> class 12 first, its mate (11) second;
    # 2 -> mate only 6th; 3 -> mate first with 0.5 / |(0.5, 0.4, 0.3)| = 0.707
    mated = _unit(np.pad([[0.8, 0.6, 0, 0, 0, 0],
                          [0, 0.6, 0.8, 0, 0, 0],
                          [0.5, 0.45, 0.4, 0.35, 0.3, 0.2],
                          [0, 0, 0, 0.5, 0.4, 0.3]], ((0, 0), (0, 6))))
    mated_class = np.array([10, 11, 15, 13])
    # non-mated probes: best gallery score b on axis 0, the rest of the unit length off the gallery
    best = [0.9, 0.7, 0.6, 0.3] + [0.1] * 6
    nm = np.zeros((10, 12), np.float32)
    for k, b in enumerate(best):
        nm[k, 0], nm[k, 6] = b, np.sqrt(1 - b * b)
    np.testing.assert_allclose(np.max(nm @ gallery.T, axis=1), best, atol=1e-7)
    m = I.identification_metrics(ids, gallery, mated, mated_class, nm)
    assert (m["gallery"], m["mated_probes"], m["nonmated_probes"]) == (6, 4, 10)
    assert m["rank1"] == 2 / 4 and m["rank5"] == 3 / 4
    # FPIR 1e-1 of 10 non-mated: one false alarm allowed -> accept above 0.7 (the 2nd best): probe 0
    # (hit, 0.8) passes; probe 3 is a hit of score 0.5/|.|=0.707: passes too (0.707 > 0.7)
    assert float(mated[3, 3]) > 0.7
    assert m["tpir@fpir=1e-1"] == 2 / 4
    # FPIR 1e-2 needs 100 non-mated probes
    assert m["tpir@fpir=1e-2"] is None and "needs at least 100" in m["notes"]["tpir@fpir=1e-2"]
    r = tpir_at_fpir([0.8, 0.9, 0.95], [True, False, True], [0.85, 0.1, 0.2, 0.3], 0.25)
    assert r == {"tpir": 2 / 3, "threshold": 0.3, "fpir": 0.25, "reason": None}   # one alarm (0.85) of 4 allowed
    assert rank_accuracy([[1, 2], [3, 1]], [1, 1], 1) == 0.5 and rank_accuracy([[1, 2], [3, 1]], [1, 1], 2) == 1.0


def test_split_is_seeded_disjoint_and_leaves_classes_out():
    labels = np.repeat(np.arange(40), 5)
    g, gc, mated, nonmated = I.split_gallery(labels, seed=3)
    again = I.split_gallery(labels, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((g, gc, mated, nonmated), again))
    assert not np.array_equal(g, I.split_gallery(labels, seed=4)[0])
    allpos = np.concatenate([g, mated, nonmated])
    assert np.array_equal(np.sort(allpos), np.arange(200))               # every sample once
    assert np.array_equal(labels[g], gc)
    out = np.unique(labels[nonmated])
    assert len(out) == 4 and not set(out) & set(labels[g]) and not set(out) & set(labels[mated])
    per = np.bincount(labels[g], minlength=40)
    assert set(per[per > 0]) == {2} and len(np.unique(labels[mated])) == 36   # round(0.5 * 5) = 2, 3 probes


def test_blocked_search_equals_the_full_matrix():
    rng = np.random.default_rng(0)
    gallery, probes = _unit(rng.normal(size=(300, 8))), _unit(rng.normal(size=(70, 8)))
    s_small, i_small = I.search(gallery, probes, k=5, block_bytes=4 * 300 * 3)     # blocks of 3 probes
    full = probes @ gallery.T
    order = np.argsort(-full, axis=1)[:, :5]
    assert np.array_equal(i_small, order)
    np.testing.assert_allclose(s_small, np.take_along_axis(full, order, 1), atol=1e-6)


def test_eval_cli_identification(tmp_path):
    """Classes that are distinct patterns, a pixel backbone: every probe is identified (known answer)."""
    from hvd_partialfc.verification.identification import evaluate_identification
    rng = np.random.default_rng(0)
    base = (rng.integers(0, 2, (30, 8, 8)) * 255).astype(np.uint8).repeat(4, 1).repeat(4, 2)
    images = base.repeat(6, 0) ^ (rng.random((180, 32, 32)) < 0.05).astype(np.uint8) * 255  # 5% pixels flipped
    labels = np.repeat(np.arange(30), 6)
    write_shard_set(str(tmp_path / "held"), "images", images, labels, even_slices(30, 1), 30)
    m = evaluate_identification(nn.Flatten(), str(tmp_path / "held"), batch_size=16, seed=0)
    assert (m["gallery"], m["nonmated_probes"], m["mated_probes"]) == (27, 18, 27 * 3)
    assert m["rank1"] == m["rank5"] == 1.0 and m["tpir@fpir=1e-1"] == 1.0 and m["tpir@fpir=1e-2"] is None
    from hvd_partialfc.cli import main
    from hvd_partialfc.models import create_model
    torch.manual_seed(0)
    model = create_model("resnet", in_shape=[32, 32], embedding_dim=8, width=4)
    torch.save({"format": "hvd_partialfc.exported_backbone", "model": {"name": "resnet", "in_shape": [32, 32],
                "embedding_dim": 8, "kwargs": {"width": 4}}, "state_dict": model.state_dict()}, tmp_path / "b.pt")
    assert main(["eval", "--backbone", str(tmp_path / "b.pt"), "--identification", str(tmp_path / "held"),
                 "--out", str(tmp_path / "out")]) == 0
    rep = json.load(open(tmp_path / "out/eval.json"))["identification"]
    (r,) = rep.values()
    assert {"rank1", "rank5", "tpir@fpir=1e-2", "tpir@fpir=1e-1", "gallery"} <= set(r)


class _FakeComm:
    """Our comm's interface (not Horovod's): records the collective instead of running it."""

    def __init__(self, rank):
        self.rank, self.calls = rank, []

    @property
    def is_main(self):
        return self.rank == 0

    def average_buffers(self, module, name):
        self.calls.append(name)
        for b in module.buffers():
            if b.is_floating_point():
                b.fill_(7.0)        # stands for "the average": what rank 0 evaluates must be the averaged one

    def failures(self, error, name):
        return [] if error is None else [(self.rank, error)]   # one rank's agreement: its own error


def test_evaluator_averages_then_evaluates_on_the_main_rank_only(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 16, 16), dtype=np.uint8)
    pairs = rng.integers(0, 20, (30, 2))
    write_pairs_h5(str(tmp_path / "p.h5"), images, pairs, np.arange(30) % 2 == 0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten())
    # rank 1 never reads the pair sets (a path only rank 0 can see is fine), but it joins the collective
    other = Evaluator([str(tmp_path / "only-on-rank0.h5")], every=2, comm=_FakeComm(1), out_dir=str(tmp_path / "r1"))
    assert other.sets == [] and other.maybe_run(1, False, model) is None and other.comm.calls == []
    assert other.maybe_run(2, False, model) is None and other.comm.calls == ["eval.2"]
    main = Evaluator([str(tmp_path / "p.h5")], every=2, comm=_FakeComm(0), out_dir=str(tmp_path / "r0"))
    for b in model.buffers():
        b.zero_() if b.is_floating_point() else None
    recs = main.maybe_run(4, False, model)
    assert main.comm.calls == ["eval.4"] and set(recs) == {"p"}
    assert float(model[1].running_mean[0]) == 7.0            # averaged before, and kept for the checkpoint
    single = Evaluator([str(tmp_path / "p.h5")], every=2, out_dir=str(tmp_path / "ref"))
    ref = single.run(4, model)
    assert recs["p"]["acc"] == ref["p"]["acc"] and recs["p"]["auc"] == ref["p"]["auc"]
    for b in model.buffers():                                 # the buffers matter: evaluating before averaging
        b.zero_() if b.is_floating_point() else None          # would have given other figures
    assert single.run(4, model)["p"]["auc"] != recs["p"]["auc"]
    model[1].running_var.fill_(7.0)
    model[1].running_mean.fill_(7.0)
    assert main.maybe_run(5, True, model) is not None and main.comm.calls == ["eval.4", "eval.5"]
    with pytest.raises(FileNotFoundError):                   # the main rank does read, and fails early
        Evaluator([str(tmp_path / "only-on-rank0.h5")], every=2, comm=_FakeComm(0))
