"""MobileFaceNet as arcface_torch's ``mbf`` (``get_mbf``): the same layers, ``state_dict`` keys and shapes.

Layout (Chen et al., MobileFaceNets; arcface_torch's variant with width ``scale`` = 2): a 3x3 stride-2
conv, a grouped 3x3 conv (or residual bottlenecks when ``blocks[0]`` > 1), then bottlenecks (1x1 expand,
depthwise 3x3, 1x1 linear projection) in four stages of ``blocks`` = (1, 4, 6, 2), a 1x1 conv to 512, and
the GDC head: a 7x7 depthwise conv, flatten, Linear(512, D, no bias), BN1d. Each conv is followed by BN
(default eps 1e-5) and, except the linear projections, PReLU. Kaiming-normal (fan_out) initialisation of
convs and the linear layer. arcface_torch's ``mbf_large`` is ``blocks=(2, 8, 12, 4), scale=4``.

Like iresnet, the 7x7 head needs 112x112 input (112 / 2**4 = 7); other sizes are refused when built.
``checkpoint_activations``: each entry of ``layers`` is a checkpoint segment.
The attribute names (``layers``, ``conv_sep``, ``features`` and the nested ``layers``) are the keys of
arcface_torch's files; the module code is this package's own.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .model_registry import register_model
from .iresnet import face_input_channels
from .recompute import run_segment


class ConvBN(nn.Module):
    """Conv (no bias) -> BN [-> PReLU]; ``layers`` holds them (keys ``layers.0/1/2``). Padding: "same"
    (kernel // 2) unless given (the GDC head's 7x7 conv has none: 7x7 -> 1x1)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True,
                 padding: int = -1):
        super().__init__()
        padding = kernel // 2 if padding < 0 else padding
        parts = [nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            parts.append(nn.PReLU(cout))
        self.layers = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Bottleneck(nn.Module):
    """1x1 to ``hidden`` channels, depthwise 3x3 (``stride``), linear 1x1 to ``cout``; + x if ``residual``."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int, residual: bool):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(ConvBN(cin, hidden), ConvBN(hidden, hidden, 3, stride, groups=hidden),
                                    ConvBN(hidden, cout, act=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return x + y if self.residual else y


class Stage(nn.Module):
    """``n`` residual bottlenecks at constant width (keys ``layers.K``)."""

    def __init__(self, c: int, n: int, hidden: int):
        super().__init__()
        self.layers = nn.Sequential(*[Bottleneck(c, c, hidden, 1, True) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GDC(nn.Module):
    """Global depthwise conv head: 7x7 depthwise conv + BN, flatten, Linear(512, D, no bias), BN1d."""

    def __init__(self, embedding_dim: int, channels: int = 512):
        super().__init__()
        self.layers = nn.Sequential(ConvBN(channels, channels, 7, groups=channels, act=False, padding=0), nn.Flatten(),
                                    nn.Linear(channels, embedding_dim, bias=False), nn.BatchNorm1d(embedding_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MobileFaceNet(nn.Module):
    def __init__(self, embedding_dim: int = 512, in_channels: int = 3, blocks: Sequence[int] = (1, 4, 6, 2),
                 scale: int = 2, checkpoint_activations: bool = False):
        super().__init__()
        c1, c2 = 64 * scale, 128 * scale
        first = (ConvBN(c1, c1, 3, groups=64) if blocks[0] == 1 else Stage(c1, blocks[0], 128))
        self.layers = nn.ModuleList([
            ConvBN(in_channels, c1, 3, 2),                 # 112 -> 56
            first,
            Bottleneck(c1, c1, 128, 2, False),             # 56 -> 28
            Stage(c1, blocks[1], 128),
            Bottleneck(c1, c2, 256, 2, False),             # 28 -> 14
            Stage(c2, blocks[2], 256),
            Bottleneck(c2, c2, 512, 2, False),             # 14 -> 7
            Stage(c2, blocks[3], 256),
        ])
        self.conv_sep = ConvBN(c2, 512)
        self.features = GDC(embedding_dim)
        self.embedding_dim = embedding_dim
        self.checkpoint_activations = checkpoint_activations
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = run_segment(layer, x, self.checkpoint_activations)   # ends at (B, 128 * scale, 7, 7)
        return self.features(self.conv_sep(x))                        # (B, 512, 7, 7) -> (B, D)


@register_model("mobilefacenet")
def mobilefacenet(in_shape=(112, 112, 3), embedding_dim: int = 512, blocks: Sequence[int] = (1, 4, 6, 2),
                  scale: int = 2, checkpoint_activations: bool = False) -> nn.Module:
    """arcface_torch's mbf (~2.0 M parameters at D = 512); 112x112 input."""
    return MobileFaceNet(embedding_dim, face_input_channels("mobilefacenet", in_shape), list(blocks), scale,
                         checkpoint_activations)
