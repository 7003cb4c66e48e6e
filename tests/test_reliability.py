"""Reliability under real horovodrun: bitwise resume after SIGKILL (dropout, sampled rows, augmentation and
DataLoader workers), re-sharding, refusals, fail-fast exits, a kill during a checkpoint write. Every job has
a timeout; exits after a failure are timed (< 60 s). Non-finite steps (skip, and stop on every rank):
tests/test_checkpoints.py::test_nonfinite_loss_stop_and_skip, in that file's one two-rank launch.

Launches are what cost here (10-40 s each on a busy machine), so a trained run serves several checks (the
SIGKILL test's runs are also the re-sharding source and the refusals' checkpoint), and what needs the
trainer's start-up, resume and loop but no Horovod (refusals and other data, the augmentation's effect,
re-sharding to 1 and 2 ranks and from a 4-rank source, going on after a re-shard, the resume after a kill
during a write, the uninterrupted run the SIGKILLed one is compared with) runs ``hvd-partialfc simulate`` in
this process; the job killed during a write is a ``simulate`` process of its own (the files it leaves are
under test). Every multi-rank behaviour keeps a real launch: a fail-fast exit under each engine where the
engines differ (a rank killed: both; a rank raising: Horovod's Gloo and MPI)."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from conftest import (ROOT, build_shards, launch_cmd, launch_env, make_feature_npz, make_image_npz,
                      read_json_lines, run_job, simulate_cli)
from hvd_partialfc.data.shards import data_digest, manifest_digest, read_manifest

pytestmark = pytest.mark.multirank
BASE = ["model.name=mlp", "data.batch_size=8", "checkpoint.every=10", "train.log_every=5", "data.workers=1"]
# Everything that draws random numbers at once: dropout and PartialFC's sampled rows (torch's global stream),
# the row-sparse AdamW's per-row state, cross-shard negatives beside the sampling, and data.augment (drawn
# from (seed, rank, batch index)). 6 classes per rank and batches of 2: at most 2 positives of the 3 rows
# kept, so every step draws random rows. 24 images per rank: an epoch is 12 steps.
STREAMS = ["model.name=resnet", "model.kwargs={width: 8, dropout: 0.3}", "head.mode=local", "head.sample_rate=0.5",
           "optim.name=adamw", "head.negatives_every=3", "data.batch_size=2",
           "data.augment=[flip, 'lowres:p=0.5', 'blur:p=0.5', 'jitter:p=0.5']"]
ROW_STATE = ("step", "exp_avg", "exp_avg_sq")   # the sampled-rows AdamW's per-row state: (W,) and (W, D)


@pytest.fixture(scope="module")
def shards4(tmp_path_factory):
    d = tmp_path_factory.mktemp("rel")
    return build_shards(make_feature_npz(d / "f.npz", [16] * 24, seed=3), d / "s4", 4)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """12 classes x 4 images of 32x32, 2 shards (``i.npz`` beside them)."""
    d = tmp_path_factory.mktemp("relimg")
    return build_shards(make_image_npz(d / "i.npz", 12, 4), d / "shards", 2)


def _cmd(np_, shards, out, sets, steps, backend="gloo"):
    """``backend``: horovodrun's ``gloo`` or ``mpi``, ``torchrun`` (the torch engine), or ``simulate`` (one
    process: ``hvd-partialfc simulate --ranks np_``)."""
    start = [sys.executable, "-m", "hvd_partialfc.cli", "simulate", "--ranks", str(np_)] if backend == "simulate" \
        else launch_cmd(backend, np_) + ["-m", "hvd_partialfc.cli", "train"]
    args = start + ["--shards", shards, "--out", out, "--steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    return args


def train(np_, shards, out, sets=(), steps=20, fault=None, check=True, timeout=150, backend="gloo"):
    """The job's CompletedProcess; ``p.ended``: when it exited (time.time())."""
    p = run_job(_cmd(np_, shards, out, list(BASE) + list(sets), steps, backend), launch_env(fault), timeout)
    p.ended = time.time()
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def simulate_here(capsys, ranks, shards, out, sets=(), steps=20):
    """``hvd-partialfc simulate --ranks N`` in this process with this file's settings: exit code and output."""
    return simulate_cli(capsys, ranks, shards, out, list(BASE) + list(sets), steps)


def reshard_offline(src, world_size, out):
    """``hvd-partialfc reshard SRC --world-size M --out OUT`` (in this process); the classifier files written."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.run_files import read_meta
    assert main(["reshard", str(src), "--world-size", str(world_size), "--out", str(out)]) == 0
    m = read_meta(out)
    assert m["world_size"] == world_size and len(m["classifier_files"]) == world_size
    return [torch.load(os.path.join(out, f), weights_only=True) for f in m["classifier_files"]]


def kill_job_when(np_, shards, out, sets, steps, fault, ready, timeout=120, backend="gloo"):
    """Start a job, wait until ``ready()``, then SIGKILL the launcher and every process under it."""
    proc = subprocess.Popen(_cmd(np_, shards, out, list(BASE) + list(sets), steps, backend), env=launch_env(fault),
                            cwd=ROOT,
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
    from hvd_partialfc.run_files import read_meta, resolve_checkpoint
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


def assert_rows_are(new, old, keys):
    """The classifier rows of ``new`` (one file per new rank) are those of ``old`` cut anew: the weight
    and each per-row optimizer state in ``keys``, concatenated over ranks, bitwise."""
    cat = lambda files, f: torch.cat([f(c) for c in files])  # noqa: E731
    assert torch.equal(cat(new, lambda c: c["weight"]), cat(old, lambda c: c["weight"]))
    for k in keys:
        assert torch.equal(cat(new, lambda c: c["optimizer"]["state"][0][k]),
                           cat(old, lambda c: c["optimizer"]["state"][0][k])), k


@pytest.fixture(scope="module")
def streams(images, tmp_path_factory):
    """STREAMS on 2 ranks for 16 steps, uninterrupted (0 DataLoader workers), and the same run SIGKILLed
    (every process: launcher, ranks, 1 worker each) right after its step-10 checkpoint, then resumed with 2
    workers: the run folders {"straight", "resumed"}, and the resume's output. The uninterrupted run is
    ``simulate --ranks 2`` in this process (bitwise a real 2-rank run's: tests/test_simulate.py,
    tests/test_pins.py), so the resumed real run must also end where the simulator does; it was a launch of
    its own (12-16 s here, 2026-12-07)."""
    d = tmp_path_factory.mktemp("streams")
    straight, resumed = str(d / "straight"), str(d / "resumed")
    code, _ = simulate_cli(None, 2, images, straight, list(BASE) + STREAMS + ["data.workers=0"], 16)
    assert code == 0, f"simulate --ranks 2 exited {code}"
    kill_job_when(2, images, resumed, STREAMS, 16, "pause-after-ckpt@10", lambda: latest(resumed) == "step-00000010")
    killed_at = latest(resumed)
    p = train(2, images, resumed, STREAMS + ["checkpoint.resume=auto", "data.workers=2"], steps=16)
    return {"straight": straight, "resumed": resumed, "killed_at": killed_at, "output": p.stdout + p.stderr}


def test_resume_after_sigkill_is_bitwise_with_random_streams_and_augmentation(streams, images, tmp_path, capsys):
    """A run SIGKILLed after a checkpoint and resumed ends bitwise where the uninterrupted run does, with
    every random stream in use and any DataLoader worker count (0 / 1 / 2). Guards: dropout and sampled rows
    draw from torch's global stream, so creating the DataLoader's iterator must not draw from it after the
    checkpoint restored it (it did: the resumed stream was one draw ahead); the sampled-rows AdamW's per-row
    state is saved and restored; data.augment draws from (seed, rank, batch index), never from worker seeds
    or the global stream; the resumed part crosses an epoch (step 12); metrics continue without a gap."""
    assert streams["killed_at"] == "step-00000010"
    assert "resumed from" in streams["output"]
    (m1, bb1, c1), (m2, bb2, c2) = load_ckpt(streams["straight"]), load_ckpt(streams["resumed"])
    assert m1["step"] == m2["step"] == 16
    assert tensors_equal(bb1["state_dict"], bb2["state_dict"]) and m1["digests"] == m2["digests"]
    assert tensors_equal(bb1["optimizer"]["state"], bb2["optimizer"]["state"])
    for a, b in zip(c1, c2):
        assert tensors_equal(a["weight"], b["weight"]) and tensors_equal(a["optimizer"]["state"], b["optimizer"]["state"])
    # the resumed run's metrics continue where the first part stopped
    steps = [r["step"] for r in read_json_lines(os.path.join(streams["resumed"], "metrics.jsonl")) if "loss" in r]
    assert steps == [5, 10, 15, 16]
    # the augmentation did take part (else the equality above says nothing of it): one step with and without
    # it, otherwise the same, ends elsewhere
    assert simulate_here(capsys, 2, images, tmp_path / "aug", STREAMS, steps=1)[0] == 0
    assert simulate_here(capsys, 2, images, tmp_path / "plain", STREAMS[:-1], steps=1)[0] == 0
    assert not tensors_equal(load_ckpt(str(tmp_path / "aug"))[1]["state_dict"],
                             load_ckpt(str(tmp_path / "plain"))[1]["state_dict"])


def test_resume_refuses_other_data_or_config_and_accepts_a_rebuild(streams, images, tmp_path, capsys):
    """Resume compares the data and the config with the checkpoint's, naming what differs: another shard set
    is refused (allowed with checkpoint.allow_other_data when its classes and ranges are the same, never
    otherwise: other images in classes of the same sizes, which could be these relabelled, are not the same
    classes), so is a changed head.margin; the same input rebuilt from another folder (the manifest's bytes
    differ only in its provenance, source.path) is the same data and resumes (it was refused when the
    manifest's bytes were compared). Start-up checks, agreed by the ranks: run under ``simulate --ranks 2``
    in this process, on a copy of the SIGKILL test's resumed real run (step 16)."""
    run = str(tmp_path / "run")
    shutil.copytree(streams["resumed"], run)
    resume = STREAMS + ["checkpoint.resume=auto"]
    npz = os.path.join(os.path.dirname(images), "i.npz")
    with np.load(npz) as z, np.load(make_image_npz(tmp_path / "o.npz", 12, 4, seed=4)) as o:
        rest = np.arange(len(z["labels"])) % 4 >= 2    # each class's first 2 images kept (FIRST_SAMPLES)
        np.savez(tmp_path / "later.npz", images=np.where(rest[:, None, None], o["images"], z["images"]),
                 labels=z["labels"])
    later = build_shards(tmp_path / "later.npz", tmp_path / "later", 2)
    rc, text = simulate_here(capsys, 2, later, run, resume, steps=16)
    assert rc != 0 and "shard set differs" in text
    assert "checkpoint.allow_other_data=true" in text   # same classes and ranges: the way on
    other = build_shards(make_image_npz(tmp_path / "o.npz", 12, 4, seed=4), tmp_path / "other", 2)
    rc, text = simulate_here(capsys, 2, other, run, resume + ["checkpoint.allow_other_data=true"], steps=16)
    assert rc != 0 and "and so do its classes' first samples" in text   # never, whatever the flag
    fewer = build_shards(make_image_npz(tmp_path / "c.npz", 10, 4), tmp_path / "fewer", 2)
    rc, text = simulate_here(capsys, 2, fewer, run, resume + ["checkpoint.allow_other_data=true"], steps=16)
    assert rc != 0 and "classes 12 != 10" in text   # never, whatever the flag
    rc, text = simulate_here(capsys, 2, images, run, resume + ["head.margin=0.3"], steps=16)
    assert rc != 0 and "head.margin: 0.5 != 0.3" in text
    assert load_ckpt(run)[0]["step"] == 16   # nothing written by a refusal

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copyfile(npz, moved / "i.npz")
    rebuilt = build_shards(moved / "i.npz", tmp_path / "rebuilt", 2)
    assert manifest_digest(rebuilt) != manifest_digest(images)
    assert data_digest(read_manifest(rebuilt)) == data_digest(read_manifest(images))
    rc, text = simulate_here(capsys, 2, rebuilt, run, resume, steps=18)
    assert rc == 0 and "resumed from" in text and load_ckpt(run)[0]["step"] == 18
    # other samples on the same classes: only with the flag, which says so
    rc, text = simulate_here(capsys, 2, later, run, resume + ["checkpoint.allow_other_data=true"], steps=20)
    assert rc == 0 and "going on with these samples" in text and load_ckpt(run)[0]["step"] == 20


def test_reshard_to_another_world_size(streams, images, shards4, tmp_path, capsys):
    """Resuming at another world size cuts the classifier rows and their per-row optimizer state (the
    sampled-rows AdamW's (W, D) moments and (W,) step count: it was taken whole from the first file, as a
    scalar) by rows, as an offline concatenation of the old files says; training goes on from there; and
    ``hvd-partialfc reshard`` writes the same rows. 2 -> 1 (one rank gathers two files, the second at an
    offset), 1 -> 2 (each rank cuts its part of one file) and 4 -> 2 with SGD's momentum (rank 1 gathers files 2
    and 3) run in this process (simulate: the cut is file logic each rank does alone, run/ckpt/reshard.py, the
    same on virtual ranks; 1 -> 2 was a horovodrun launch, ~10 CPU-s). A real launch resuming at another world
    size: tests/test_elastic.py (2 -> 1 under torchrun and under launch/horovod_restarts.py)."""
    src = streams["straight"]   # 2 ranks, step 16
    _, _, old = load_ckpt(src)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # 2 -> 1 (same steps: nothing to train, the re-sharded state is saved)
    assert simulate_here(capsys, 1, images, one, STREAMS + [f"checkpoint.resume={src}"], steps=16)[0] == 0
    meta, _, new = load_ckpt(one)
    assert meta["world_size"] == 1 and len(new) == 1 and meta["step"] == 16
    assert_rows_are(new, old, ROW_STATE)
    step = new[0]["optimizer"]["state"][0]["step"]
    assert step.shape == (12,) and len(set(step.tolist())) > 1   # rows counted apart
    assert_rows_are(reshard_offline(src, 1, tmp_path / "offline1"), old, ROW_STATE)
    # and training continues from there on 1 rank: 2 more steps of 2 ranks' samples (run/progress.py) are 4
    assert simulate_here(capsys, 1, images, one, STREAMS + ["checkpoint.resume=auto"], steps=18)[0] == 0
    _, _, old = load_ckpt(one)
    assert load_ckpt(one)[0]["step"] == 20
    # 1 -> 2
    assert simulate_here(capsys, 2, images, two, STREAMS + [f"checkpoint.resume={one}"], steps=18)[0] == 0
    meta, _, new = load_ckpt(two)
    assert meta["world_size"] == 2 and len(new) == 2 and meta["step"] == 20   # 18 steps of 2 ranks' samples done
    assert_rows_are(new, old, ROW_STATE)
    assert_rows_are(reshard_offline(one, 2, tmp_path / "offline2"), old, ROW_STATE)
    # and training continues from there on 2 ranks
    assert simulate_here(capsys, 2, images, two, STREAMS + ["checkpoint.resume=auto"], steps=20)[0] == 0
    assert load_ckpt(two)[0]["step"] == 22

    # dense rows with SGD's momentum, 4 -> 2
    four, back = tmp_path / "four", tmp_path / "back"
    assert simulate_here(capsys, 4, shards4, four, steps=4)[0] == 0
    _, _, old = load_ckpt(str(four))
    assert simulate_here(capsys, 2, shards4, back, [f"checkpoint.resume={four}"], steps=4)[0] == 0
    meta, _, new = load_ckpt(str(back))
    assert meta["world_size"] == 2 and len(new) == 2
    assert_rows_are(new, old, ["momentum_buffer"])
    assert_rows_are(reshard_offline(four, 2, tmp_path / "offline4"), old, ["momentum_buffer"])


@pytest.mark.parametrize("fault,backend", [("kill@5:1", "gloo"), ("raise@5:0", "mpi"), ("kill@5:1", "torchrun")])
def test_one_rank_fails_every_rank_exits_fast(shards4, tmp_path, fault, backend):
    """One rank SIGKILLed (Horovod with Gloo, and the torch engine) or raising (rank 0, under MPI): every rank
    exits, quickly, the raising rank says why, and the last good checkpoint stays valid and loadable. (Rank 1 raising under Gloo:
    test_bad_sample_on_one_rank_only.)"""
    run = str(tmp_path / "run")
    p = train(2, shards4, run, ["checkpoint.every=3"], steps=40, fault=fault, check=False, timeout=120,
              backend=backend)
    text = p.stdout + p.stderr
    assert p.returncode != 0
    fired = float(re.search(r"injected (?:kill|raise) before step \d+ at ([\d.]+)", text).group(1))
    assert p.ended - fired < 30, f"every rank exited {p.ended - fired:.0f} s after the fault"
    print(f"{fault} under {backend}: every rank exited {p.ended - fired:.1f} s after the fault")
    rank = fault.split(":")[1]
    if fault.startswith("raise"):
        assert f"[rank {rank}] error: InjectedFault" in text
    # the last good checkpoint stays valid and loadable
    meta, bb, cls = load_ckpt(run)
    assert meta["step"] == 3 and len(cls) == 2


def test_bad_sample_on_one_rank_only(tmp_path, backend="gloo"):
    """Rank 1's shard holds one encoded image that cannot be decoded: found mid-training (its second batch, in
    a DataLoader worker) on rank 1 only, every rank exits quickly, rank 1 says why, naming the file and the
    sample, and the last good checkpoint (step 1) stays valid and loadable. The Gloo case of one rank
    raising: rank 1's exception, rank 0 waiting in the step's allreduce. Under Horovod only: the finding and
    the message are the data loader's and the CLI's, the same under both engines, and under the torch engine
    a rank that raises ends its peers as a killed one does (its heartbeat link closed without a goodbye:
    tests/test_heartbeat.py::test_a_ranks_own_error_leaves_without_a_goodbye; the killed rank under torchrun:
    test_one_rank_fails_every_rank_exits_fast). It ran under torchrun too (a launch, ~10 CPU-s)."""
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
    run = str(tmp_path / "run")
    p = train(2, shards, run, ["model.name=resnet", "model.kwargs={width: 8}", "checkpoint.every=1"], steps=30,
              check=False, timeout=120, backend=backend)
    text = p.stdout + p.stderr
    # timed from the last checkpoint (step 1; the bad sample is in the next batch), not the launch's start-up
    found = os.path.getmtime(os.path.join(run, "checkpoints", "latest"))
    assert p.returncode != 0 and p.ended - found < 30, f"exit {p.returncode} {p.ended - found:.0f} s after step 1"
    assert "[rank 1] error: ShardError" in text
    assert "rank 1: " in text and "shard-00001-of-00002.h5: sample 39 cannot be decoded" in text
    meta, bb, cls = load_ckpt(run)
    assert meta["step"] == 1 and len(cls) == 2


def test_kill_during_checkpoint_write_keeps_previous(shards4, tmp_path, capsys):
    """The job SIGKILLed while the step-6 checkpoint is half written (both ranks' files there, meta.json and
    latest not yet): the step-3 checkpoint stays latest and loads; resume goes on from it to the end and the
    half-written folder is gone. What is under test is the files a kill leaves, written by the same checkpoint
    code on every rank, real or virtual: the job is ``hvd-partialfc simulate --ranks 2`` in a process of its
    own, SIGKILLed (one process start, not a launcher and two ranks: ~5 CPU-s less); the resume, start-up file
    logic agreed by the ranks, runs under ``simulate --ranks 2`` in this process. The real resume after a
    SIGKILL of a real launch (launcher, ranks, their workers) is the streams test's."""
    run = str(tmp_path / "run")
    partial = os.path.join(run, "checkpoints", "step-00000006.partial")
    kill_job_when(2, shards4, run, ["checkpoint.every=3"], 12, "pause-in-ckpt@6",
                  lambda: os.path.isfile(os.path.join(partial, "classifier-00001-of-00002.pt")), backend="simulate")
    assert latest(run) == "step-00000003" and os.path.isdir(partial)
    meta, bb, cls = load_ckpt(run)  # the previous checkpoint is complete and loads
    assert meta["step"] == 3
    rc, text = simulate_here(capsys, 2, shards4, run, ["checkpoint.every=3", "checkpoint.resume=auto"], steps=12)
    assert rc == 0 and "resumed from" in text and "step 3" in text
    assert load_ckpt(run)[0]["step"] == 12
    assert not os.path.exists(partial)
