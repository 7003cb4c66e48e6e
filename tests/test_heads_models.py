"""Margin losses against their formulas; the local classifier; the backbone factory."""
import math

import pytest
import torch
import torch.nn.functional as F

from hvd_partialfc.classifier.margins import LocalClassifier, create_margin, list_losses
from hvd_partialfc.models import create_model, list_models


def _manual_logits(loss, cos, labels, s, m):
    out = cos.clone()
    for i, y in enumerate(labels.tolist()):
        if y < 0:
            continue
        c = float(cos[i, y])
        theta = math.acos(max(-1.0, min(1.0, c)))
        if loss == "cosface":
            out[i, y] = c - m
        elif loss == "arcface":
            out[i, y] = math.cos(theta + m) if theta + m <= math.pi else c - math.sin(math.pi - m) * m
    return out * s


@pytest.mark.parametrize("loss", ["cosface", "arcface"])
def test_margin_matches_formula(loss):
    torch.manual_seed(0)
    cos = torch.empty(64, 10).uniform_(-1, 1)
    cos[0, 3] = -0.99  # theta + m > pi: the continuation branch
    labels = torch.randint(0, 10, (64,))
    labels[0], labels[5] = 3, -1  # -1: class not in this slice, no margin
    got = create_margin(loss, scale=30.0, margin=0.35)(cos, labels)
    assert torch.allclose(got, _manual_logits(loss, cos, labels, 30.0, 0.35), atol=1e-5)


def test_labels_not_modified_and_softmax_is_linear():
    torch.manual_seed(0)
    head = LocalClassifier(7, 16, loss="softmax")
    x, y = torch.randn(5, 16), torch.tensor([0, 6, 3, 3, 1])
    y0 = y.clone()
    loss = head(x, y)
    assert torch.equal(y, y0)
    assert torch.allclose(loss, F.cross_entropy(x @ head.weight.t(), y))


def test_arcface_loss_decreases_when_training_the_head():
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    head = LocalClassifier(4, 8, loss="arcface", scale=16, margin=0.2)
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    first = head(x, y).item()
    for _ in range(50):
        opt.zero_grad()
        head(x, y).backward()
        opt.step()
    assert head(x, y).item() < first


def test_unknown_names_list_known_ones():
    with pytest.raises(ValueError, match="known: arcface, cosface, softmax"):
        create_margin("sphereface")
    with pytest.raises(ValueError, match=r"known: iresnet100, iresnet18, .*mlp, mobilefacenet, resnet"):
        create_model("vit", in_shape=[32, 32])
    assert set(list_losses()) == {"softmax", "cosface", "arcface"}


@pytest.mark.parametrize("size,channels", [(32, 0), (64, 3), (112, 3), (48, 1)])
def test_resnet_sizes(size, channels):
    shape = [size, size] + ([channels] if channels else [])
    m = create_model("resnet", in_shape=shape, embedding_dim=32, width=8).eval()
    x = torch.randn(2, channels or 1, size, size)
    assert m(x).shape == (2, 32)
    assert any(isinstance(b, torch.nn.BatchNorm2d) for b in m.modules())


def test_resnet_rejects_tiny_images_and_mlp_takes_features():
    with pytest.raises(ValueError, match="32..112"):
        create_model("resnet", in_shape=[16, 16])
    m = create_model("mlp", in_shape=[20], embedding_dim=8).eval()
    assert m(torch.randn(3, 20)).shape == (3, 8)
    assert "resnet18" in list_models()
