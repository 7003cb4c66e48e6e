"""Checkpoints that never lose a run and loads that run no code (issue 11): keep-last-k by write order,
supersede instead of delete, dangling `latest`, diverged saves, agreed resume, nothing rewritten at the
end, weights_only loads and the format upgrade, replicated re-sharding and clipping, skip limits,
preemption by signal. Multi-rank behaviour runs under real horovodrun; file logic runs as one process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from conftest import HOROVODRUN, MR, ROOT, build_shards, launch_env, make_feature_npz, read_json_lines, run_hvd, run_job

CLI = [sys.executable, "-m", "hvd_partialfc.cli"]
BASE = ["model.name=mlp", "data.batch_size=8", "train.log_every=5", "data.workers=0", "head.negatives_every=0"]


@pytest.fixture(scope="module")
def shards2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    return build_shards(make_feature_npz(d / "f.npz", [16] * 12, seed=5), d / "s2", 2)


def train1(shards, out, steps, sets=(), fault=None, check=True, timeout=120):
    """One rank, no launcher (Horovod alone: size 1)."""
    args = CLI + ["train", "--shards", shards, "--out", str(out), "--steps", str(steps)]
    for s in list(BASE) + list(sets):
        args += ["--set", s]
    p = run_job(args, launch_env(fault), timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-4000:]}")
    return p


def latest(run):
    return open(os.path.join(run, "checkpoints", "latest")).read().strip()


def steps_in(run):
    from hvd_partialfc.run.checkpoint_files import list_checkpoints
    return list_checkpoints(str(run))


# --- 1. keep-last-k by write order; newer checkpoints moved aside; dangling latest ------------------------

def test_resume_from_older_checkpoint_never_loses_latest(shards2, tmp_path):
    run = tmp_path / "run"
    train1(shards2, run, 20, ["checkpoint.every=10", "checkpoint.keep=2"])
    assert steps_in(run) == ["step-00000010", "step-00000020"]
    # resume from step 10 with keep=1; die before step 16 (after the save at 15)
    p = train1(shards2, run, 20, ["checkpoint.every=5", "checkpoint.keep=1",
                                  f"checkpoint.resume={run}/checkpoints/step-00000010"], fault="raise@15", check=False)
    assert p.returncode != 0 and "InjectedFault" in p.stderr
    assert "moved to" in p.stdout and "step-00000020" in p.stdout          # said, not silent
    assert latest(run) == "step-00000015" and steps_in(run) == ["step-00000015"]
    aside = [d for d in os.listdir(run / "checkpoints") if d.startswith("superseded-")]
    assert len(aside) == 1 and sorted(os.listdir(run / "checkpoints" / aside[0])) == ["latest", "step-00000020"]
    # the next launch resumes where the last one stopped, not from step 0
    p = train1(shards2, run, 20, ["checkpoint.every=5", "checkpoint.keep=1", "checkpoint.resume=auto"])
    assert "at step 15" in p.stdout + p.stderr
    assert latest(run) == "step-00000020"


def test_dangling_latest_is_an_error_never_a_fresh_start(tmp_path):
    from hvd_partialfc.run.checkpoint_files import CheckpointError, find_resume
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

def test_relaunching_a_finished_run_rewrites_nothing(shards2, tmp_path):
    run = tmp_path / "run"
    train1(shards2, run, 6)
    ck = run / "checkpoints" / "step-00000006"
    before = {f: (os.stat(ck / f).st_ino, os.stat(ck / f).st_mtime_ns) for f in os.listdir(ck)}
    folder = os.stat(ck).st_ino
    p = train1(shards2, run, 6, ["checkpoint.resume=auto"])
    assert "nothing to train" in p.stdout
    assert os.stat(ck).st_ino == folder
    assert {f: (os.stat(ck / f).st_ino, os.stat(ck / f).st_mtime_ns) for f in os.listdir(ck)} == before


# --- 6. loads that run no code; format version and upgrade ----------------------------------------------

class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoint_files_with_code_are_refused(shards2, tmp_path):
    run = tmp_path / "run"
    train1(shards2, run, 4)
    ck = run / "checkpoints" / "step-00000004"
    marker = tmp_path / "pwned"
    good = torch.load(ck / "classifier-00000-of-00001.pt", weights_only=True)
    good["evil"] = _Payload(str(marker))
    torch.save(good, ck / "classifier-00000-of-00001.pt")
    bb = torch.load(ck / "backbone.pt", weights_only=True)
    bb["evil"] = _Payload(str(marker))
    exported = tmp_path / "downloaded.pt"
    torch.save(bb, exported)
    for args in (["info", str(run)], ["eval", "--backbone", str(exported), "--pairs", str(tmp_path / "x.h5")]):
        p = subprocess.run(CLI + args, capture_output=True, text=True, env=launch_env(), cwd=ROOT, timeout=60)
        assert p.returncode != 0 and "refused to load" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not marker.exists()
    p = train1(shards2, run, 8, ["checkpoint.resume=auto"], check=False)
    assert p.returncode != 0 and "classifier-00000-of-00001.pt: refused to load" in p.stderr
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


def test_format1_checkpoint_upgrades_then_resumes_bitwise(shards2, tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    train1(shards2, straight, 8, ["checkpoint.every=4"])
    train1(shards2, run, 8, ["checkpoint.every=4"], fault="raise@4", check=False)
    ck = run / "checkpoints" / "step-00000004"
    _downgrade_to_format1(ck)
    with pytest.raises(Exception):
        torch.load(ck / "classifier-00000-of-00001.pt", weights_only=True)
    from hvd_partialfc.run.checkpoint_files import CheckpointError, find_resume, read_meta
    with pytest.raises(CheckpointError, match=r"checkpoint format 1, .* `hvd-partialfc upgrade "):
        read_meta(find_resume(str(run)))   # what resume reads first, on every rank
    p = subprocess.run(CLI + ["upgrade", str(run)], capture_output=True, text=True, env=launch_env(), cwd=ROOT)
    assert p.returncode == 0 and "upgraded" in p.stdout, p.stderr
    train1(shards2, run, 8, ["checkpoint.every=4", "checkpoint.resume=auto"])
    a = torch.load(straight / "checkpoints" / "step-00000008" / "classifier-00000-of-00001.pt", weights_only=True)
    b = torch.load(run / "checkpoints" / "step-00000008" / "classifier-00000-of-00001.pt", weights_only=True)
    assert torch.equal(a["weight"], b["weight"])


# --- 2. diverged checkpoints; 9. skip limits (real horovodrun); 8. replicated clipping and re-sharding ---------

@pytest.mark.multirank
def test_diverged_checkpoint_is_set_aside(shards2, tmp_path):
    out = tmp_path / "div"
    run_hvd(2, [os.path.join(MR, "ckpt_scenarios.py"), "diverged", shards2, out], timeout=120)
    r0, r1 = (json.load(open(out / f"rank-{r}.json")) for r in range(2))
    assert r0["raised"] and r1["raised"] and "backbones differ across ranks at step 3" in r0["raised"]
    run = out / "run"
    assert latest(run) == "step-00000002" and steps_in(run) == ["step-00000002"]
    aside = run / "checkpoints" / "diverged-step-00000003"
    assert {"backbone-rank-00000.pt", "backbone-rank-00001.pt", "meta.json"} <= set(os.listdir(aside))


@pytest.mark.multirank
def test_skips_are_counted_and_a_stuck_run_stops(shards2, tmp_path):
    out = tmp_path / "skips"
    run_hvd(2, [os.path.join(MR, "ckpt_scenarios.py"), "skips", shards2, out], timeout=120)
    r0, r1 = (json.load(open(out / f"rank-{r}.json")) for r in range(2))
    for r in (r0, r1):  # steps 5, 6, 7 skipped on every rank, then every rank stops
        assert r["stopped_at"] == 7 and r["skipped_steps"] == 3
        assert "3 steps in a row skipped up to step 7" in r["raised"]
    assert r0["classifier_skipped_steps"] == 0 and r1["classifier_skipped_steps"] == 2
    m = [x for x in read_json_lines(out / "run" / "metrics.jsonl") if "loss" in x]
    assert [x["classifier_skipped_steps"] for x in m[:4]] == [0, 1, 2, 2]
    assert [x["skipped_steps"] for x in m] == [0, 0, 0, 0, 0, 1, 2]


def test_replicated_classifier_gradient_is_clipped(shards2, tmp_path):
    # one rank is enough: the classifier's gradient was left out of the clip whatever the world size
    out = tmp_path / "rep"
    p = subprocess.run([sys.executable, os.path.join(MR, "ckpt_scenarios.py"), "replicated", shards2, str(out)],
                       capture_output=True, text=True, env=launch_env(), cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.load(open(out / "rank-0.json"))
    assert r["classifier_update_norm"] > 0
    assert abs(r["update_norm"] - r["expected"]) < 1e-3 * r["expected"]


@pytest.mark.multirank
def test_replicated_checkpoint_reshards(shards2, tmp_path):
    run = str(tmp_path / "run")
    run_hvd(2, ["-m", "hvd_partialfc.cli", "train", "--shards", shards2, "--out", run, "--steps", "4",
                *sum((["--set", s] for s in BASE + ["head.mode=replicated"]), [])])
    new = str(tmp_path / "new")
    p = subprocess.run(CLI + ["reshard", run, "--world-size", "1", "--out", new], capture_output=True,
                       text=True, env=launch_env(), cwd=ROOT)
    assert p.returncode == 0, p.stderr
    old = torch.load(os.path.join(run, "checkpoints", "step-00000004", "classifier-00000-of-00002.pt"),
                     weights_only=True)
    mine = torch.load(os.path.join(new, "classifier-00000-of-00001.pt"), weights_only=True)
    assert torch.equal(old["weight"], mine["weight"]) and mine["label_end"] == 12
    train1(shards2, tmp_path / "cont", 6, ["head.mode=replicated", f"checkpoint.resume={new}"])


# --- 3. ranks that resolve different checkpoints stop, naming them -----------------------------------------

@pytest.mark.multirank
def test_ranks_resolving_different_checkpoints_stop(shards2, tmp_path):
    a = tmp_path / "node0"
    train1(shards2, a, 8, ["checkpoint.every=4", "checkpoint.keep=2"])
    # node-local run folders: rank 1's copy is stale (its latest is step 4)
    shutil.copytree(a, tmp_path / "node1")
    (tmp_path / "node1" / "checkpoints" / "latest").write_text("step-00000004\n")
    cmd = " ".join([sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", shards2, "--steps", "12",
                    "--out", f"{tmp_path}/node$HOROVOD_RANK", "--resume", "auto"]
                   + sum((["--set", s] for s in BASE), []))
    t0 = time.time()
    p = run_job([HOROVODRUN, "-np", "2", "--gloo", "sh", "-c", cmd], launch_env(), timeout=120)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and time.time() - t0 < 60
    assert "ranks resolved different checkpoints" in text
    assert f"rank 1: {tmp_path}/node1/checkpoints/step-00000004 (step 4" in text
    assert f"rank 0: {tmp_path}/node0/checkpoints/step-00000008 (step 8" in text
    assert latest(tmp_path / "node0") == "step-00000008"   # nothing trained, nothing written


# --- 12. preemption: a signal to one rank -> every rank checkpoints and exits 75 --------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signal_to_one_rank_checkpoints_every_rank(shards2, tmp_path, sig):
    run = tmp_path / "run"
    cmd = [HOROVODRUN, "-np", "2", "--gloo", sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", shards2,
           "--out", str(run), "--steps", "100000", "--set", "checkpoint.every_minutes=0.01",
           "--set", "checkpoint.keep=1000"] + sum((["--set", s] for s in BASE), [])
    proc = subprocess.Popen(cmd, env=launch_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 90
        while len(steps_in(run)) < 2:  # time-based checkpoints (every 0.6 s) appear without checkpoint.every
            assert proc.poll() is None and time.time() < deadline, "no time-based checkpoints"
            time.sleep(0.2)
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "hvd_partialfc.cli" in " ".join(c.cmdline()) and c.environ().get("HOROVOD_RANK") == "1"]
        assert len(ranks) == 1
        ranks[0].send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"[rank 1] stopped by {sig.name}" in out and "[rank 0] stopped by a stop signal on another rank" in out
    assert "exit 75" in out
    last = latest(run)
    meta = json.load(open(run / "checkpoints" / last / "meta.json"))
    assert 0 < meta["step"] < 100000 and meta["identical"]
    written = [int(s[5:]) for s in steps_in(run)]
    assert len(written) >= 3     # time-based (every 0.6 s), then the stop's
    assert all(b - a > 1 for a, b in zip(written[:-2], written[1:-1]))   # a due checkpoint is written once
    p = run_job(cmd[:cmd.index("--steps") + 1] + [str(meta["step"] + 2)] + cmd[cmd.index("--steps") + 2:]
                + ["--resume", "auto"], launch_env(), timeout=120)
    assert p.returncode == 0 and f"at step {meta['step']}" in p.stdout + p.stderr, p.stderr[-3000:]


def test_reshard_cuts_per_row_vectors_of_the_sampled_step(tmp_path):
    # the sampled-rows AdamW keeps a (W,) per-row step count beside its (W, D) moments: re-sharding cuts
    # it by rows like them (it was taken whole from the first file, as a per-parameter scalar)
    from hvd_partialfc.run.reshard import gather_classifier_rows
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
    from hvd_partialfc.run.resume import saved_config
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
