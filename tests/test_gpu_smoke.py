"""The GPU smoke subset (marked ``gpu``): what would break on a GPU only, in short runs on one GPU.

* each engine at one rank (``horovodrun -np 1``, ``torchrun`` with one process), one launch each
  (tests/mr/engines_launch.py): every collective on CUDA tensors (NCCL where the build has it), then
  ``train.device=cuda`` with a local head for a few steps in fp16 and in bf16;
* two ranks on one GPU under torchrun: refused with the agreed error, and trained with ``train.share_gpu``;
* a checkpoint resumed on CUDA ends bitwise where the uninterrupted run does (dropout draws from the CUDA
  stream, so its state must come back), and the RNG codec's round trip on the GPU, old format included.

Skipped unless CUDA is available and ``HVD_PARTIALFC_TEST_GPU=1`` (conftest.py then shows the GPUs and skips
the CPU tests)::

    HVD_PARTIALFC_TEST_GPU=1 python -m pytest -m gpu tests

Run on one H200 on 2026-12-04 (docs/evidence/gpu.md): 46 s for the torch side, 26 s for Horovod's.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys

import pytest
import torch

from conftest import MR, ROOT, TEST_GPU, launch_env, read_json_lines, run_job, simulate_here

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (TEST_GPU and torch.cuda.is_available()),
                                 reason="needs a GPU and HVD_PARTIALFC_TEST_GPU=1 (docs/gpu.md)")]
if TEST_GPU:
    # cuBLAS is deterministic with a fixed workspace; read when this process makes its first cuBLAS handle,
    # after this line (only GPU tests run in a session with HVD_PARTIALFC_TEST_GPU=1)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

IMAGES = ["model.name=resnet", "model.kwargs={width: 4}", "data.batch_size=8", "train.log_every=2",
          "head.mode=local", "train.device=cuda"]
FEATURES = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
            "data.workers=0", "train.log_every=2", "train.device=cuda"]


def _env(**extra):
    """A launched job's environment: this checkout first on the path, then the session's (a Horovod built
    for the GPU may live there), and the GPUs shown."""
    e = launch_env()
    e["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    e.update(extra)
    return e


def _launch(launcher: str, np_: int):
    """The start of a command running ``SCRIPT ...`` or ``-m MODULE ...`` on ``np_`` ranks on this host."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np_), "--standalone"]
    from hvd_partialfc.engine.select import horovod_installed
    found = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    found = found if os.path.exists(found) else shutil.which("horovodrun")
    if not (found and horovod_installed()):
        pytest.skip("Horovod is not installed here (scripts/gpu/gpu_check.sh builds it)")
    return [found, "-np", str(np_), sys.executable]      # its own choice of Gloo or MPI, as built


def _args(shards, out, steps, sets):
    args = ["--shards", str(shards), "--out", str(out), "--steps", str(steps)]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_one_rank_collectives_and_training_on_the_gpu(image_shards, tmp_path, launcher):
    """One launch: the engine's primitives on CUDA tensors, then 4 steps of fp16 and of bf16 (local head,
    one DataLoader worker into pinned memory); the losses are finite, fp16's loss scale is logged."""
    items = [{"scenario": "primitives-cuda"}]
    for precision in ("fp16", "bf16"):
        sets = IMAGES + ["data.workers=1", f"train.precision={precision}"]
        items.append({"train": precision, "args": _args(image_shards, tmp_path / precision / "run", 4, sets)})
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path), "items": items}))
    p = run_job(_launch(launcher, 1) + [os.path.join(MR, "engines_launch.py"), str(spec)], _env(), timeout=240)
    logs = "".join(f.read_text()[-3000:] for f in tmp_path.glob("*/rank-0.log"))
    assert p.returncode == 0, f"{launcher} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}\n{logs}"
    assert (tmp_path / "primitives-cuda" / "rank-0.log").read_text() == "primitives ok\n"
    for precision in ("fp16", "bf16"):
        records = [r for r in read_json_lines(tmp_path / precision / "run" / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in records] == [2, 4]
        assert all(math.isfinite(r["loss"]) for r in records), records
        assert ("loss_scale" in records[-1]) == (precision == "fp16")


def test_two_ranks_on_one_gpu_are_refused_unless_allowed(feature_shards, tmp_path):
    """torchrun with 2 processes that see one GPU: both pick cuda:0, and the start-up refuses it with one
    agreed line (not NCCL's "Duplicate GPU" traceback); ``train.share_gpu=true`` trains over Gloo."""
    one = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    cmd = _launch("torchrun", 2) + ["-m", "hvd_partialfc.cli", "train"]
    env = _env(CUDA_VISIBLE_DEVICES=one)
    p = run_job(cmd + _args(feature_shards, tmp_path / "refused", 2, FEATURES), env, timeout=120)
    assert p.returncode != 0
    assert "ranks share a GPU (ranks 0, 1 on host" in p.stderr and "train.share_gpu=true" in p.stderr, p.stderr[-3000:]
    assert "Duplicate GPU" not in p.stderr
    p = run_job(cmd + _args(feature_shards, tmp_path / "shared", 2, FEATURES + ["train.share_gpu=true"]), env,
                timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert [r["step"] for r in read_json_lines(tmp_path / "shared" / "metrics.jsonl") if "loss" in r] == [2]


@contextlib.contextmanager
def _deterministic():
    """Torch's deterministic kernels (warnings, not errors, for any without one), put back after."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[2], was[3]


def test_resume_on_cuda_is_bitwise(image_shards, tmp_path):
    """6 steps straight, and 6 steps stopped by an error after the step-3 checkpoint then resumed (one
    virtual rank, in this process): the same backbone, optimizer, classifier, and CUDA random stream
    (dropout draws from it, so the resumed run matches only if the codec restored it).

    The control: the straight run twice, equal first, or the kernels are not deterministic and the resume
    comparison would mean nothing. On the first H200 (docs/evidence/gpu.md, 2026-12-04) the resnet's pooling to 4x4
    from a 2x2 map (32 px images) had no deterministic CUDA backward (adaptive_avg_pool2d sums with atomics)
    and the comparison failed; ``pool: 2`` makes the pooling the identity, one addend a gradient."""
    import pins
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.run.watch.faults import ENV
    from hvd_partialfc.run.simulate import SimFailure

    def sim(out, *sets, fault=None):
        cfg = load_config(None, [*IMAGES, "model.kwargs={width: 4, dropout: 0.3, pool: 2}", "checkpoint.every=3",
                                 f"data.shards={image_shards}", f"out={out}", "train.steps=6", *sets])
        if fault:
            os.environ[ENV] = fault
        try:
            return simulate_here(cfg, 1)
        finally:
            os.environ.pop(ENV, None)
    with _deterministic():
        sim(tmp_path / "straight")
        sim(tmp_path / "control")
        with pytest.raises(SimFailure):
            sim(tmp_path / "resumed", fault="raise@3")
        sim(tmp_path / "resumed", "checkpoint.resume=auto")
    last = lambda run: str(run / "checkpoints" / "step-00000006")  # noqa: E731
    a, b = pins.checkpoint_digests(last(tmp_path / "straight")), pins.checkpoint_digests(last(tmp_path / "resumed"))
    c = pins.checkpoint_digests(last(tmp_path / "control"))
    assert a == c, ("two straight runs differ: this GPU's kernels are not deterministic for the test model",
                    {k: (a[k][:12], c[k][:12]) for k in a if a[k] != c[k]})
    assert a == b, {k: (a[k][:12], b[k][:12]) for k in a if a[k] != b[k]}
    rng = torch.load(os.path.join(last(tmp_path / "straight"), "classifier-00000-of-00001.pt"),
                     weights_only=True)["rng"]
    assert torch.is_tensor(rng["cuda"]), "the current device's CUDA state is saved (one tensor, not a list)"


def test_rng_codec_round_trip_on_the_gpu(tmp_path):
    """The CUDA state saved (one tensor), written, read back (weights_only) and restored: the next draws
    repeat; an old checkpoint's list restores its current-device entry."""
    from hvd_partialfc.run_files import load_file
    from hvd_partialfc.run.ckpt.checkpoint_files import rng_state, set_rng_state
    torch.zeros(1, device="cuda")                    # CUDA started, as in a run: its state is saved then
    saved = rng_state()
    assert torch.is_tensor(saved["cuda"]) and saved["cuda"].dtype == torch.uint8
    want = torch.rand(8, device="cuda")
    other = torch.cuda.get_rng_state()               # a state that is not ``saved``'s
    torch.save(saved, tmp_path / "rng.pt")
    loaded = load_file(str(tmp_path / "rng.pt"))
    set_rng_state(loaded)
    assert torch.equal(torch.rand(8, device="cuda"), want)
    here = torch.cuda.current_device()
    old = [other] * (here + 2)
    old[here] = loaded["cuda"]
    set_rng_state(dict(loaded, cuda=old))
    assert torch.equal(torch.rand(8, device="cuda"), want)
