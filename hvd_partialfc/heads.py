"""The local classifier (width = the rank's slice) and the margin losses.

Contract: the classifier receives its width and the loss settings as constructor arguments; it never
reads rank state. Labels given to it are *local* (``y - start``) and are never modified in place.
A label of -1 means "this sample's class is not in this slice" (used by modes that score other ranks'
samples against a slice); such rows get no margin.

Losses (s = scale, m = margin, cos = normalised feature . normalised class centre):
* ``softmax``: plain linear logits ``x W^T`` (no normalisation), cross entropy;
* ``cosface`` (Wang et al. 2018): target logit ``s (cos - m)``, others ``s cos``;
* ``arcface`` (Deng et al. 2019): target logit ``s cos(theta + m)``, others ``s cos``; where
  ``theta + m > pi`` the curve is continued by ``cos - m sin(m)`` (InsightFace's CombinedMarginLoss), so
  the target logit stays monotone in theta.
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

_MARGINS: Dict[str, Callable[..., "MarginLoss"]] = {}


def register_margin(name: str):
    def deco(cls):
        _MARGINS[name] = cls
        return cls
    return deco


def list_losses():
    return sorted(_MARGINS)


def create_margin(name: str, scale: float = 64.0, margin: float = 0.5) -> "MarginLoss":
    if name not in _MARGINS:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(list_losses())}")
    return _MARGINS[name](scale=scale, margin=margin)


class MarginLoss(nn.Module):
    """Turns (cosines or raw logits, local labels) into the logits fed to cross entropy."""

    normalized = True

    def __init__(self, scale: float, margin: float):
        super().__init__()
        self.scale, self.margin = float(scale), float(margin)

    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # cos: (B, W) cosines; labels: (B,) local, -1 = class not in this slice
        has = labels >= 0
        rows = torch.nonzero(has, as_tuple=True)[0]
        cols = labels[rows]
        target = self.target_logit(cos[rows, cols])
        out = cos.index_put((rows, cols), target)  # out of place: autograd sees both paths
        return out * self.scale


@register_margin("softmax")
class Softmax(MarginLoss):
    normalized = False

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits


@register_margin("cosface")
class CosFace(MarginLoss):
    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        return cos_target - self.margin


@register_margin("arcface")
class ArcFace(MarginLoss):
    def __init__(self, scale: float, margin: float):
        super().__init__(scale, margin)
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.theta_limit = math.cos(math.pi - margin)     # beyond it theta + m would pass pi
        self.continuation = math.sin(math.pi - margin) * margin

    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        sin_target = torch.sqrt((1.0 - cos_target * cos_target).clamp_min(1e-7))
        cos_theta_m = cos_target * self.cos_m - sin_target * self.sin_m   # cos(theta + m)
        return torch.where(cos_target > self.theta_limit, cos_theta_m, cos_target - self.continuation)


class LocalClassifier(nn.Module):
    """The rank's class centres (width x dim) and its margin loss.

    ``width`` is ``end - start`` of the rank's slice and may differ between ranks. Weights start
    N(0, 0.01) as in InsightFace's PartialFC; they are seeded per rank by the caller.
    """

    def __init__(self, width: int, dim: int, loss: str = "arcface", scale: float = 64.0, margin: float = 0.5):
        super().__init__()
        self.width, self.dim = width, dim
        self.weight = nn.Parameter(torch.empty(width, dim).normal_(0, 0.01))
        self.margin = create_margin(loss, scale, margin)

    def logits(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, D) features, (B,) local labels -> (B, width) logits with the margin applied."""
        if self.margin.normalized:
            cos = F.linear(F.normalize(features.float()), F.normalize(self.weight.float())).clamp(-1, 1)
            return self.margin(cos, labels)
        return self.margin(F.linear(features.float(), self.weight.float()), labels)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the batch, on local labels."""
        return F.cross_entropy(self.logits(features, labels), labels)
