"""Reliability under real horovodrun: bitwise resume after SIGKILL, re-sharding, refusals, fail-fast exits,
a kill during a checkpoint write. Every job has a timeout; exits after a failure are timed (< 60 s)."""
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

from conftest import BIN, HOROVODRUN, MR, ROOT, build_shards, launch_env, make_feature_npz, read_json_lines, run_hvd, run_job
from hvd_partialfc.data.shards import data_digest, manifest_digest, read_manifest

pytestmark = pytest.mark.multirank
CLI = os.path.join(BIN, "hvd-partialfc")
BASE = ["model.name=mlp", "data.batch_size=8", "checkpoint.every=10", "train.log_every=5", "data.workers=1"]


@pytest.fixture(scope="module")
def shards4(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel")
    return build_shards(make_feature_npz(d / "f.npz", [16] * 24, seed=3), d / "s4", 4)


def _cmd(np_, shards, out, sets, steps, backend="gloo"):
    args = [HOROVODRUN, "-np", str(np_), f"--{backend}", sys.executable, "-m", "hvd_partialfc.cli", "train",
            "--shards", shards, "--out", out, "--steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    return args


def train(np_, shards, out, sets=(), steps=20, fault=None, check=True, timeout=150, backend="gloo"):
    t0 = time.time()
    p = run_job(_cmd(np_, shards, out, list(BASE) + list(sets), steps, backend), launch_env(fault), timeout)
    p.elapsed = time.time() - t0
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def kill_job_when(np_, shards, out, sets, steps, fault, ready, timeout=120):
    """Start a job, wait until ``ready()``, then SIGKILL horovodrun and every process under it."""
    proc = subprocess.Popen(_cmd(np_, shards, out, list(BASE) + list(sets), steps), env=launch_env(fault), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"job ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
            if time.time() > deadline:
                raise AssertionError("job did not reach the kill point in time")
            time.sleep(0.2)
    finally:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)] \
            if psutil.pid_exists(proc.pid) else []
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def latest(run):
    try:
        return open(os.path.join(run, "checkpoints", "latest")).read().strip()
    except FileNotFoundError:
        return None


def load_ckpt(run):
    from hvd_partialfc.run.checkpoint_files import read_meta, resolve_checkpoint
    ck = resolve_checkpoint(run)
    meta = read_meta(ck)
    bb = torch.load(os.path.join(ck, "backbone.pt"), weights_only=True)
    cls = [torch.load(os.path.join(ck, f), weights_only=True) for f in meta["classifier_files"]]
    return meta, bb, cls


def tensors_equal(a, b):
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_after_sigkill_is_bitwise_identical(shards4, tmp_path):
    straight = str(tmp_path / "straight")
    train(2, shards4, straight, steps=20)
    resumed = str(tmp_path / "resumed")
    kill_job_when(2, shards4, resumed, [], 20, "pause-after-ckpt@10", lambda: latest(resumed) == "step-00000010")
    assert latest(resumed) == "step-00000010"
    p = train(2, shards4, resumed, ["checkpoint.resume=auto"], steps=20)
    assert "resumed from" in p.stdout + p.stderr
    m1, bb1, c1 = load_ckpt(straight)
    m2, bb2, c2 = load_ckpt(resumed)
    assert m1["step"] == m2["step"] == 20
    assert tensors_equal(bb1["state_dict"], bb2["state_dict"])
    assert tensors_equal(bb1["optimizer"]["state"], bb2["optimizer"]["state"])
    for a, b in zip(c1, c2):
        assert tensors_equal(a["weight"], b["weight"]) and tensors_equal(a["optimizer"]["state"], b["optimizer"]["state"])
    assert m1["digests"] == m2["digests"]
    # the resumed run's metrics continue where the first part stopped
    steps = [r["step"] for r in read_json_lines(os.path.join(resumed, "metrics.jsonl")) if "loss" in r]
    assert steps == [5, 10, 15, 20]

    # resume refuses a different shard set or an incompatible config, naming what differs
    other = build_shards(make_feature_npz(tmp_path / "o.npz", [16] * 24, seed=4), tmp_path / "other", 4)
    p = train(2, other, resumed, ["checkpoint.resume=auto"], steps=20, check=False, timeout=90)
    assert p.returncode != 0 and "shard set differs" in p.stdout + p.stderr
    assert "checkpoint.allow_other_data=true" in p.stdout + p.stderr   # same classes and ranges: the way on
    fewer = build_shards(make_feature_npz(tmp_path / "c.npz", [16] * 20, seed=3), tmp_path / "fewer", 4)
    p = train(2, fewer, resumed, ["checkpoint.resume=auto", "checkpoint.allow_other_data=true"], steps=20,
              check=False, timeout=90)
    assert p.returncode != 0 and "classes 24 != 20" in p.stdout + p.stderr   # never, whatever the flag
    p = train(2, shards4, resumed, ["checkpoint.resume=auto", "head.margin=0.3"], steps=20, check=False, timeout=90)
    assert p.returncode != 0 and "head.margin: 0.5 != 0.3" in p.stdout + p.stderr

    # the same input rebuilt from another folder is the same data (the manifest's bytes differ only in its
    # provenance, source.path): resume accepts it (it refused it when the manifest's bytes were compared)
    moved = tmp_path / "moved"
    moved.mkdir()
    moved_npz = moved / "f.npz"
    shutil.copyfile(os.path.join(os.path.dirname(shards4), "f.npz"), moved_npz)
    rebuilt = build_shards(moved_npz, tmp_path / "rebuilt", 4)
    assert manifest_digest(rebuilt) != manifest_digest(shards4) and data_digest(read_manifest(rebuilt)) == data_digest(read_manifest(shards4))
    p = train(2, rebuilt, resumed, ["checkpoint.resume=auto"], steps=25)
    assert "resumed from" in p.stdout + p.stderr and load_ckpt(resumed)[0]["step"] == 25
    # other samples on the same classes: only with the flag, which says so
    p = train(2, other, resumed, ["checkpoint.resume=auto", "checkpoint.allow_other_data=true"], steps=30)
    assert "going on with these samples" in p.stdout + p.stderr and load_ckpt(resumed)[0]["step"] == 30


@pytest.mark.parametrize("mode,optim,extra", [("global", "sgd", []), ("local", "adamw", []),
                                              ("local", "sgd", ["head.negatives_every=3"])])   # sampled local SGD too
def test_resume_is_bitwise_with_random_streams(image_shards, tmp_path, mode, optim, extra):
    # Dropout and PartialFC's sampled negatives both draw from torch's global stream. Creating the
    # DataLoader's iterator must not draw from it after the checkpoint restored it (it did: the resumed
    # stream was one draw ahead, so dropout masks and sampled centres differed after a resume).
    # `local` sampled: the row-sparse step's per-row state (momentum; AdamW's moments and (W,) step)
    # is saved and restored too.
    sets = ["model.name=resnet", "model.kwargs={width: 8, dropout: 0.3}", f"head.mode={mode}",
            "head.sample_rate=0.5", f"optim.name={optim}", *extra]   # extra: sampling beside cross-shard negatives
    if mode == "local":   # 6 classes per rank: a batch of 2 has at most 2 positives of the 3 rows kept, so
        sets.append("data.batch_size=2")   # every step draws random rows (batch 8 kept only positives)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(2, image_shards, straight, sets, steps=16)
    p = train(2, image_shards, resumed, sets, steps=16, fault="raise@10", check=False)
    assert p.returncode != 0 and latest(resumed) == "step-00000010"
    train(2, image_shards, resumed, sets + ["checkpoint.resume=auto"], steps=16)
    (m1, bb1, c1), (m2, bb2, c2) = load_ckpt(straight), load_ckpt(resumed)
    assert m1["step"] == m2["step"] == 16
    assert tensors_equal(bb1["state_dict"], bb2["state_dict"]) and m1["digests"] == m2["digests"]
    for a, b in zip(c1, c2):
        assert tensors_equal(a["weight"], b["weight"]) and tensors_equal(a["optimizer"]["state"], b["optimizer"]["state"])


def test_resume_is_bitwise_with_augmentation_at_any_worker_count(image_shards, tmp_path):
    # data.augment draws from (seed, rank, batch index), never from worker seeds or torch's global stream:
    # 0 workers straight, 1 worker until the crash at step 10, 2 workers after the resume: the same run.
    sets = ["model.name=resnet", "model.kwargs={width: 8}",
            "data.augment=[flip, 'lowres:p=0.5', 'blur:p=0.5', 'jitter:p=0.5']"]
    straight, resumed, plain = (str(tmp_path / n) for n in ("straight", "resumed", "plain"))
    train(2, image_shards, straight, sets + ["data.workers=0"], steps=16)
    p = train(2, image_shards, resumed, sets, steps=16, fault="raise@10", check=False)
    assert p.returncode != 0 and latest(resumed) == "step-00000010"
    train(2, image_shards, resumed, sets + ["checkpoint.resume=auto", "data.workers=2"], steps=16)
    train(2, image_shards, plain, sets[:2] + ["data.workers=0"], steps=16)
    (m1, bb1, c1), (m2, bb2, c2), (_, bb3, _) = load_ckpt(straight), load_ckpt(resumed), load_ckpt(plain)
    assert tensors_equal(bb1["state_dict"], bb2["state_dict"]) and m1["digests"] == m2["digests"]
    for a, b in zip(c1, c2):
        assert tensors_equal(a["weight"], b["weight"]) and tensors_equal(a["optimizer"]["state"], b["optimizer"]["state"])
    assert not tensors_equal(bb1["state_dict"], bb3["state_dict"])   # the augmentation did take part


@pytest.mark.parametrize("old_np,new_np", [(2, 1), (1, 2), (4, 2)])
def test_reshard_to_another_world_size(shards4, tmp_path, old_np, new_np):
    run = str(tmp_path / "run")
    train(old_np, shards4, run, steps=10)
    _, _, old = load_ckpt(run)
    old_w = torch.cat([c["weight"] for c in old])
    old_mom = torch.cat([c["optimizer"]["state"][0]["momentum_buffer"] for c in old])
    # online: resume on new_np ranks (same steps: nothing to train, the re-sharded state is saved)
    new_run = str(tmp_path / "new")
    train(new_np, shards4, new_run, [f"checkpoint.resume={run}"], steps=10)
    meta, _, new = load_ckpt(new_run)
    assert meta["world_size"] == new_np and len(new) == new_np
    assert torch.equal(torch.cat([c["weight"] for c in new]), old_w)
    assert torch.equal(torch.cat([c["optimizer"]["state"][0]["momentum_buffer"] for c in new]), old_mom)
    # and training continues from there on new_np ranks
    train(new_np, shards4, new_run, ["checkpoint.resume=auto"], steps=14)
    assert load_ckpt(new_run)[0]["step"] == 14
    # offline: hvd-partialfc reshard gives the same rows
    out = str(tmp_path / "offline")
    subprocess.run([CLI, "reshard", run, "--world-size", str(new_np), "--out", out], check=True, capture_output=True)
    from hvd_partialfc.run.checkpoint_files import read_meta
    m = read_meta(out)
    rows = [torch.load(os.path.join(out, f), weights_only=True)["weight"] for f in m["classifier_files"]]
    assert torch.equal(torch.cat(rows), old_w)


def test_sampled_local_adamw_state_reshards_per_row(shards4, tmp_path):
    # the sampled-rows AdamW's per-row state, (W, D) moments and the (W,) step count, is cut by rows when
    # np=2 resumes on 1 rank (the (W,) vector was taken whole from the first file, as a scalar), and
    # training goes on from there
    sets = ["head.sample_rate=0.25", "optim.name=adamw", "data.batch_size=2"]
    run, new_run = str(tmp_path / "run"), str(tmp_path / "new")
    train(2, shards4, run, sets, steps=10)
    _, _, old = load_ckpt(run)
    train(1, shards4, new_run, sets + [f"checkpoint.resume={run}"], steps=10)
    _, _, new = load_ckpt(new_run)
    state = new[0]["optimizer"]["state"][0]
    for k in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[k], torch.cat([c["optimizer"]["state"][0][k] for c in old]))
    assert state["step"].shape == (24,) and len(set(state["step"].tolist())) > 1   # rows counted apart
    train(1, shards4, new_run, sets + ["checkpoint.resume=auto"], steps=12)
    assert load_ckpt(new_run)[0]["step"] == 12


@pytest.mark.parametrize("fault,backend", [("raise@5:1", "gloo"), ("kill@5:1", "gloo"), ("raise@5:0", "mpi")])
def test_one_rank_fails_every_rank_exits_fast(shards4, tmp_path, fault, backend):
    run = str(tmp_path / "run")
    p = train(2, shards4, run, ["checkpoint.every=3"], steps=40, fault=fault, check=False, timeout=120,
              backend=backend)
    text = p.stdout + p.stderr
    assert p.returncode != 0
    assert p.elapsed < 60, f"took {p.elapsed:.0f} s to exit"
    rank = fault.split(":")[1]
    if fault.startswith("raise"):
        assert f"[rank {rank}] error: InjectedFault" in text
    # the last good checkpoint stays valid and loadable
    meta, bb, cls = load_ckpt(run)
    assert meta["step"] == 3 and len(cls) == 2


def test_bad_sample_on_one_rank_only(tmp_path):
    # rank 1's shard holds one encoded image that cannot be decoded: found mid-training on rank 1 only
    import io
    from PIL import Image
    from hvd_partialfc.data.partition import even_slices
    from data_tools.shard_writer import write_manifest, write_shard_set
    rng = np.random.default_rng(0)
    blobs, labels = [], []
    for c in range(8):
        for k in range(12):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8)).save(buf, format="PNG")
            blobs.append(buf.getvalue())
            labels.append(c)
    blobs[7 * 12 + 3] = b"not an image"
    shards = str(tmp_path / "enc")
    m = write_shard_set(shards, "encoded", blobs, labels, even_slices(8, 2), 8)
    m.sample_shape = [32, 32]
    write_manifest(shards, m)
    p = train(2, shards, str(tmp_path / "run"), ["model.name=resnet", "model.kwargs={width: 8}"], steps=30,
              check=False, timeout=120)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and p.elapsed < 60
    assert "rank 1: " in text and "shard-00001-of-00002.h5: sample 39 cannot be decoded" in text


def test_nonfinite_loss_stop_and_skip(shards4, tmp_path):
    # skip: a NaN on rank 1 at step 2 -> every rank skips that step and no parameter changes
    out = tmp_path / "skip"
    run_hvd(2, [os.path.join(MR, "scenarios.py"), "nonfinite", shards4, out, 5])
    r = [json.load(open(out / f"rank-{i}.json")) for i in range(2)]
    for x in r:
        assert x["skipped_steps"] == 1
        assert x["backbone"][2] == x["backbone"][1] and x["classifier"][2] == x["classifier"][1]
        assert x["backbone"][3] != x["backbone"][2]
    assert r[0]["backbone"] == r[1]["backbone"]
    # stop (the default): NaN features on one rank -> every rank stops with the reason, quickly
    x = np.load(make_feature_npz(tmp_path / "n.npz", [16] * 24, seed=3))
    feats = x["features"].copy()
    feats[x["labels"] >= 18] = np.nan  # classes of rank 1 only
    np.savez(tmp_path / "n2.npz", features=feats, labels=x["labels"])
    bad = build_shards(tmp_path / "n2.npz", tmp_path / "nan", 2)
    p = train(2, bad, str(tmp_path / "run"), [], steps=10, check=False, timeout=90)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and p.elapsed < 60
    assert "non-finite backbone gradient at step 0" in text


def test_kill_during_checkpoint_write_keeps_previous(shards4, tmp_path):
    run = str(tmp_path / "run")
    partial = os.path.join(run, "checkpoints", "step-00000006.partial")
    kill_job_when(2, shards4, run, ["checkpoint.every=3"], 12, "pause-in-ckpt@6",
                  lambda: os.path.isfile(os.path.join(partial, "classifier-00001-of-00002.pt")))
    assert latest(run) == "step-00000003"
    meta, bb, cls = load_ckpt(run)  # the previous checkpoint is complete and loads
    assert meta["step"] == 3
    p = train(2, shards4, run, ["checkpoint.every=3", "checkpoint.resume=auto"], steps=12)
    assert "resumed from" in p.stdout + p.stderr and "step 3" in p.stdout + p.stderr
    assert load_ckpt(run)[0]["step"] == 12
    assert not os.path.exists(partial)
