"""The identity of a model's state: sha256 over a state dict. Not a collective; no Horovod.

The identity check of the backbones across ranks (every rank's is the model) compares these digests (``engine/base.py``
gathers them); checkpoints record them, and a saved backbone file can be checked against them offline
(``export.py``).
"""
from __future__ import annotations

import hashlib
from typing import Dict

import torch


def state_dict_digest(state_dict: Dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict (names, dtypes, shapes, bytes) in sorted-name order."""
    h = hashlib.sha256()
    for k, v in sorted(state_dict.items()):
        t = v.detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(module: torch.nn.Module) -> str:
    return state_dict_digest(module.state_dict())
