"""arcface_torch's face backbones (iresnet18..200, mobilefacenet = mbf): key tables, parameter counts,
loading its files, the 112 px rule, and activation checkpointing (bitwise, BatchNorm statistics once)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hvd_partialfc.models import create_model
from hvd_partialfc.models.recompute import set_activation_checkpointing
from helpers_face import one_thread  # noqa: F401  (autouse fixture)
from helpers_face import iresnet_table, mbf_table, param_count, random_state

LAYOUTS = {"iresnet18": (2, 2, 2, 2), "iresnet34": (3, 4, 6, 3), "iresnet50": (3, 4, 14, 3),
           "iresnet100": (3, 13, 30, 3), "iresnet200": (6, 26, 60, 6), "iresnet2060": (3, 128, 896, 3)}
# Exact parameter counts at embedding 512 (features.weight, frozen at 1, included): arcface_torch's
# ~43.6 M (r50) and ~65.2 M (r100).
PARAMS = {"iresnet18": 24_025_600, "iresnet34": 34_139_328, "iresnet50": 43_590_848, "iresnet100": 65_156_160,
          "iresnet200": 118_833_920, "iresnet2060": 1_122_301_120, "mobilefacenet": 2_059_520}
FACE = [112, 112, 3]


def _table(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def test_iresnet50_state_dict_is_arcface_torchs():
    model = create_model("iresnet50", in_shape=FACE, embedding_dim=512)
    expected = iresnet_table(LAYOUTS["iresnet50"], 512)
    assert len(expected) == 475
    assert _table(model) == expected        # names, shapes and order
    assert model.features.weight.requires_grad is False and bool((model.features.weight == 1.0).all())
    assert model.bn1.eps == 1e-5 and model.layer3[5].bn3.eps == 1e-5 and model.features.eps == 1e-5
    state = random_state(expected)
    model.load_state_dict(state, strict=True)
    for key in ("layer3.13.conv2.weight", "fc.weight", "features.running_var", "layer4.0.downsample.1.bias"):
        assert torch.equal(model.state_dict()[key], state[key])


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_exact_parameter_counts(name):
    with torch.device("meta"):     # shapes only: iresnet200 in milliseconds
        model = create_model(name, in_shape=FACE, embedding_dim=512)
    table = iresnet_table(LAYOUTS[name], 512) if name in LAYOUTS else mbf_table(512)
    assert _table(model) == table
    assert sum(p.numel() for p in model.parameters()) == param_count(table) == PARAMS[name]


def test_mobilefacenet_loads_an_mbf_file_and_embeds():
    model = create_model("mobilefacenet", in_shape=FACE, embedding_dim=128)
    state = random_state(mbf_table(128))
    model.load_state_dict(state, strict=True)
    assert model.layers[1].layers[0].weight.shape == (128, 2, 3, 3)   # grouped conv, 64 groups
    assert model.eval()(torch.rand(2, 3, 112, 112) * 2 - 1).shape == (2, 128)


@pytest.mark.parametrize("name", ["iresnet50", "mobilefacenet"])
def test_other_input_sizes_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="112x112"):
        create_model(name, in_shape=[64, 64, 3], embedding_dim=512)
    with torch.device("meta"):
        grey = create_model(name, in_shape=[112, 112], embedding_dim=512)
    assert next(grey.parameters()).shape[1] == 1


def _step(model, x, ckpt):
    """One training forward/backward; (output, {name: grad}, {name: buffer})."""
    set_activation_checkpointing(model, ckpt)
    model.train()
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, {k: b.clone() for k, b in model.named_buffers()}


@pytest.mark.parametrize("name,kwargs", [("iresnet18", {}), ("mobilefacenet", {"scale": 1, "blocks": [1, 1, 1, 1]})])
def test_activation_checkpointing_is_bitwise_and_counts_batchnorm_once(name, kwargs):
    torch.manual_seed(0)
    plain = create_model(name, in_shape=FACE, embedding_dim=64, **kwargs)
    ckpt = create_model(name, in_shape=FACE, embedding_dim=64, **kwargs)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.rand(2, 3, 112, 112) * 2 - 1
    out_a, grads_a, bufs_a = _step(plain, x, False)
    out_b, grads_b, bufs_b = _step(ckpt, x, True)
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == sum(p.requires_grad for p in plain.parameters())
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    assert bufs_a.keys() == bufs_b.keys()
    assert all(torch.equal(bufs_a[k], bufs_b[k]) for k in bufs_a)
    assert all(int(v) == 1 for k, v in bufs_b.items() if k.endswith("num_batches_tracked"))
    # eval / no_grad: no checkpointing, the plain module
    with torch.no_grad():
        assert torch.equal(plain.eval()(x), ckpt.eval()(x))


def test_plain_torch_checkpoint_would_count_batchnorm_twice():
    """The control for the test above: torch.utils.checkpoint alone recomputes BatchNorm in training mode,
    so its statistics move twice per step (what ``recompute.run_segment`` prevents)."""
    torch.manual_seed(0)
    model = create_model("mobilefacenet", in_shape=FACE, embedding_dim=16, scale=1, blocks=[1, 1, 1, 1]).train()
    block = model.layers[2]
    x = torch.randn(2, 64, 56, 56, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert int(block.layers[0].layers[1].num_batches_tracked) == 2


def test_checkpoint_activations_refused_for_backbones_without_it():
    with pytest.raises(ValueError, match="checkpoint_activations"):
        set_activation_checkpointing(create_model("mlp", in_shape=[8], embedding_dim=4), True)


def test_estimate_reports_iresnet50_parameters(capsys):
    """``hvd-partialfc estimate --backbone iresnet50`` (the CLI's entry point, in this process) counts the
    face backbone's parameters exactly."""
    from hvd_partialfc.cli import main
    assert main(["estimate", "--classes", "1e6", "--world-size", "8", "--backbone", "iresnet50",
                 "--in-shape", "112,112,3", "--mode", "local"]) == 0
    assert "backbone iresnet50: 43,590,848 parameters" in capsys.readouterr().out
