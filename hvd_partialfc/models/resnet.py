"""A small IResNet-style backbone (InsightFace's iresnet, scaled down) for 32-112 px images.

Pre-activation blocks BN-Conv-BN-PReLU-Conv-BN as in IResNet; a stride-1 stem; four stages that halve
the resolution; then BN -> dropout -> flatten -> Linear -> BN1d, the "output layer E" of ArcFace.
Flattening keeps spatial layout (it matters for faces and glyphs); to serve any input size from 32 to
112 px with one head, the last feature map is adaptive-average-pooled to ``pool`` x ``pool`` first.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from .model_registry import register_model


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride, 1, bias=False)


class IBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), conv3x3(cin, cout), nn.BatchNorm2d(cout), nn.PReLU(cout),
                                  conv3x3(cout, cout, stride), nn.BatchNorm2d(cout))
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        return self.body(x) + identity


class SmallIResNet(nn.Module):
    def __init__(self, in_channels: int, embedding_dim: int, widths: Sequence[int], blocks: Sequence[int],
                 pool: int = 4, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(conv3x3(in_channels, widths[0]), nn.BatchNorm2d(widths[0]), nn.PReLU(widths[0]))
        layers, cin = [], widths[0]
        for w, n in zip(widths, blocks):
            for i in range(n):
                layers.append(IBasicBlock(cin, w, stride=2 if i == 0 else 1))
                cin = w
        self.stages = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.pool = nn.AdaptiveAvgPool2d(pool)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin * pool * pool, embedding_dim)
        self.features = nn.BatchNorm1d(embedding_dim)
        self.embedding_dim = embedding_dim
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))          # (B, C, H/16, W/16)
        x = self.pool(self.bn(x)).flatten(1)   # (B, C * pool * pool)
        return self.features(self.fc(self.dropout(x)))  # (B, embedding_dim)


def _check_shape(in_shape) -> int:
    """Channels of an image sample shape (H, W) or (H, W, C); sizes outside 32..112 px are refused."""
    if len(in_shape) not in (2, 3):
        raise ValueError(f"resnet backbones take images (H, W[, C]); got sample shape {list(in_shape)}")
    h, w = int(in_shape[0]), int(in_shape[1])
    if not (32 <= h <= 112 and 32 <= w <= 112):
        raise ValueError(f"resnet backbones take 32..112 px images; got {h}x{w}")
    return 1 if len(in_shape) == 2 else int(in_shape[2])


@register_model("resnet")
def resnet(in_shape, embedding_dim: int = 128, width: int = 32, blocks: Sequence[int] = (1, 1, 1, 1),
           pool: int = 4, dropout: float = 0.0) -> nn.Module:
    """Small IResNet: widths width x (1, 2, 4, 8), one block per stage by default (~1.2M params at 32)."""
    return SmallIResNet(_check_shape(in_shape), embedding_dim, [width, 2 * width, 4 * width, 8 * width],
                        list(blocks), pool, dropout)


@register_model("resnet18")
def resnet18(in_shape, embedding_dim: int = 512, width: int = 64, pool: int = 4, dropout: float = 0.0) -> nn.Module:
    """IResNet-18 layout (2 blocks per stage, widths 64..512), adapted to 32..112 px inputs."""
    return SmallIResNet(_check_shape(in_shape), embedding_dim, [width, 2 * width, 4 * width, 8 * width],
                        [2, 2, 2, 2], pool, dropout)
