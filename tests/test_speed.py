"""The GPU speed settings on CPU (run/speed.py): the head's product precision, channels_last, the config keys."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hvd_partialfc.classifier.margins import create_margin, margin_cross_entropy
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.run.speed import resolve_matmul, to_channels_last


def _case(seed=0, m=24, w=300, d=32):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(m, d, generator=g, requires_grad=True)
    weight = (0.01 * torch.randn(w, d, generator=g)).requires_grad_(True)
    labels = torch.randint(0, w, (m,), generator=g)
    labels[::5] = -1                                    # rows whose class is elsewhere (global mode's)
    return feats, weight, labels


def test_bf16_products_are_the_rounded_operands_products_with_float32_sums():
    feats, weight, labels = _case()
    margin = create_margin("arcface", 32.0, 0.3)
    loss = margin_cross_entropy(feats, weight, labels, margin, matmul="bf16")
    fp32 = margin_cross_entropy(feats, weight, labels, margin)
    # independent reference: the unfused formula on bf16-rounded operands, float32 everywhere else
    xn = F.normalize(feats.float())
    r = lambda t: t.detach().to(torch.bfloat16).float()   # noqa: E731
    cos = (r(xn) @ r(weight).t() / weight.detach().norm(dim=1).clamp_min(1e-12)).clamp(-1, 1)
    logits = margin(cos, labels)
    keep = labels >= 0                                  # a row without a target here: log-sum-exp only
    target = torch.where(keep, logits[torch.arange(len(labels)), labels.clamp_min(0)], 0.0)
    ref = (torch.logsumexp(logits, 1) - target).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert loss.item() != fp32.item() and loss.item() == pytest.approx(fp32.item(), rel=1e-2)
    gw16, gx16 = torch.autograd.grad(loss, (weight, feats))
    gw32, gx32 = torch.autograd.grad(fp32, (weight, feats))
    for a, b in ((gw16, gw32), (gx16, gx32)):   # bf16's 8 bits: ~1% of the gradient's norm, not more
        assert 0 < ((a - b).norm() / b.norm()).item() < 0.03


def test_tf32_on_cpu_is_fp32_bitwise():
    feats, weight, labels = _case(1)
    margin = create_margin("cosface", 16.0, 0.2)
    a = margin_cross_entropy(feats, weight, labels, margin)
    b = margin_cross_entropy(feats, weight, labels, margin, matmul="tf32")
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a, weight)[0], torch.autograd.grad(b, weight)[0])
    assert torch.backends.cuda.matmul.allow_tf32 is False   # put back


def test_matmul_auto_and_the_keys():
    assert resolve_matmul("auto", torch.device("cpu")) == "fp32"
    assert resolve_matmul("auto", torch.device("cuda", 0)) == "tf32"
    assert resolve_matmul("bf16", torch.device("cpu")) == "bf16"
    cfg = load_config(overrides=["data.shards=x"])
    assert (cfg.head.matmul, cfg.train.cudnn_benchmark, cfg.train.channels_last) == ("auto", True, False)
    with pytest.raises(ConfigError, match="head.matmul"):
        load_config(overrides=["data.shards=x", "head.matmul=fp16"])


def test_channels_last_keeps_the_state_and_close_outputs():
    from hvd_partialfc.models import create_model
    torch.manual_seed(0)
    a = create_model("resnet", in_shape=[32, 32], embedding_dim=16, width=4).eval()
    b = create_model("resnet", in_shape=[32, 32], embedding_dim=16, width=4).eval()
    b.load_state_dict(a.state_dict())
    cfg = load_config(overrides=["data.shards=x", "train.channels_last=true"])
    to_channels_last(b, cfg)
    conv = next(p for p in b.parameters() if p.dim() == 4)
    assert conv.is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    x = torch.randn(4, 1, 32, 32)
    out = b(x.contiguous(memory_format=torch.channels_last))
    assert torch.allclose(a(x), out, rtol=1e-4, atol=1e-5)   # CPU: other kernels, the last bits may differ
