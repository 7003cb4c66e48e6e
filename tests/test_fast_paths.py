"""The fast-path switches on CPU (run/speed.py, run/skips.py): each one reaches what it switches, changes no
number where it must not, and falls back cleanly. Their speed is the GPU's to measure (docs/gpu.md)."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_GPU
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.digest import state_digest
from hvd_partialfc.engine.local import LocalComm
from hvd_partialfc.run import speed
from hvd_partialfc.run.startup import start_trainer
from hvd_partialfc.run.skips import NonFiniteError

FUSED = ["optim.backbone_kernel=fused", "optim.classifier_kernel=fused"]
DEVICE = ["train.skip_decision=device", *FUSED]
MLP = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}"]
RESNET = ["model.name=resnet", "model.embedding_dim=16", "model.kwargs={width: 4}"]


def _trainer(shards, out, sets):
    cfg = load_config(overrides=["data.batch_size=8", "train.threads=1", "data.workers=0", "train.steps=8",
                                 "head.negatives_every=0", *sets], extra={"data": {"shards": shards}, "out": str(out)})
    return start_trainer(cfg, LocalComm())


def _run(shards, out, sets, nan_at=(), steps=5):
    """Steps of a one-rank trainer, a NaN put into the batch of each step in ``nan_at``; the figures are never
    read (as between log lines). Returns (trainer, the error raised or None, steps begun)."""
    rng = torch.get_rng_state()
    trainer = _trainer(shards, out, sets)
    loader = iter(trainer.loader)
    err, step = None, 0

    def batches(step):
        while True:
            x, y = next(loader)
            if step in nan_at:
                x = x.clone()
                x[0, 0] = float("nan")
            yield x, y
    try:
        for step in range(steps):
            trainer.train_step(step, batches(step))
    except NonFiniteError as e:
        err = e
    finally:
        torch.set_rng_state(rng)
    return trainer, err, step


def _books(trainer):
    state = trainer.parts.training_state(trainer.layout, 0)     # (device decision: the books settled first)
    return (state_digest(trainer.parts.backbone), state_digest(trainer.parts.head), dict(state.counters))


@pytest.mark.parametrize("sets", [["train.precision=fp16"], ["train.on_nonfinite=skip"]], ids=["fp16", "fp32-skip"])
def test_the_device_decision_is_the_host_decision(sets, feature_shards, tmp_path):
    """The same fused kernels, decided on the host or on the device: bitwise the same parameters, momentum,
    counters and fp16 loss scale, through skipped steps (the first step's too: its momentum) and taken ones."""
    host, _, _ = _run(feature_shards, tmp_path / "h", MLP + FUSED + sets, nan_at=(0, 6), steps=8)
    device, _, _ = _run(feature_shards, tmp_path / "d", MLP + DEVICE + sets, nan_at=(0, 6), steps=8)
    assert _books(device) == _books(host)
    assert _books(host)[2]["skipped_steps"] >= 2
    buffers = 0
    for h, d in ((host.parts.backbone_opt, device.parts.backbone_opt), (host.parts.head_opt, device.parts.head_opt)):
        params = lambda o: [p for g in o.param_groups for p in g["params"]]   # noqa: E731  (the same order)
        for ph, pd in zip(params(h), params(d)):    # the host's momentum bitwise; where it took no step yet, zeros
            want, got = h.state[ph].get("momentum_buffer"), d.state[pd].get("momentum_buffer")
            assert torch.equal(got, want) if want is not None else got is None or not got.any()
            buffers += want is not None
    assert buffers > 0


def test_the_device_decision_stops_a_step_later_having_changed_nothing(feature_shards, tmp_path):
    """train.on_nonfinite=stop: the host stops at the step; the device skips it in the kernels and stops at the
    next one, naming the same step; the skipped step left the parameters as the host's stop did."""
    host, host_err, host_at = _run(feature_shards, tmp_path / "h", MLP + FUSED, nan_at=(2,))
    assert host_at == 2 and "non-finite backbone gradient at step 2" in str(host_err)
    device, err, at = _run(feature_shards, tmp_path / "d", MLP + DEVICE, nan_at=(2,), steps=3)
    assert err is None                               # step 2's books are kept at step 3's end
    assert state_digest(device.parts.backbone) == state_digest(host.parts.backbone)
    device, err, at = _run(feature_shards, tmp_path / "d2", MLP + DEVICE, nan_at=(2,), steps=4)
    assert at == 3 and "non-finite backbone gradient at step 2" in str(err)


def test_the_device_decision_needs_the_fused_kernels(feature_shards, tmp_path):
    from hvd_partialfc.engine.base import RankFailure
    with pytest.raises(RankFailure, match="skip_decision=device .* set optim.backbone_kernel=fused"):
        _trainer(feature_shards, tmp_path / "r", MLP + ["train.skip_decision=device"])


def test_the_kernel_keys_reach_both_optimizers(feature_shards, tmp_path):
    flags = {"loop": (False, None), "foreach": (True, None), "fused": (None, True)}
    for kernel, (foreach, fused) in flags.items():
        parts = _trainer(feature_shards, tmp_path / kernel, MLP + [f"optim.backbone_kernel={kernel}",
                                                                    f"optim.classifier_kernel={kernel}"]).parts
        for opt in (parts.backbone_opt, parts.head_opt):
            assert [(g["foreach"], g["fused"]) for g in opt.param_groups] == [(foreach, fused)]
    default = _trainer(feature_shards, tmp_path / "default", MLP).parts
    assert [(g["foreach"], g["fused"]) for g in default.backbone_opt.param_groups] == [(None, None)]  # torch's choice


def test_auto_is_on_for_cuda_and_off_elsewhere():
    """Each key's `auto`: the fast path on a CUDA device, today's setting elsewhere (so a default moved to auto
    changes no CPU number); the defaults are off everywhere."""
    auto = load_config(overrides=["data.shards=x", "train.channels_last=auto", "optim.backbone_kernel=auto",
                                  "train.skip_decision=auto", "train.compile=auto"])
    assert speed.resolve_fast_paths(auto, torch.device("cuda", 0)) == speed.FastPaths(True, "fused", "device", "blocks")
    assert speed.resolve_fast_paths(auto, torch.device("cpu")) == speed.FastPaths(False, "torch", "host", "none")
    with pytest.raises(ConfigError, match="train.channels_last='fast': expected true, false or auto"):
        load_config(overrides=["data.shards=x", "train.channels_last=fast"])
    default = load_config(overrides=["data.shards=x"])
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        assert speed.resolve_fast_paths(default, device) == speed.FastPaths(False, "torch", "host", "none")


def test_auto_decides_on_the_host_where_a_kernel_is_not_fused():
    """The device decision resolved on (CUDA) with an optimizer group that is not torch's fused kernel (the
    sampled-rows step): `auto` goes back to the host decision, `device` is the error that names the keys."""
    w = torch.nn.Parameter(torch.zeros(2))
    fused, loop = torch.optim.SGD([w], lr=0.1, fused=True), torch.optim.SGD([w], lr=0.1)
    on = speed.FastPaths(False, "fused", "device", "none")
    for setting, opts, want in (("auto", [fused, fused], True), ("auto", [fused, loop], False),
                                ("device", [fused, fused], True)):
        cfg = load_config(overrides=["data.shards=x", f"train.skip_decision={setting}"])
        assert speed.device_skips_on(cfg, on, dict(zip(("backbone", "classifier"), opts))) is want
    with pytest.raises(ValueError, match="the classifier optimizer has groups without one"):
        speed.device_skips_on(load_config(overrides=["data.shards=x", "train.skip_decision=device"]), on,
                              {"backbone": fused, "classifier": loop})


@pytest.fixture
def eager_compiler(monkeypatch):
    """train.compile through dynamo with the "eager" backend: the tracing, the guards and the wrapping of the
    run's modules without inductor's code generation (half a minute a graph on 2 cores), so the numbers must
    be the uncompiled run's, bitwise."""
    monkeypatch.setattr(speed, "COMPILE_BACKEND", "eager")
    yield
    from hvd_partialfc.classifier.margins import compile_passes
    compile_passes(False)


def test_compile_keeps_the_numbers_and_the_checkpoint_keys(eager_compiler, image_shards, tmp_path):
    plain, _, _ = _run(image_shards, tmp_path / "plain", RESNET, steps=3)
    keys = list(plain.parts.backbone.state_dict())
    for sets, units in ((["train.compile=blocks"], 4), (["train.compile=model", "train.compile_head=true"], 1)):
        run, _, _ = _run(image_shards, tmp_path / sets[0][-6:], RESNET + sets, steps=3)
        info = run.parts.compiled
        assert (info["units"], info["compile_s"] > 0) == (units, True)
        assert list(run.parts.backbone.state_dict()) == keys
        assert _books(run) == _books(plain), sets
    assert "4 backbone blocks compiled in" in speed.compile_note(
        _trainer(image_shards, tmp_path / "n", RESNET + ["train.compile=blocks"]).parts.compiled)


def test_a_backend_that_cannot_compile_leaves_the_run_eager(monkeypatch, image_shards, tmp_path):
    def broken(graph, inputs):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(speed, "COMPILE_BACKEND", broken)
    plain, _, _ = _run(image_shards, tmp_path / "plain", RESNET, steps=2)
    run, _, _ = _run(image_shards, tmp_path / "broken", RESNET + ["train.compile=blocks", "train.compile_head=true"],
                     steps=2)
    assert "no C++ compiler here" in run.parts.compiled["fallback"]
    assert speed.compile_note(run.parts.compiled).startswith("warning: train.compile:")
    assert _books(run) == _books(plain)
    assert all("forward" not in vars(m) for m in run.parts.backbone.modules())   # the eager forward is back


def test_compile_units_are_the_residual_blocks():
    from hvd_partialfc.models import create_model
    from hvd_partialfc.models.iresnet import IBlock
    model = create_model("iresnet18", in_shape=[112, 112, 3], embedding_dim=8)
    units = speed.compile_units(model)
    assert len(units) == 8 and all(isinstance(u, IBlock) for u in units)
    assert speed.compile_units(create_model("mlp", in_shape=[16], embedding_dim=8, hidden_dim=8)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not (TEST_GPU and torch.cuda.is_available()),
                    reason="needs a GPU and HVD_PARTIALFC_TEST_GPU=1 (docs/gpu.md)")
def test_the_device_decision_on_cuda(feature_shards, tmp_path):
    """On CUDA, fp16: the device decision is the host's (CUDA's fused kernels with found_inf), through a
    skipped step; the speed stage of scripts/gpu/gpu_check.sh runs it (the GPU smoke subset runs it too)."""
    sets = MLP + ["train.precision=fp16", "train.device=cuda"]
    host, _, _ = _run(feature_shards, tmp_path / "h", sets + FUSED, nan_at=(6,), steps=8)
    device, _, _ = _run(feature_shards, tmp_path / "d", sets + DEVICE, nan_at=(6,), steps=8)
    assert _books(device) == _books(host) and _books(host)[2]["skipped_steps"] >= 1
