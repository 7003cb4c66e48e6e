"""IResNet-18/34/50/100/200/2060: InsightFace arcface_torch's face backbones, weight-compatible with its files.

The architecture (Deng et al., ArcFace; the "improved" residual unit BN-Conv-BN-PReLU-Conv-BN) and every
``state_dict`` key and shape are those of arcface_torch's ``backbones/iresnet.py``, so its published
``backbone.pth`` files load with ``strict=True`` (tests/test_face_backbones.py checks the full key table
of iresnet50 and the parameter counts). The module code is this package's own.

* Input: (B, C, 112, 112), C = 3 (or 1 for grey images: the stem's weight is then (64, 1, 3, 3) and
  arcface_torch files do not fit). Four stride-2 stages take 112 px to 7 x 7 and the head flattens the
  whole 512 x 7 x 7 map (ArcFace's "output layer E"), so other sizes cannot work with this head: they are
  refused when the model is built, with the reason. The small ``resnet`` backbones pool to a fixed grid
  and take 32..112 px.
* Head: BN2d -> dropout -> flatten -> Linear(512*7*7, D) -> BN1d, whose scale is fixed at 1 and not
  trained (``features.weight``, requires_grad False), as in arcface_torch.
* Precision: the stages follow the trainer's autocast (``train.precision``); the head (``fc``,
  ``features``) always runs in fp32, which is what arcface_torch's ``fp16=True`` does.
* BatchNorm eps 1e-5 everywhere; convolutions without bias, initialised N(0, 0.1); BN scale 1, shift 0;
  ``zero_init_residual`` zeroes each block's second BN scale (``bn2``, the one arcface_torch zeroes).
* ``checkpoint_activations``: each residual block is a checkpoint segment (``recompute.run_segment``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from .model_registry import register_variant
from .recompute import run_segment

LAYOUTS = {"iresnet18": (2, 2, 2, 2), "iresnet34": (3, 4, 6, 3), "iresnet50": (3, 4, 14, 3),
           "iresnet100": (3, 13, 30, 3), "iresnet200": (6, 26, 60, 6), "iresnet2060": (3, 128, 896, 3)}
WIDTHS = (64, 128, 256, 512)
INPUT_SIZE = 112
FINAL_SIZE = 7          # 112 / 2**4
EPS = 1e-5


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


class IBlock(nn.Module):
    """x + F(x) with F = BN, 3x3 conv, BN, PReLU, 3x3 conv (stride here), BN; a 1x1 conv + BN shortcut
    when the shape changes. Attribute names are arcface_torch's keys."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=EPS)
        self.conv1 = _conv(cin, cout, 3)
        self.bn2 = nn.BatchNorm2d(cout, eps=EPS)
        self.prelu = nn.PReLU(cout)
        self.conv2 = _conv(cout, cout, 3, stride)
        self.bn3 = nn.BatchNorm2d(cout, eps=EPS)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout, eps=EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return y + (x if self.downsample is None else self.downsample(x))


class IResNet(nn.Module):
    def __init__(self, blocks: Sequence[int], embedding_dim: int = 512, in_channels: int = 3,
                 dropout: float = 0.0, zero_init_residual: bool = False, checkpoint_activations: bool = False):
        super().__init__()
        if len(blocks) != 4:
            raise ValueError(f"iresnet: 4 stages, got blocks={list(blocks)}")
        self.conv1 = _conv(in_channels, WIDTHS[0], 3)
        self.bn1 = nn.BatchNorm2d(WIDTHS[0], eps=EPS)
        self.prelu = nn.PReLU(WIDTHS[0])
        cin = WIDTHS[0]
        for i, (width, n) in enumerate(zip(WIDTHS, blocks)):
            stage = [IBlock(cin if j == 0 else width, width, 2 if j == 0 else 1) for j in range(n)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            cin = width
        self.bn2 = nn.BatchNorm2d(cin, eps=EPS)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin * FINAL_SIZE * FINAL_SIZE, embedding_dim)
        self.features = nn.BatchNorm1d(embedding_dim, eps=EPS)
        self.embedding_dim = embedding_dim
        self.checkpoint_activations = checkpoint_activations
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            if zero_init_residual and isinstance(m, IBlock):
                nn.init.zeros_(m.bn2.weight)
        nn.init.ones_(self.features.weight)
        self.features.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))                     # (B, 64, 112, 112)
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                x = run_segment(block, x, self.checkpoint_activations)
        x = self.dropout(self.bn2(x)).flatten(1)                     # (B, 512 * 7 * 7)
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self.features(self.fc(x.float()))             # (B, D) in fp32
        return self.features(self.fc(x))                             # (B, D)


def face_input_channels(name: str, in_shape) -> int:
    """Channels of a (112, 112[, C]) sample shape; any other size is refused (the 7x7 head needs 112)."""
    shape = [int(s) for s in in_shape]
    if len(shape) not in (2, 3) or shape[:2] != [INPUT_SIZE, INPUT_SIZE]:
        raise ValueError(f"{name} takes 112x112 images (sample shape 112,112,3 or 112,112), got {shape}: its "
                         "head flattens the 7x7 map of a 112 px input (arcface_torch's layout). Align and crop "
                         "faces to 112x112, or use the `resnet` backbones, which take 32..112 px")
    channels = 1 if len(shape) == 2 else shape[2]
    if channels not in (1, 3):
        raise ValueError(f"{name} takes 1 or 3 channels, got {channels}")
    return channels


def _register(name: str) -> None:
    def build(in_shape=(112, 112, 3), embedding_dim: int = 512, dropout: float = 0.0,
              zero_init_residual: bool = False, checkpoint_activations: bool = False,
              blocks: Optional[Sequence[int]] = None) -> nn.Module:
        return IResNet(LAYOUTS[name] if blocks is None else blocks, embedding_dim, face_input_channels(name, in_shape),
                       dropout, zero_init_residual, checkpoint_activations)
    register_variant(name, build, f"arcface_torch's {name}: blocks per stage {LAYOUTS[name]} (``blocks``: others, e.g. "
                                  f"(1, 1, 1, 1) for a CPU-sized test), widths {WIDTHS}, 112x112 input.")


for _name in LAYOUTS:
    _register(_name)
