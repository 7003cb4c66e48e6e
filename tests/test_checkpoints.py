"""Checkpoints that never lose a run and loads that run no code: keep-last-k by write order,
supersede instead of delete, dangling `latest`, diverged saves, agreed resume, nothing rewritten at the
end, weights_only loads and the format upgrade, replicated re-sharding and clipping, skip limits,
preemption by signal. Multi-rank behaviour runs under real horovodrun (the scenarios under one launch); file
logic runs in this process under `simulate` (one virtual rank: a run alone, without the start-up of a process)."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import (MR, ROOT, build_shards, launch_env, simulate_here, make_feature_npz, read_json_lines,
                      run_hvd, signal_rank_1_once_checkpointing)

BASE = ["model.name=mlp", "data.batch_size=8", "train.log_every=5", "data.workers=0", "head.negatives_every=0"]


@pytest.fixture(scope="module")
def shards2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    return build_shards(make_feature_npz(d / "f.npz", [16] * 12, seed=5), d / "s2", 2)


def sim(ranks, shards, out, steps, sets=(), fault=None, timeout=120):
    """``hvd-partialfc simulate --ranks N`` with BASE and ``sets``, through its API in this process
    (conftest.simulate_here): no interpreter or Horovod start-up, for the file logic that needs no real
    Horovod (one rank: what a run alone, without a launcher, does). ``fault``: ``HVD_PARTIALFC_FAULT`` for
    the run. Returns the SimResult or raises ``SimFailure`` (``.error``: the rank's exception)."""
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.run.watch.faults import ENV
    cfg = load_config(None, [*BASE, *sets, f"data.shards={shards}", f"out={out}", f"train.steps={steps}"])
    saved = os.environ.pop(ENV, None)
    if fault:
        os.environ[ENV] = fault
    try:
        return simulate_here(cfg, ranks, timeout)
    finally:
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved


def cli_here(capsys, *args):
    """``hvd-partialfc ARGS`` in this process (the console script is ``sys.exit(main())``): (code, out, err)."""
    from hvd_partialfc.cli import main
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def latest(run):
    return open(os.path.join(run, "checkpoints", "latest")).read().strip()


def steps_in(run):
    from hvd_partialfc.run_files import list_checkpoints
    return list_checkpoints(str(run))


# --- 1. keep-last-k by write order; newer checkpoints moved aside; dangling latest ------------------------

def test_resume_from_older_checkpoint_never_loses_latest(shards2, tmp_path, capfd):
    """A run resumed from an older checkpoint moves the newer ones (and ``latest``) aside, saying so, instead
    of deleting them; keep-last-k counts by write order; the next launch resumes where the last one stopped."""
    from hvd_partialfc.run.simulate import SimFailure
    run = tmp_path / "run"
    sim(1, shards2, run, 20, ["checkpoint.every=10", "checkpoint.keep=2"])
    assert steps_in(run) == ["step-00000010", "step-00000020"]
    # resume from step 10 with keep=1; die before step 16 (after the save at 15)
    capfd.readouterr()
    with pytest.raises(SimFailure) as died:
        sim(1, shards2, run, 20, ["checkpoint.every=5", "checkpoint.keep=1",
                                  f"checkpoint.resume={run}/checkpoints/step-00000010"], fault="raise@15")
    assert type(died.value.error).__name__ == "InjectedFault"
    said = "".join(capfd.readouterr())
    assert "moved to" in said and "step-00000020" in said          # said, not silent
    assert latest(run) == "step-00000015" and steps_in(run) == ["step-00000015"]
    aside = [d for d in os.listdir(run / "checkpoints") if d.startswith("superseded-")]
    assert len(aside) == 1 and sorted(os.listdir(run / "checkpoints" / aside[0])) == ["latest", "step-00000020"]
    # the next launch resumes where the last one stopped, not from step 0
    sim(1, shards2, run, 20, ["checkpoint.every=5", "checkpoint.keep=1", "checkpoint.resume=auto"])
    assert "at step 15" in "".join(capfd.readouterr())
    assert latest(run) == "step-00000020"


def test_dangling_latest_is_an_error_never_a_fresh_start(tmp_path):
    from hvd_partialfc.run_files import CheckpointError, find_resume
    base = tmp_path / "run" / "checkpoints"
    base.mkdir(parents=True)
    (base / "latest").write_text("step-00000015\n")
    with pytest.raises(CheckpointError, match=r"latest names 'step-00000015', which is not a complete checkpoint"):
        find_resume(str(tmp_path / "run"))
    # no latest but complete checkpoints (a crash between the rename and the move of latest): the newest
    (base / "latest").unlink()
    for s in (5, 10):
        (base / f"step-{s:08d}").mkdir()
        (base / f"step-{s:08d}" / "meta.json").write_text("{}")
    (base / "step-00000015.partial").mkdir()
    assert find_resume(str(tmp_path / "run")) == str(base / "step-00000010")
    assert find_resume(str(tmp_path / "empty")) is None


# --- 4. nothing to train: nothing rewritten -------------------------------------------------------------

def test_relaunching_a_finished_run_rewrites_nothing(shards2, tmp_path, capfd):
    """Launching a finished run again trains nothing and rewrites nothing (same inodes, same mtimes)."""
    run = tmp_path / "run"
    sim(1, shards2, run, 6)
    ck = run / "checkpoints" / "step-00000006"
    before = {f: (os.stat(ck / f).st_ino, os.stat(ck / f).st_mtime_ns) for f in os.listdir(ck)}
    folder = os.stat(ck).st_ino
    capfd.readouterr()
    sim(1, shards2, run, 6, ["checkpoint.resume=auto"])
    assert "nothing to train" in capfd.readouterr().out
    assert os.stat(ck).st_ino == folder
    assert {f: (os.stat(ck / f).st_ino, os.stat(ck / f).st_mtime_ns) for f in os.listdir(ck)} == before


# --- 6. loads that run no code; format version and upgrade ----------------------------------------------

class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoint_files_with_code_are_refused(shards2, tmp_path, capsys):
    """A checkpoint or exported file holding a pickled callable is refused by ``info``, ``eval`` and resume,
    with a message and no traceback, and the callable never runs (the marker file is never written)."""
    from hvd_partialfc.run.simulate import SimFailure
    run = tmp_path / "run"
    sim(1, shards2, run, 4)
    ck = run / "checkpoints" / "step-00000004"
    marker = tmp_path / "pwned"
    good = torch.load(ck / "classifier-00000-of-00001.pt", weights_only=True)
    good["evil"] = _Payload(str(marker))
    torch.save(good, ck / "classifier-00000-of-00001.pt")
    bb = torch.load(ck / "backbone.pt", weights_only=True)
    bb["evil"] = _Payload(str(marker))
    exported = tmp_path / "downloaded.pt"
    torch.save(bb, exported)
    for args in (["info", run], ["eval", "--backbone", exported, "--pairs", tmp_path / "x.h5"]):
        code, _, err = cli_here(capsys, *args)   # an exception escaping main() would fail here, traceback and all
        assert code != 0 and "refused to load" in err and "Traceback" not in err, err
        assert not marker.exists()
    with pytest.raises(SimFailure) as refused:
        sim(1, shards2, run, 8, ["checkpoint.resume=auto"])
    assert "classifier-00000-of-00001.pt: refused to load" in str(refused.value.error)
    assert not marker.exists()


def _downgrade_to_format1(ck):
    """What hvd_partialfc wrote before format 2: numpy RNG arrays, counters at the top, no version."""
    meta = json.load(open(ck / "meta.json"))
    meta.pop("format_version")
    # config keys added since (2026-12): an older package's run has none of them, and still resumes
    for section, key in (("data", "augment"), ("model", "init_backbone"), ("model", "checkpoint_activations"),
                         ("head", "sampled_step"), ("train", "tensorboard")):
        meta["config"][section].pop(key)
    json.dump(meta, open(ck / "meta.json", "w"))
    for f in meta["classifier_files"]:
        d = torch.load(ck / f, weights_only=True)
        n = d["rng"]["numpy"]
        d["rng"]["numpy"] = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"])
        d.update(d.pop("counters"))
        torch.save(d, ck / f)


def test_format1_checkpoint_upgrades_then_resumes_bitwise(shards2, tmp_path, capsys):
    """A format-1 checkpoint (numpy RNG arrays, counters at the top, no version, older config keys) is
    refused with the command that upgrades it; ``hvd-partialfc upgrade`` converts it, and the run resumed from
    it ends bitwise where the uninterrupted run does."""
    from hvd_partialfc.run.simulate import SimFailure
    straight, run = tmp_path / "straight", tmp_path / "run"
    sim(1, shards2, straight, 8, ["checkpoint.every=4"])
    with pytest.raises(SimFailure):
        sim(1, shards2, run, 8, ["checkpoint.every=4"], fault="raise@4")
    ck = run / "checkpoints" / "step-00000004"
    _downgrade_to_format1(ck)
    with pytest.raises(Exception):
        torch.load(ck / "classifier-00000-of-00001.pt", weights_only=True)
    from hvd_partialfc.run_files import CheckpointError, find_resume, read_meta
    with pytest.raises(CheckpointError, match=r"checkpoint format 1, .* `hvd-partialfc upgrade "):
        read_meta(find_resume(str(run)))   # what resume reads first, on every rank
    code, out, err = cli_here(capsys, "upgrade", run)
    assert code == 0 and "upgraded" in out, err
    sim(1, shards2, run, 8, ["checkpoint.every=4", "checkpoint.resume=auto"])
    # all of it: the backbone (BatchNorm buffers included) and its optimizer, the classifier rows, their
    # optimizer state, the torch stream, the counters and the head's state (tests/pins.py's digests)
    import pins
    want = pins.checkpoint_digests(str(straight / "checkpoints" / "step-00000008"))
    assert pins.checkpoint_digests(str(run / "checkpoints" / "step-00000008")) == want


# --- 2. diverged checkpoints; 9. skip limits (real horovodrun); 8. replicated clipping and re-sharding -----

@pytest.fixture(scope="module")
def np2(shards2, tmp_path_factory):
    """ONE ``horovodrun -np 2`` launch (gloo) for the two-rank items below, one after another in one process
    (mr/checkpoints_launch.py), each into its own folder: ``hvd-partialfc train`` in replicated mode for 4
    steps (for re-sharding); ``train --resume auto`` from node-local run folders whose ``latest`` differ (the
    folders prepared here, by one simulated rank); then the ``diverged``, ``skips``, ``nonfinite`` and
    ``replicated`` scenarios of mr/ckpt_scenarios.py. Returns ``folder(name)``: the item's folder, once both
    ranks finished it."""
    out = tmp_path_factory.mktemp("np2")
    nodes = out / "resolving"
    sim(1, shards2, nodes / "node0", 8, ["checkpoint.every=4", "checkpoint.keep=2"])
    # node-local run folders: rank 1's copy is stale (its latest is step 4)
    shutil.copytree(nodes / "node0", nodes / "node1")
    (nodes / "node1" / "checkpoints" / "latest").write_text("step-00000004\n")

    def train(name, run, steps, *sets, expect_error=False):
        args = ["--shards", shards2, "--out", str(run), "--steps", str(steps)] + sum((["--set", s] for s in sets), [])
        return {"train": name, "args": args, "expect_error": expect_error}
    spec = {"shards": shards2, "out": str(out), "items": [
        train("replicated-run", out / "replicated-run" / "run", 4, *BASE, "head.mode=replicated"),
        train("resolving", nodes / "node{rank}", 12, *BASE, "checkpoint.resume=auto", expect_error=True),
        {"scenario": "diverged"}, {"scenario": "skips"}, {"scenario": "nonfinite"}, {"scenario": "replicated"}]}
    with open(out / "spec.json", "w") as f:
        json.dump(spec, f)
    try:
        proc = run_hvd(2, [os.path.join(MR, "checkpoints_launch.py"), out / "spec.json"], check=False, timeout=300)
    except subprocess.TimeoutExpired:
        proc = None   # the items that ended before still have their results

    def folder(name):
        if not all((out / name / f"done-rank-{r}").exists() for r in range(2)):
            why = "timed out" if proc is None else (
                f"exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}")
            raise AssertionError(f"{name}: not finished on both ranks: the launch {why}")
        return out / name
    return folder


@pytest.mark.multirank
def test_diverged_checkpoint_is_set_aside(np2):
    """Backbones that differ across ranks at a save: every rank raises, the save is set aside as
    ``diverged-step-*`` (every rank's backbone kept), ``latest`` stays on the last good checkpoint."""
    out = np2("diverged")
    r0, r1 = (json.load(open(out / f"rank-{r}.json")) for r in range(2))
    assert r0["raised"] and r1["raised"] and "backbones differ across ranks at step 3" in r0["raised"]
    run = out / "run"
    assert latest(run) == "step-00000002" and steps_in(run) == ["step-00000002"]
    aside = run / "checkpoints" / "diverged-step-00000003"
    assert {"backbone-rank-00000.pt", "backbone-rank-00001.pt", "meta.json"} <= set(os.listdir(aside))


@pytest.mark.multirank
def test_skips_are_counted_and_a_stuck_run_stops(np2):
    """Classifier skips (one rank's NaN gradient) are counted and training goes on; consecutive skipped
    steps (every rank's NaN loss) stop every rank at the limit."""
    out = np2("skips")
    r0, r1 = (json.load(open(out / f"rank-{r}.json")) for r in range(2))
    for r in (r0, r1):  # steps 5, 6, 7 skipped on every rank, then every rank stops
        assert r["stopped_at"] == 7 and r["skipped_steps"] == 3
        assert "3 steps in a row skipped up to step 7" in r["raised"]
    assert r0["classifier_skipped_steps"] == 0 and r1["classifier_skipped_steps"] == 2
    m = [x for x in read_json_lines(out / "run" / "metrics.jsonl") if "loss" in x]
    assert [x["classifier_skipped_steps"] for x in m[:4]] == [0, 1, 2, 2]
    assert [x["skipped_steps"] for x in m] == [0, 0, 0, 0, 0, 1, 2]


@pytest.mark.multirank
def test_nonfinite_loss_stop_and_skip(np2):
    """skip: a NaN on rank 1 at step 2 -> every rank skips that step and no parameter changes; stop (the
    default): a NaN on rank 1 -> every rank stops at that step with the reason, quickly (no rank goes on
    into the next step's collectives). Both in the np2 launch (mr/ckpt_scenarios.py nonfinite; it had a
    launch of its own in tests/test_reliability.py)."""
    out = np2("nonfinite")
    r = [json.load(open(out / f"rank-{i}.json")) for i in range(2)]
    for x in r:
        assert x["skipped_steps"] == 1
        assert x["backbone"][2] == x["backbone"][1] and x["classifier"][2] == x["classifier"][1]
        assert x["backbone"][3] != x["backbone"][2]
    assert r[0]["backbone"] == r[1]["backbone"]
    for i, x in enumerate(r):
        assert x["stop"] and x["stop"].startswith(f"NonFiniteError: rank {i}: non-finite backbone gradient at step 0")
        assert x["stop_seconds"] < 60


@pytest.mark.multirank
def test_replicated_classifier_gradient_is_clipped(np2):
    """Replicated mode: one SGD step with a tiny clip norm moves the backbone and the classifier together by
    lr x clip (the classifier's gradient was left out of the clip, whatever the world size). An item of the
    np2 launch (on each of its 2 ranks; it was a process of its own, one rank alone: ~5 CPU-s)."""
    out = np2("replicated")
    for rank in range(2):
        r = json.load(open(out / f"rank-{rank}.json"))
        assert r["classifier_update_norm"] > 0
        assert abs(r["update_norm"] - r["expected"]) < 1e-3 * r["expected"]


@pytest.mark.multirank
def test_replicated_checkpoint_reshards(np2, shards2, tmp_path, capsys):
    """A replicated-mode checkpoint of 2 ranks re-shards to 1 (every row, label_end the class count), and a
    run resumes from the result."""
    run = np2("replicated-run") / "run"
    new = tmp_path / "new"
    code, _, err = cli_here(capsys, "reshard", run, "--world-size", "1", "--out", new)
    assert code == 0, err
    old = torch.load(run / "checkpoints" / "step-00000004" / "classifier-00000-of-00002.pt", weights_only=True)
    mine = torch.load(new / "classifier-00000-of-00001.pt", weights_only=True)
    assert torch.equal(old["weight"], mine["weight"]) and mine["label_end"] == 12
    result = sim(1, shards2, tmp_path / "cont", 6, ["head.mode=replicated", f"checkpoint.resume={new}"])
    # train.steps=6 steps of 2 ranks (run/progress.py): the 2 steps left are 4 at one rank
    assert result.checkpoint.endswith("step-00000008")


# --- 3. ranks that resolve different checkpoints stop, naming them -----------------------------------------

@pytest.mark.multirank
def test_ranks_resolving_different_checkpoints_stop(np2):
    """Node-local run folders whose ``latest`` differ (rank 0's: step 8, rank 1's: step 4): every rank stops at
    start-up naming each rank's checkpoint; nothing is trained or written."""
    nodes = np2("resolving")
    for r in range(2):
        result = json.load(open(nodes / f"rank-{r}.result.json"))
        assert result["code"] != 0 and result["seconds"] < 60
    for text in (open(nodes / f"rank-{r}.log").read() for r in range(2)):   # every rank says it, naming both
        assert "ranks resolved different checkpoints" in text
        assert f"rank 1: {nodes}/node1/checkpoints/step-00000004 (step 4" in text
        assert f"rank 0: {nodes}/node0/checkpoints/step-00000008 (step 8" in text
    assert latest(nodes / "node0") == "step-00000008"   # nothing trained, nothing written
    assert steps_in(nodes / "node0") == ["step-00000004", "step-00000008"]


# --- 12. preemption: a signal to one rank -> every rank checkpoints and exits 75 --------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("launcher", ["gloo"])     # one launcher; the id [gloo] is named by test_elastic.py
def test_signal_to_one_rank_checkpoints_every_rank(shards2, tmp_path, capfd, launcher, sig=signal.SIGTERM):
    """A stop signal to ONE rank of a real launch (horovodrun): every rank agrees, checkpoints and
    exits 75; time-based checkpoints appear meanwhile (each written once); the stop's checkpoint resumes (here
    under ``simulate --ranks 2``: the checkpoint's files, not the engine, are what is under test there). The
    torch engine's case, the same assertions, runs through the torchrun launcher script (one launch for both):
    tests/test_launchers.py::test_torchrun_sh_one_node_of_two_ranks_a_signal_to_one_rank_checkpoints_every_rank.

    horovodrun runs under launch/horovod_restarts.py, as a scheduler's job runs it: the wrapper exits 75 too,
    after one attempt, for the scheduler to requeue (before: horovodrun exited 1 and the wrapper restarted the
    job, "attempt 0 exited 1; restarting from the last checkpoint"). This was test_elastic.py's
    test_horovod_wrapper_exits_75_when_preempted, a launch of its own (8 s) of the same signal to one rank."""
    run = tmp_path / "run"
    sets = ["checkpoint.every_minutes=0.01", "checkpoint.keep=1000"]
    train = ["-m", "hvd_partialfc.cli", "train", "--shards", shards2, "--out", str(run),
             "--steps", "100000"] + sum((["--set", s] for s in sets + BASE), [])
    # the wrapper's horovodrun: the script itself, with Gloo
    cmd = [sys.executable, os.path.join(ROOT, "launch", "horovod_restarts.py"), "--max-restarts", "2", "--np", "2",
           "--horovodrun", os.path.join(os.path.dirname(sys.executable), "horovodrun"), "--horovodrun-args=--gloo",
           "--", sys.executable] + train
    proc = subprocess.Popen(cmd, env=launch_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    # on a failure, the launcher and its ranks (the wrapper's horovodrun too) go: their process group
    out = signal_rank_1_once_checkpointing(proc, run, sig, "HOROVOD_RANK", 90,
                                           lambda p: os.killpg(p.pid, signal.SIGKILL))
    assert f"[rank 1] stopped by {sig.name}" in out and "[rank 0] stopped by a stop signal on another rank" in out
    assert "exit 75" in out
    # the wrapper: 75 after one attempt
    assert proc.returncode == 75, out[-3000:]
    assert "attempt 1" not in out and "preempted: every rank checkpointed" in out, out[-3000:]
    last = latest(run)
    meta = json.load(open(run / "checkpoints" / last / "meta.json"))
    assert 0 < meta["step"] < 100000 and meta["identical"]
    # the stop's own checkpoint, at or after the last step logged
    assert meta["step"] >= max(r["step"] for r in read_json_lines(run / "metrics.jsonl") if "step" in r)
    written = [int(s[5:]) for s in steps_in(run)]
    assert len(written) >= 3     # time-based (every 0.6 s), then the stop's
    assert all(b - a > 1 for a, b in zip(written[:-2], written[1:-1]))   # a due checkpoint is written once
    capfd.readouterr()
    result = sim(2, shards2, run, meta["step"] + 2, [*sets, "checkpoint.resume=auto"])
    assert f"at step {meta['step']}" in "".join(capfd.readouterr())
    assert result.checkpoint.endswith(f"step-{meta['step'] + 2:08d}")


def test_reshard_cuts_per_row_vectors_of_the_sampled_step(tmp_path):
    # the sampled-rows AdamW keeps a (W,) per-row step count beside its (W, D) moments: re-sharding cuts
    # it by rows like them (it was taken whole from the first file, as a per-parameter scalar)
    from hvd_partialfc.run.ckpt.reshard import gather_classifier_rows
    from hvd_partialfc.classifier.rowsparse import SampledRowsOptimizer, gather_rows
    torch.manual_seed(0)
    slices, files, full = [(0, 4), (4, 10)], [], {}
    for r, (lo, hi) in enumerate(slices):
        w = torch.nn.Parameter(torch.randn(hi - lo, 3))
        opt = SampledRowsOptimizer([w], "adamw", lr=0.1, weight_decay=0.1)
        for index in ([0, 1], [1, 2]):
            opt.zero_grad()
            gather_rows(w, torch.tensor(index)).square().sum().backward()
            opt.step()
        name = f"classifier-r{r}.pt"
        torch.save({"label_start": lo, "label_end": hi, "weight": w.detach(), "optimizer": opt.state_dict()},
                   tmp_path / name)
        files.append(name)
        for k, v in opt.state[w].items():
            full[k] = torch.cat([full[k], v]) if k in full else v
    cut = gather_classifier_rows(str(tmp_path), {"slices": slices, "classifier_files": files}, 2, 7)
    state = cut["optimizer"]["state"][0]
    assert state["step"].tolist() == [1, 0, 1, 2, 1]          # rows 2, 3 of rank 0, rows 0..2 of rank 1
    for k in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[k], full[k][2:7])


def test_an_older_config_means_the_defaults_the_lazy_sampled_step_and_no_pool():
    from hvd_partialfc.config import Config
    from hvd_partialfc.run.ckpt.resume import saved_config
    old = Config().to_dict()
    for section, key in (("data", "augment"), ("head", "sampled_step"), ("head", "negatives_pool")):
        old[section].pop(key)
    assert saved_config(old, 8) == Config().to_dict()       # unsampled: every new key at its default
    # the negatives' pool caps 1,024 a rank only above N=8 (8,192 rows): an older run at N=16 had no cap
    assert saved_config(old, 16)["head"]["negatives_pool"] == 0
    old["head"]["negatives_every"] = 0
    assert saved_config(old, 16)["head"]["negatives_pool"] == 8192     # (no negatives: nothing to cap)
    old["head"]["sample_rate"] = 0.1                           # a sampled local run of then ran the lazy rule
    assert saved_config(old, 8)["head"]["sampled_step"] == "lazy"
    old["head"]["mode"] = "global"
    assert saved_config(old, 8)["head"]["sampled_step"] == "exact"   # (global never used it)
    old["train"].pop("loss_scale_growth")                      # an fp16 run of then doubled every 1,000 steps
    assert saved_config(old, 8)["train"]["loss_scale_growth"] == 100         # (fp32: the key means nothing)
    old["train"]["precision"] = "fp16"
    assert saved_config(old, 8)["train"]["loss_scale_growth"] == 1000
