"""scripts/studies/scale_study.py (the scale study) on tiny sets: cells run, tables written, finished cells skipped,
a killed cell resumed from its checkpoint; and data_tools.subset's prefix manifests (the fixed
classes-per-rank series)."""
import contextlib
import importlib
import json
import os
import re

import h5py
import numpy as np
import pytest
import yaml

from conftest import ROOT, build_shards, make_image_npz

from data_tools.pair_sets import write_pairs_h5
from data_tools.subset import write_prefix_subset
from hvd_partialfc.data.loader import RankShardDataset
from hvd_partialfc.data.shards import read_manifest


def _strings(obj):
    """Every string of a nested JSON / YAML value."""
    if isinstance(obj, str):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
    return [t for v in items for t in _strings(v)]


def _launch_script(name: str):
    """scripts/studies/NAME.py as a module (``python -m scripts.studies.NAME`` runs the same)."""
    return importlib.import_module(f"scripts.studies.{name}")


def _study():
    return _launch_script("scale_study")


def _cli_here(argv, log=None):
    """The study's ``_cli`` (one ``hvd-partialfc ARGV`` in a fresh process from the repository root) run in this
    process instead: the same command, ~4 CPU-seconds of interpreter start saved. Its output goes to ``log``
    (appended) as there; a failure stops the study as there. The study's own ``_cli`` still runs the killed
    training (its failure) and the last evaluation (its success) in fresh processes. Threads and random
    states are put back, as other in-process runs of the CLI do (tests/test_evaluate.py)."""
    import random
    import torch
    from hvd_partialfc.cli import main
    threads, rngs = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        with open(log, "a") if log else open(os.devnull, "w") as sink, contextlib.chdir(ROOT), \
                contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            code = main(argv)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rngs[0]), np.random.set_state(rngs[1]), random.setstate(rngs[2])
    if code != 0:
        raise SystemExit(f"`hvd-partialfc {' '.join(argv)}` failed (exit {code})" + (f":\n{open(log).read()[-4000:]}"
                                                                                   if log else ""))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Training: 16 classes x 8 images in 4 shards (4 classes each); held out: 20 classes x 10 images and
    40 pairs of them."""
    d = tmp_path_factory.mktemp("scale")
    train = build_shards(make_image_npz(d / "t.npz", 16, 8), d / "train", 4)
    held = build_shards(make_image_npz(d / "h.npz", 20, 10, seed=1), d / "heldout", 1)   # 17,100 impostor pairs
    z = np.load(d / "h.npz")
    rng = np.random.default_rng(0)
    pairs = rng.integers(0, len(z["labels"]), (40, 2))
    pairs[::2, 1] = pairs[::2, 0] // 10 * 10 + (pairs[::2, 0] + 1) % 10        # every other pair: same class
    write_pairs_h5(str(d / "pairs.h5"), z["images"], pairs, z["labels"][pairs[:, 0]] == z["labels"][pairs[:, 1]],
                   z["labels"])
    return d, train, held, str(d / "pairs.h5")


def test_prefix_subset_is_a_shard_set_of_the_first_shards(sets, tmp_path):
    d, train, _, _ = sets
    src = read_manifest(train)
    sub = write_prefix_subset(train, str(tmp_path / "first2"), 2)
    assert sub.num_shards == 2 and sub.num_classes == src.shards[1].label_end == 8
    assert all(not os.path.isabs(e.file) for e in sub.shards)
    for rank in (0, 1):                        # 2 ranks on the subset: 4 classes each, the source's samples
        ds = RankShardDataset(str(tmp_path / "first2"), rank, 2)
        assert (ds.label_slice.start, ds.label_slice.end) == (4 * rank, 4 * rank + 4)
        with h5py.File(os.path.join(train, src.shards[rank].file)) as f:
            want_x, want_y = f["images"][:], f["labels"][:]
        x, y = ds[list(range(len(ds)))]
        np.testing.assert_array_equal(x.numpy(), want_x)
        np.testing.assert_array_equal(y.numpy() + 4 * rank, want_y)
    mtime = os.stat(tmp_path / "first2" / "manifest.json").st_mtime_ns
    write_prefix_subset(train, str(tmp_path / "first2"), 2)          # same content: not rewritten (its sha256
    assert os.stat(tmp_path / "first2" / "manifest.json").st_mtime_ns == mtime   # is in every checkpoint)
    with pytest.raises(ValueError, match="prefix of 5 shards"):
        write_prefix_subset(train, str(tmp_path / "x"), 5)


def test_study_runs_cells_writes_tables_and_skips_finished_cells(sets, tmp_path, monkeypatch, capsys):
    d, train, held, pairs = sets
    study = _study()
    out = tmp_path / "study"
    argv = ["--shards", train, "--heldout", held, "--pairs", pairs, "--out", str(out), "--ranks", "2", "4",
            "--first", "2", "4", "--seeds", "0", "--variants", "local", "--fixed-variants", "local",
            "--steps", "5", "--global-batch", "16", "--checkpoint-every", "3", "--log-every", "1",
            "--set", "model.kwargs={width: 4}", "--set", "model.embedding_dim=16", "--set", "optim.warmup_steps=2",
            "--set", "eval.batch_size=64", "--keep", str(tmp_path / "keep")]
    with monkeypatch.context() as here:                 # the first two cells' commands in this process
        here.setattr(study, "_cli", _cli_here)
        assert study.main(argv + ["--max-cells", "2"]) == 0
    # the kept copies carry the finished cells to a fresh OUT (another session, another machine)
    assert sorted(os.listdir(tmp_path / "keep")) == ["local-n2-seed0.json", "local-n4-seed0.json"]
    fresh = [a if a != str(out) else str(tmp_path / "fresh") for a in argv]
    capsys.readouterr()
    assert study.main(fresh + ["--dry-run"]) == 0 and "3 cells, 1 to run" in capsys.readouterr().out
    # a kept cell measured on other data stops the study instead of joining the table; the data are what the
    # files hold: a cell whose file bytes differed (a rebuild elsewhere) but whose arrays agree joins it
    kept = json.load(open(tmp_path / "keep" / "local-n2-seed0.json"))
    parsed = study.parse(argv)
    assert kept["done"]["data_sha256"] == study.data_sha256(parsed)
    assert kept["done"]["data_content_sha256"] == study.data_content_sha256(parsed)
    other = [a if a != str(tmp_path / "keep") else str(tmp_path / "keep2") for a in fresh]
    os.makedirs(tmp_path / "keep2")

    def planned_with(**done):
        cell = json.loads(json.dumps(kept))
        cell["done"].update(done)
        for k in [k for k, v in done.items() if v is None]:
            del cell["done"][k]
        json.dump(cell, open(tmp_path / "keep2.json", "w"))
        os.replace(tmp_path / "keep2.json", tmp_path / "keep2" / "local-n2-seed0.json")
        capsys.readouterr()
        return study.main(other + ["--dry-run"]) == 0 and "3 cells, 2 to run" in capsys.readouterr().out

    assert planned_with(data_sha256="0" * 64)                            # other bytes, the same arrays
    with pytest.raises(SystemExit, match="measured on other data.*data_content_sha256"):
        planned_with(data_content_sha256="0" * 64)
    with pytest.raises(SystemExit, match="measured on other data.*data_sha256"):   # an older cell: bytes only
        planned_with(data_sha256="0" * 64, data_content_sha256=None)
    # planned: local-n2, local-n4 (every class), local-n2-1sh (2 of 4 shards); N=4 x 1 shard = the whole set
    names = ["local-n2-seed0", "local-n4-seed0", "local-n2-1sh-seed0"]
    assert [os.path.isfile(out / n / "done.json") for n in names] == [True, True, False]
    s = json.load(open(out / "study.json"))
    assert s["settings"]["cells_planned"] == 3 and s["settings"]["cells_done"] == 2
    rows = {r["cell"]: r for r in s["cells"]}
    assert rows["local-n4-seed0"]["per_rank_batch"] == 4 and rows["local-n2-seed0"]["per_rank_batch"] == 8
    for r in rows.values():
        for k in ("ap_tar@far=1e-3", "ap_tar@far=1e-4", "acc", "train_s", "eval_s", "extra_vs_grad",
                  "iresnet50_extra_vs_grad", "classes_per_rank"):
            assert k in r
        assert 0.0 <= r["acc"] <= 1.0
    # extra traffic of local's default negatives (every 50 steps, whole slices of 16 / N classes): an
    # all-gather of W x D x 4 bytes hands in one share and gets N back; the gradient allreduce 2 x P x 4
    from hvd_partialfc.models import create_model
    p = sum(t.numel() for t in create_model("resnet", in_shape=[32, 32], embedding_dim=16, width=4).parameters())
    for n in (2, 4):
        want = (n + 1) * (16 // n) * 16 * 4 / 50 / (2 * p * 4)
        assert rows[f"local-n{n}-seed0"]["extra_vs_grad"] == pytest.approx(want)
    table = {(t["series"], t["n"], t["variant"]): t for t in s["table"]}
    assert table[("all", 4, "local")]["classes_per_rank"] == 4 and table[("all", 2, "local")]["seeds"] == [0]
    md = open(out / "study.md").read()
    assert "| all | 4 | 4 | 4 | local | 0 |" in md and os.path.getsize(out / "study.png") > 0
    strings = _strings(json.load(open(out / "study.json")))                  # no absolute paths anywhere
    for n in names[:2]:
        strings += _strings(json.load(open(out / n / "done.json"))) + _strings(json.load(open(out / n / "eval.json")))
        strings += _strings(yaml.safe_load(open(out / n / "config.yaml")))
    assert strings and not [t for t in strings if os.path.isabs(t) or t.startswith(str(tmp_path))]
    assert not re.search(r"[`(\s]/[A-Za-z]", md)
    assert all(r["ap_tar@far=1e-3"] is not None and r["ap_tar@far=1e-4"] is not None for r in rows.values())
    before = {n: (os.stat(out / n / "done.json").st_mtime_ns, os.stat(out / n / "metrics.jsonl").st_mtime_ns)
              for n in names[:2]}
    monkeypatch.setenv("HVD_PARTIALFC_FAULT", "kill@4")     # the third cell dies after its step-3 checkpoint
    with pytest.raises(SystemExit, match="failed"):
        study.main(argv)
    assert not os.path.isfile(out / names[2] / "done.json")
    monkeypatch.delenv("HVD_PARTIALFC_FAULT")
    fresh_process = study._cli                               # the rest: the third cell, resumed at step 3 (its
    with monkeypatch.context() as here:                      # training here, its evaluation in a fresh process)
        here.setattr(study, "_cli", lambda cmd, log=None: (fresh_process if cmd[0] == "eval" else _cli_here)(cmd, log))
        assert study.main(argv) == 0
    steps = [m["step"] for m in map(json.loads, open(out / names[2] / "metrics.jsonl")) if "loss" in m]
    assert steps.count(1) == 1 and steps[-1] == 5 and steps.count(4) == 2, steps
    assert json.load(open(out / names[2] / "trained.json"))["train_sessions"] == 2
    assert {n: (os.stat(out / n / "done.json").st_mtime_ns, os.stat(out / n / "metrics.jsonl").st_mtime_ns)
            for n in names[:2]} == before                                     # not retrained, not re-evaluated
    s = json.load(open(out / "study.json"))
    fixed = {r["cell"]: r for r in s["cells"]}["local-n2-1sh-seed0"]
    src = read_manifest(train)
    assert fixed["classes"] == src.shards[1].label_end and fixed["classes_per_rank"] == src.shards[0].label_end
    assert fixed["shards"] == os.path.relpath(str(out / "subsets" / "first-2-shards"), ROOT)
    # the fixed series ends at N = 4 (4 x 1 shards = the whole set) on the whole-set cell, not run twice
    assert s["settings"]["cells_done"] == 3 and len(s["cells"]) == 3
    table = {(t["series"], t["n"], t["variant"]): t for t in s["table"]}
    end, whole = table[("fixed", 4, "local")], table[("all", 4, "local")]
    assert end["same_cell_as_all"] and not whole["same_cell_as_all"] and not table[("fixed", 2, "local")]["same_cell_as_all"]
    assert {k: v for k, v in end.items() if k not in ("series", "same_cell_as_all")} == \
        {k: v for k, v in whole.items() if k not in ("series", "same_cell_as_all")}
    assert "| fixed = all | 4 | 4 | 4 | local | 0 |" in open(out / "study.md").read()


def test_row_geometry_cosines_of_known_rows(tmp_path, capsys):
    # two slices written as a checkpoint: slice 0's three rows point the same way (every cosine 1), slice 1's
    # three are orthogonal (0): the script's figures are those, and the nearest row over all is 1 for a row
    # of slice 0 and 0 for one of slice 1 (mean over every row: 0.5)
    import torch
    from hvd_partialfc.run_files import FORMAT_VERSION, classifier_file, step_dir_name
    rg = _launch_script("row_geometry")
    ckpt = tmp_path / "run" / "checkpoints" / step_dir_name(2)
    ckpt.mkdir(parents=True)
    same = torch.tensor([[1.0, 1.0, 0, 0, 0, 0]]) * torch.tensor([[1.0], [2.0], [0.5]])
    orth = torch.zeros(3, 6)
    orth[0, 2], orth[1, 3], orth[2, 4] = 1.0, 3.0, 2.0
    names = []
    for r, (w, start) in enumerate([(same, 0), (orth, 3)]):
        names.append(classifier_file(r, 2))
        torch.save({"weight": w, "label_start": start, "label_end": start + 3}, ckpt / names[-1])
    (ckpt / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "slices": [[0, 3], [3, 6]],
                                                "classifier_files": names}))
    (ckpt.parent / "latest").write_text(step_dir_name(2))
    assert rg.main([str(tmp_path / "run"), "--json", str(tmp_path / "g.json")]) == 0
    g = json.load(open(tmp_path / "g.json"))[0]
    assert g["rows"] == 6 and g["checkpoint"] == "step-00000002" and g["overall_sampled_rows"] == 6
    assert g["within_slice_pair_cos"] == pytest.approx(0.5) and g["within_slice_nearest_cos"] == pytest.approx(0.5)
    assert g["overall_nearest_cos"] == pytest.approx(0.5)
    assert g["row_norm_mean"] == pytest.approx((2 ** 0.5 * 3.5 + 6.0) / 6)
    assert "| run | 6 |" in capsys.readouterr().out
