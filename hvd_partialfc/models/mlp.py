"""MLP backbone for feature-vector data (``features`` shards): Linear-BN-ReLU blocks, then an embedding.

BatchNorm is included on purpose: its running statistics are buffers that differ per rank (each rank sees
different classes), which is the case the trainer's buffer averaging exists for.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .model_registry import register_model


class MLP(nn.Module):
    def __init__(self, in_dim: int, embedding_dim: int = 128, hidden_dim: int = 256, depth: int = 2):
        super().__init__()
        layers, d = [], in_dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden_dim, bias=False), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True)]
            d = hidden_dim
        layers += [nn.Linear(d, embedding_dim, bias=False), nn.BatchNorm1d(embedding_dim)]
        self.net = nn.Sequential(*layers)
        self.embedding_dim = embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))  # (B, F) -> (B, embedding_dim)


@register_model("mlp")
def mlp(in_shape, embedding_dim: int = 128, hidden_dim: int = 256, depth: int = 2) -> nn.Module:
    in_dim = 1
    for s in in_shape:
        in_dim *= int(s)
    return MLP(in_dim, embedding_dim, hidden_dim, depth)
