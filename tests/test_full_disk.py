"""A full disk while a checkpoint is written: the run folder fills up in the middle of the
run. Every rank stops with one CheckpointError naming the folder, its free space and the previous
checkpoint's size; the previous checkpoint and ``latest`` stay valid; the run resumed once there is room ends
bitwise where the uninterrupted run does. ``simulate`` with 2 virtual ranks in this process (the agreement is
the real one, engine/sim.py).

Two disks: ``injected`` runs anywhere: every file the checkpoint writes (they all go through ``atomic.py``'s
``open``) draws on a budget of free bytes, and a write past it raises ENOSPC, as a file system does;
``tmpfs`` is a real small file system filled to the last byte (root only: skipped elsewhere, the injected
one still runs)."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from conftest import read_json_lines, simulate_here

BASE = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 256}", "data.batch_size=8",
        "train.log_every=50", "data.workers=0", "head.negatives_every=0", "train.threads=1",
        "checkpoint.every=2", "checkpoint.keep=1"]
STEPS, FULL_AT = 6, 4          # checkpoints at 2, 4, 6; the disk fills up before (or while) the one of step 4
LEAVE = 131072                  # free bytes left before the checkpoint: the backbone's torch.save fails half-way


class InjectedDisk:
    """A folder whose writes through ``atomic.py`` draw on ``free`` bytes (None: no limit); a write past them
    writes what fits and raises OSError(ENOSPC)."""

    def __init__(self, path, monkeypatch):
        from hvd_partialfc import atomic
        self.path, self.free = path, None
        disk = self

        class Limited:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                if disk.free is not None and len(data) > disk.free:
                    self.f.write(data[:disk.free])
                    disk.free = 0
                    raise OSError(errno.ENOSPC, "No space left on device")
                if disk.free is not None:
                    disk.free -= len(data)
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        def limited_open(file, mode="r", *args, **kwargs):
            f = open(file, mode, *args, **kwargs)     # atomic.py writes through the descriptor it created
            where = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file
            inside = os.path.abspath(where).startswith(str(path) + os.sep)
            return Limited(f) if inside and any(c in mode for c in "wax+") else f
        monkeypatch.setattr(atomic, "open", limited_open, raising=False)

    def fill(self, leave: int = 0) -> None:
        self.free = leave

    def empty(self) -> None:
        self.free = None


class Tmpfs:
    """A 4 MiB tmpfs (room for about six of these 640 KB checkpoints), filled by a file to the last byte."""

    def __init__(self, path):
        self.path = path

    def fill(self, leave: int = 0) -> None:
        fill(self.path, leave)

    def empty(self) -> None:
        os.unlink(self.path / "filler")


@pytest.fixture(params=["injected", "tmpfs"])
def disk(request, tmp_path, monkeypatch):
    d = tmp_path / "disk"
    d.mkdir()
    if request.param == "injected":
        yield InjectedDisk(d, monkeypatch)
        return
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the injected disk runs here)")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()} (the injected disk runs here)")
    try:
        yield Tmpfs(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture(scope="module")
def straight(feature_shards, tmp_path_factory):
    """The uninterrupted run's last checkpoint (on the ordinary disk)."""
    return _sim(2, feature_shards, tmp_path_factory.mktemp("straight") / "run").checkpoint


def fill(folder, leave: int = 0) -> str:
    """Write a file in ``folder`` until the file system says ENOSPC, down to single bytes; then give
    ``leave`` bytes back."""
    path = os.path.join(folder, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 1 << 16, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)
    return path


def _sim(ranks, shards, out, *sets):
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, [*BASE, *sets, f"data.shards={shards}", f"out={out}", f"train.steps={STEPS}"])
    return simulate_here(cfg, ranks, 120)


def _state(ckpt):
    """Every tensor of a checkpoint's files, by file and key path (meta.json's digests included)."""
    import json
    out = {"digests": json.load(open(os.path.join(ckpt, "meta.json")))["digests"]}

    def walk(prefix, x):
        if torch.is_tensor(x):
            out[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)
    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".pt"):
            walk(name, torch.load(os.path.join(ckpt, name), weights_only=True))
    return out


def _fill_at_step_4(disk, monkeypatch, when, empty_at=None):
    """The disk fills up at the checkpoint of step FULL_AT (``when``: ``files``, before it: every rank's
    torch.save fails, RuntimeError; ``meta``: after the ranks' files were written: rank 0's meta.json fails,
    OSError, after the first agreement); with ``empty_at``, rank 0 makes room before that step. Returns
    {rank: the error its fit raised}, filled as the run goes."""
    from hvd_partialfc.run.watch import faults
    from hvd_partialfc.run import simulate as sim_module
    errors, real_start, real_pause = {}, sim_module.start_trainer, faults.pause

    def start(cfg, comm):
        trainer = real_start(cfg, comm)
        fit, step_fn = trainer.fit, trainer.train_step

        def recorded():
            try:
                return fit()
            except BaseException as e:
                errors[comm.rank] = e
                raise

        def train_step(step, batches):
            if when == "files" and comm.rank == 0 and step == FULL_AT - 1:
                disk.fill(leave=LEAVE)
            if comm.rank == 0 and step == empty_at:
                disk.empty()
            return step_fn(step, batches)
        trainer.fit, trainer.train_step = recorded, train_step
        return trainer

    def pause(kind, step, rank):                 # the point between the ranks' files and meta.json
        if when == "meta" and kind == "pause-in-ckpt" and step == FULL_AT and rank == 0:
            disk.fill()
        return real_pause(kind, step, rank)
    monkeypatch.setattr(sim_module, "start_trainer", start)
    monkeypatch.setattr(faults, "pause", pause)
    return errors


@pytest.mark.parametrize("when", ["files", "meta"])
def test_full_disk_at_a_checkpoint_training_goes_on_bitwise(feature_shards, straight, disk, monkeypatch, capsys,
                                                            when):
    """The default (``checkpoint.on_write_error=go_on``): the checkpoint of step 4 fails on every rank, the run
    says so (rank 0's line, a metrics.jsonl record with the folder's free space) and trains on in the same
    processes; room is made before step 6, whose checkpoint is written, and the run ends bitwise where the
    uninterrupted run does (the failed write changed no state: the buffers, the RNG streams, the optimizers).
    Before: every rank stopped, and the job was started again from step 2's checkpoint."""
    run = disk.path / "run"
    errors = _fill_at_step_4(disk, monkeypatch, when, empty_at=FULL_AT + 1)
    done = _sim(2, feature_shards, run)
    assert errors == {}
    said = [ln for ln in capsys.readouterr().out.splitlines() if "checkpoint not written" in ln]
    assert len(said) == 1 and said[0].startswith(f"step {FULL_AT}: checkpoint not written, training goes on"), said
    assert "step-00000002" in said[0]        # the last one written, named
    failed = [r for r in read_json_lines(run / "metrics.jsonl") if "checkpoint_failed" in r]
    assert [r["step"] for r in failed] == [FULL_AT] and " free; " in failed[0]["checkpoint_failed"]
    assert ("RuntimeError: [enforce fail" if when == "files" else "OSError: [Errno 28]") in failed[0]["checkpoint_failed"]
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-00000006"]
    want, got = _state(straight), _state(done.checkpoint)
    assert sorted(want) == sorted(got) and want["digests"] == got["digests"]
    assert all(torch.equal(want[k], got[k]) for k in want if k != "digests")


@pytest.mark.parametrize("when", ["files", "meta"])
def test_full_disk_at_a_checkpoint_stops_every_rank_and_resumes_bitwise(feature_shards, straight, disk,
                                                                         monkeypatch, when):
    """``checkpoint.on_write_error=stop`` (the default before): every rank stops with one error, and the job
    resumes bitwise once there is room. The last step's checkpoint stops the run whatever the key says (no
    later one would hold the run's end): tests/test_full_disk.py's last test."""
    from hvd_partialfc.engine.sim import SimAbort
    from hvd_partialfc.run.watch import faults
    from hvd_partialfc.run import simulate as sim_module
    from hvd_partialfc.run_files import CheckpointError, find_resume, read_meta
    from hvd_partialfc.run.simulate import SimFailure
    run, real_start, real_pause = disk.path / "run", sim_module.start_trainer, faults.pause
    errors = _fill_at_step_4(disk, monkeypatch, when)
    with pytest.raises(SimFailure) as failed:
        _sim(2, feature_shards, run, "checkpoint.on_write_error=stop")
    base = str(run / "checkpoints")
    first = failed.value.error
    assert isinstance(first, CheckpointError), f"{type(first).__name__}: {first}"
    msg = str(first)
    assert f"checkpoint of step {FULL_AT} not written" in msg and f"{base}: " in msg and " free; " in msg
    assert "the previous checkpoint step-00000002 takes " in msg and "resume with --resume auto" in msg
    # torch.save, the backbone's large records cut short: RuntimeError; meta.json's write: OSError
    assert ("rank 0: RuntimeError: [enforce fail" if when == "files" else "rank 0: OSError: [Errno 28]") in msg
    # every rank passed the agreement: it raised the same error, or (simulate only) was stopped by the
    # first one's while it waited for its turn to raise it
    assert sorted(errors) == [0, 1]
    for r, e in errors.items():
        assert isinstance(e, CheckpointError) and str(e) == msg or \
            isinstance(e, SimAbort) and f"(CheckpointError: {msg})" in str(e), f"rank {r}: {type(e).__name__}: {e}"
    # the previous checkpoint and latest are valid; the unfinished one is gone (its files freed the space)
    assert sorted(os.listdir(base)) == ["latest", "step-00000002"]
    assert find_resume(str(run)).endswith("step-00000002") and read_meta(find_resume(str(run)))["step"] == 2
    # room again: the same command resumes and ends bitwise where the uninterrupted run does
    monkeypatch.setattr(sim_module, "start_trainer", real_start)
    monkeypatch.setattr(faults, "pause", real_pause)
    disk.empty()
    resumed = _sim(2, feature_shards, run, "checkpoint.resume=auto").checkpoint
    want, got = _state(straight), _state(resumed)
    assert sorted(want) == sorted(got) and want["digests"] == got["digests"]
    assert all(torch.equal(want[k], got[k]) for k in want if k != "digests")


def test_the_last_steps_checkpoint_on_a_full_disk_stops_the_run(feature_shards, tmp_path, monkeypatch):
    """With the default ``go_on``, the last step's checkpoint is needed: on a full disk every rank stops with the
    error and what to do (the run's end is in no file yet; step 4's checkpoint, written, is ``latest``)."""
    from hvd_partialfc.run.simulate import SimFailure
    from hvd_partialfc.run_files import CheckpointError, find_resume
    from hvd_partialfc.run import simulate as sim_module
    (tmp_path / "disk").mkdir()
    disk = InjectedDisk(tmp_path / "disk", monkeypatch)
    real_start = sim_module.start_trainer

    def start(cfg, comm):
        trainer = real_start(cfg, comm)
        step_fn = trainer.train_step

        def train_step(step, batches):
            if comm.rank == 0 and step == STEPS - 1:
                disk.fill(leave=LEAVE)
            return step_fn(step, batches)
        trainer.train_step = train_step
        return trainer
    monkeypatch.setattr(sim_module, "start_trainer", start)
    with pytest.raises(SimFailure) as failed:
        _sim(2, feature_shards, disk.path / "run")
    assert isinstance(failed.value.error, CheckpointError)
    assert f"checkpoint of step {STEPS} not written" in str(failed.value.error)
    assert "resume with --resume auto" in str(failed.value.error)
    assert find_resume(str(disk.path / "run")).endswith("step-00000004")
