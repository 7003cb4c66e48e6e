"""The method's claims under real horovodrun (Gloo, and MPI): no mocked Horovod.

Each launch has a timeout, so a hang shows as a failure, not a stuck CI. The ``hvd-partialfc train`` runs
that tests only inspect afterwards run after the core scenario in one launch (the ``runs`` fixture: the Gloo
launch that tests/helpers_np2.py shares with other files' two-rank work; under MPI the ``runs_mpi`` fixture's).
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import helpers_np2
from conftest import ROOT, build_shards, make_feature_npz, read_json_lines, require_horovod, run_hvd

pytestmark = pytest.mark.multirank


def _ranks(out, n):
    return [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(n)]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_np2_identity_averaged_update_no_leakage(request, backend):
    """scenarios.py's core scenario (4 steps, image shards) under horovodrun with Gloo and with MPI: in the
    ``runs`` launch and in the ``runs_mpi`` one, before their ``hvd-partialfc train`` runs."""
    out = (request.getfixturevalue("runs") if backend == "gloo" else request.getfixturevalue("runs_mpi")).core()
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
    # ... and the saved state (parameters and buffers) is bitwise every rank's; each rank trains on with its
    # own statistics, as it would have without this (unscheduled) checkpoint
    assert r0["full_digest_after_checkpoint"] == r1["full_digest_after_checkpoint"]
    assert r0["live_buffers_kept"] and r1["live_buffers_kept"]


def _np1_items(request, folder):
    """The np1 scenario (6 steps) for K = 1 and 2, items of the one-rank process that tests/helpers_np2.py
    shares with other files' one-rank work: Horovod alone (size 1) needs no launcher."""
    shards = request.getfixturevalue("feature_shards")
    return [{"scenario": f"k{k}", "call": "scenarios.scenario_np1", "args": [shards, folder(f"k{k}"), 6, k]}
            for k in (1, 2)]


NP1_PART = helpers_np2.Part("multirank", fixture="np1_runs", build=_np1_items, timeout=180, np=1)


@pytest.fixture(scope="module")
def np1_runs(request):
    """The one-rank process's Launch: ``done("k<K>")``, K's folder."""
    require_horovod()
    return helpers_np2.shared(request, np=1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_np1_equals_plain_pytorch_loop(np1_runs, accumulate):
    """One rank: the trainer == a plain PyTorch loop (same seeds, batches, optimizers), SGD with momentum and
    weight decay, gradient clipping, and (accumulate=2) backward_passes_per_step."""
    r = _ranks(np1_runs.done(f"k{accumulate}"), 1)[0]
    assert r["classifier_moved"] > 0
    assert r["backbone_max_abs_err"] < 1e-5 and r["classifier_max_abs_err"] < 1e-5


def _cli_here(capsys, *args):
    """``hvd-partialfc ARGS`` in this process (the console script is ``sys.exit(main())``): (code, out, err)."""
    from hvd_partialfc.cli import main
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _train_args(shards, out, *sets, steps=None):
    """``hvd-partialfc train``'s arguments."""
    args = ["--shards", str(shards), "--out", str(out)] + (["--steps", str(steps)] if steps is not None else [])
    return args + sum((["--set", s] for s in sets), [])


# --- `hvd-partialfc train` runs under ONE launch (tests/mr/np2_launch.py): each test inspects its own runs --

IMAGE = ["data.batch_size=8", "model.kwargs={width: 8}"]
OPTIONS = [
    ["optim.fp16_compression=true", "optim.backward_passes_per_step=2", "train.precision=bf16"],
    ["train.precision=fp16", "optim.name=adamw", "optim.backbone_lr=0.003", "optim.classifier_lr=0.003",
     "optim.clip_grad_norm=1.0", "optim.schedule=poly", "optim.warmup_steps=3", "train.loss_scale_growth=4",
     "train.log_every=1"],
]


class Runs:
    """The core scenario and the ``hvd-partialfc train`` runs of one launch (``launch``: tests/helpers_np2.py's
    Launch): item NAME's folder holds what its ranks printed and their results, its run folder is
    ``<item folder>/run``; ``data``: the folder of the data sets made for them."""

    def __init__(self, launch, data):
        self.launch, self.data = launch, data

    def folder(self, name):
        return os.path.join(self.launch.folder(name), "run")

    def results(self, name):
        """Both ranks' ``{"code", "seconds", "log"}`` for run ``name``."""
        return self.launch.results(name)

    def core(self):
        """The folder of the core scenario (both ranks' rank-<r>.json)."""
        return self.launch.done("core")

    def finished(self, name):
        """The folder of run ``name``, which exited 0 on both ranks."""
        for r in self.results(name):
            assert r["code"] == 0, r["log"][-4000:]
        return self.folder(name)


def _mislabelled(base):
    """2 shards of 8 classes, a label of rank 0's slice in rank 1's shard."""
    import h5py
    shards = build_shards(make_feature_npz(base / "b.npz", [12] * 8), base / "mislabelled-shards", 2)
    with h5py.File(os.path.join(shards, "shard-00001-of-00002.h5"), "r+") as f:
        y = f["labels"][:]
        y[5] = 1  # a class of rank 0 in rank 1's shard
        f["labels"][:] = y
    return shards


def _core(image_shards, folder):
    """The core scenario (scenarios.py: 4 steps, image shards), as an item of tests/mr/np2_launch.py."""
    return {"scenario": "core", "call": "scenarios.scenario_core", "args": [image_shards, folder("core"), 4]}


def _run(folder, name, shards, *sets, steps=None, expect_error=False):
    """``hvd-partialfc train`` as an item of tests/mr/np2_launch.py, its run folder ``folder(name)/run``."""
    return {"train": name, "args": _train_args(shards, os.path.join(folder(name), "run"), *sets, steps=steps),
            "expect_error": expect_error}


def _np2_items(request, folder):
    """The core scenario (4 steps: test_np2_identity...[gloo]), then ``hvd-partialfc train`` for every test
    below, one run after another (the console script's code, one Horovod start-up): items of the Gloo launch
    that tests/helpers_np2.py shares with other files' two-rank work; the runs that must fail come last.
    What each run shows: its test. Their data: in ``folder("data")``."""
    feature_shards, image_shards = (request.getfixturevalue(f) for f in ("feature_shards", "image_shards"))
    base = pathlib.Path(folder("data"))
    base.mkdir(parents=True)
    uneven = build_shards(make_feature_npz(base / "u.npz", [10] * 10 + [30] * 10), base / "uneven-shards", 2)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 32, 32), dtype=np.uint8)
    pairs = rng.integers(0, 40, size=(60, 2))
    from data_tools.pair_sets import write_pairs_h5
    write_pairs_h5(str(base / "held.h5"), images, pairs, np.arange(60) % 2 == 0)
    mislabelled = _mislabelled(base)
    truncated = build_shards(make_feature_npz(base / "t.npz", [12] * 8), base / "truncated-shards", 2)
    path = os.path.join(truncated, "shard-00001-of-00002.h5")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    return [
        _core(image_shards, folder),
        _run(folder, "cli", feature_shards, "model.name=mlp", "data.batch_size=16", "train.log_every=5",
             "head.loss=cosface", "head.scale=16", "head.margin=0.2", "train.epochs=3"),
        _run(folder, "uneven", uneven, "model.name=mlp", "data.batch_size=10", "train.epochs=2.5"),
        *(_run(folder, f"options{i}", image_shards, *IMAGE, "head.scale=16", "train.log_every=2", *o, steps=12)
          for i, o in enumerate(OPTIONS)),
        _run(folder, "eval", image_shards, *IMAGE, "eval.every=5", f"eval.pairs=[{base / 'held.h5'}]", steps=12),
        _run(folder, "eval-missing", image_shards, *IMAGE, f"eval.pairs=[{base / 'missing.h5'}]", steps=3,
             expect_error=True),
        _run(folder, "mislabelled", mislabelled, "model.name=mlp", "data.batch_size=8", steps=5, expect_error=True),
        _run(folder, "truncated", truncated, "model.name=mlp", "data.batch_size=8", steps=5, expect_error=True),
    ]


NP2_PART = helpers_np2.Part("multirank", fixture="runs", build=_np2_items, timeout=400)


@pytest.fixture(scope="module")
def runs(request):
    """The Runs of ``_np2_items`` (Gloo, in the shared launch)."""
    launch = helpers_np2.shared(request)
    return Runs(launch, pathlib.Path(launch.folder("data")))


@pytest.fixture(scope="module")
def runs_mpi(image_shards, tmp_path_factory):
    """The same under MPI (``horovodrun --mpi``), ONE launch of its own: the core scenario, then the mislabelled
    run."""
    base = tmp_path_factory.mktemp("runs_mpi")
    folder = lambda name: str(base / name)  # noqa: E731
    items = [_core(image_shards, folder),
             _run(folder, "mislabelled", _mislabelled(base), "model.name=mlp", "data.batch_size=8", steps=5,
                  expect_error=True)]
    return Runs(helpers_np2.launch(base, items, backend="mpi", timeout=400), base)


def test_cli_train_loss_falls_then_info_and_export(runs, tmp_path, capsys):
    """``hvd-partialfc train`` at np=2: an epoch count becomes epochs x steps per epoch, the loss halves;
    ``info`` reports both ranks' slices and agreeing digests; ``export`` writes a backbone that loads with
    plain torch (no Horovod imported, by export or by loading), and refuses a run whose ranks recorded
    different digests."""
    run = runs.finished("cli")
    metrics = read_json_lines(os.path.join(run, "metrics.jsonl"))
    assert metrics[-1]["step"] == 3 * (24 * 20 // 16)  # epochs x steps per epoch
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"]
    code, out, err = _cli_here(capsys, "info", run, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["world_size"] == 2 and info["digests_agree"]
    assert [r["classifier_shape"] for r in info["ranks"]] == [[20, 128], [20, 128]]
    assert [(r["label_start"], r["label_end"]) for r in info["ranks"]] == [(0, 20), (20, 40)]
    out = tmp_path / "backbone.pt"
    # export, then load with plain torch and rebuild the model, in a process where Horovod is never imported
    code = ("import sys, torch; from hvd_partialfc.cli import main; "
            "assert main(['export', sys.argv[2], '--rank', '1', '--out', sys.argv[1]]) == 0; "
            "d = torch.load(sys.argv[1], weights_only=True); "
            "from hvd_partialfc.models.pretrained import load_backbone; m, a = load_backbone(sys.argv[1]); "
            "assert 'horovod' not in sys.modules; print(a['name'], d['digest'][:8])")
    r = subprocess.run([sys.executable, "-c", code, str(out), run], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2] == "mlp"

    # a run whose ranks recorded different digests: export refuses with a clear error
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    ck = os.path.join(bad, "checkpoints", open(os.path.join(bad, "checkpoints", "latest")).read().strip())
    meta = json.load(open(os.path.join(ck, "meta.json")))
    meta["digests"][1] = "0" * 64
    json.dump(meta, open(os.path.join(ck, "meta.json"), "w"))
    code, _, err = _cli_here(capsys, "export", bad, "--rank", "0", "--out", tmp_path / "x.pt")
    assert code != 0 and "backbones differ" in err
    assert not (tmp_path / "x.pt").exists()


def test_uneven_shards_same_steps_no_hang(runs):
    """Rank 1 holds 3x the samples of rank 0: the step count is agreed (min over ranks: 2.5 x rank 0's 10
    steps per epoch = 25, where rank 1 alone would run 75), and rank 0 cycles its data past its epoch (and
    stops mid-epoch) instead of stopping early; no rank hangs, the backbones agree."""
    from hvd_partialfc.tools.export import run_summary
    info = run_summary(runs.finished("uneven"))
    assert info["step"] == int(2.5 * (100 // 10)) and info["digests_agree"]


def _label_outside_slice_reported(codes, text):
    assert all(c != 0 for c in codes)
    # every rank exits, none waits; the failure is agreed, so rank 0 alone prints it (once a job)
    assert "[rank 0] error" in text and "[rank 1] error" not in text
    assert "shard-00001-of-00002.h5 holds label 1" in text and "rank 1:" in text


def test_label_outside_slice_fails_on_every_rank(runs):
    """A label of rank 0's slice in rank 1's shard: every rank stops at start-up, naming the shard (gloo)."""
    r0, r1 = runs.results("mislabelled")
    _label_outside_slice_reported([r0["code"], r1["code"]], r0["log"] + r1["log"])


def test_label_outside_slice_fails_on_every_rank_mpi(runs_mpi):
    """The same under MPI (``horovodrun --mpi``: the runs_mpi launch)."""
    r0, r1 = runs_mpi.results("mislabelled")
    _label_outside_slice_reported([r0["code"], r1["code"]], r0["log"] + r1["log"])


def test_truncated_shard_on_one_rank_fails_on_every_rank(runs):
    """h5py alone says "truncated file: eof = ..." without a file name; every rank must name the file, the
    rank that holds it and the command that checks the set (no traceback), and exit at start-up."""
    r0, r1 = runs.results("truncated")
    shards = os.path.join(runs.data, "truncated-shards")
    path = os.path.join(shards, "shard-00001-of-00002.h5")
    text = r0["log"] + r1["log"]
    assert r0["code"] != 0 and r1["code"] != 0 and max(r0["seconds"], r1["seconds"]) < 60
    assert "[rank 0] error" in r0["log"] and "[rank 1] error" not in r1["log"]   # agreed: rank 0 reports it
    assert f"rank 1: {path}: cannot open shard file (h5py: " in text
    assert "the file is truncated or not HDF5; copy the set again" in text
    assert f"`hvd-partialfc-shards inspect {shards}`" in text
    assert "Traceback" not in text
    assert not os.path.exists(os.path.join(runs.folder("truncated"), "checkpoints"))


@pytest.mark.parametrize("which", range(len(OPTIONS)), ids=["options0", "options1"])
def test_options_train_and_stay_identical(runs, which):
    """Each option set trains 12 steps under horovodrun (loss finite and falling, backbones identical), and
    its options were applied, not only accepted: the lr follows the configured schedule, fp16 keeps a loss
    scale (halved at a skipped step, grown after ``train.loss_scale_growth`` finite ones), AdamW its moments."""
    from hvd_partialfc.tools.export import run_summary
    options = OPTIONS[which]
    run = runs.finished(f"options{which}")
    info = run_summary(run)
    assert info["step"] == 12 and info["digests_agree"]
    metrics = read_json_lines(os.path.join(run, "metrics.jsonl"))
    assert all(np.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    from hvd_partialfc.config_io import load_config
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
    from hvd_partialfc.run_files import load_file, resolve_checkpoint
    state = load_file(os.path.join(resolve_checkpoint(run), "backbone.pt"))["optimizer"]["state"]
    assert ("exp_avg" in next(iter(state.values()))) == ("optim.name=adamw" in options)


def test_evaluation_during_training_np2(runs):
    """Rank 0 evaluates every 5 steps and at the end, after all ranks averaged their BatchNorm buffers; a
    pair set that does not exist is an agreed error before training, on every rank."""
    from hvd_partialfc.verification.verify_pairs import evaluate_backbone
    from hvd_partialfc.models.pretrained import load_backbone
    from hvd_partialfc.tools.export import run_summary
    from hvd_partialfc.data.pair_files import read_pairs
    run = runs.finished("eval")
    evals = read_json_lines(os.path.join(run, "eval.jsonl"))
    assert [e["step"] for e in evals] == [5, 10, 12] and all(e["set"] == "held" for e in evals)
    assert all(0.0 <= e["auc"] <= 1.0 for e in evals)
    assert run_summary(run)["digests_agree"]
    # the final evaluation saw the averaged statistics: it scores as the final checkpoint's backbone (whose
    # BatchNorm buffers are the pooled ones, checked in the core scenario) does offline; rank 0's own
    # statistics would move every score, hence the best threshold
    model, _ = load_backbone(run)
    from hvd_partialfc.run.startup import rank_threads
    threads = torch.get_num_threads()     # the ranks' count (2 ranks on this host): the convolutions round
    torch.set_num_threads(rank_threads(2))  # differently with another, and a score's round-off moved a fold's
    try:                                    # threshold
        ref = evaluate_backbone(model, read_pairs(str(runs.data / "held.h5")), roc=False)
    finally:
        torch.set_num_threads(threads)
    assert evals[-1]["best_threshold"] == pytest.approx(ref["best_threshold"], abs=1e-5)
    assert evals[-1]["auc"] == pytest.approx(ref["auc"], abs=1e-9)
    assert evals[-1]["acc"] == pytest.approx(ref["acc"], abs=1e-9)
    # a pair set that does not exist: an agreed error before training, on every rank (none trained), which
    # rank 0 alone prints
    r0, r1 = runs.results("eval-missing")
    assert r0["code"] != 0 and "[rank 0] error" in r0["log"] and "missing.h5" in r0["log"], r0["log"]
    assert r1["code"] != 0 and "[rank 1] error" not in r1["log"], r1["log"]
    assert not os.path.exists(os.path.join(runs.folder("eval-missing"), "checkpoints"))


def test_a_stuck_loader_worker_ends_the_job_naming_it(small_run_shards, tmp_path):
    """Rank 0's loader worker is stopped (SIGSTOP: alive, sending nothing, as on a stalled file system) before
    step 4 under horovodrun, which bounds no late rank: before, both ranks waited for ever. Now rank 0 stops
    after data.batch_timeout (2 s, once its 4 prefetched batches are used), naming the worker and its state,
    kills it, and exits; rank 1 hears it gone (the heartbeat, 5 s) and ends too. DataLoader's own timeout did
    not do it: it bounds the queue's poll, and the batch's tensors are then fetched from the stopped worker."""
    from conftest import small_run_argv
    args = small_run_argv(small_run_shards, tmp_path / "run", 40, ["data.workers=1", "data.batch_timeout=2"])
    t0 = time.monotonic()
    proc = run_hvd(2, args, check=False, timeout=120, env={"HVD_PARTIALFC_FAULT": "hang-worker@3:0"})
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "injected hang-worker before step 4" in text, text[-4000:]
    assert "LoaderStalled: rank 0: no batch from its loader workers in 2 s (data.batch_timeout)" in text, text[-4000:]
    assert "stopped (T) (killed)" in text and "<stderr>:Traceback" not in text, text[-4000:]   # horovodrun's own may
    assert "lost peer rank 0" in text, text[-4000:]
    assert took < 60, took
    assert not any("hvd_partialfc" in " ".join(p) for p in _stopped_processes())


def _stopped_processes():
    """The command lines of this machine's stopped processes (a worker left behind would be one)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except (OSError, IndexError):
            continue
        if state == "T":
            out.append(cmd)
    return out
