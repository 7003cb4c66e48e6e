"""The backbone registry: ``register_model`` (a decorator) and ``create_model`` (the one factory)."""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..registry import Registry

MODELS: Registry[Callable[..., nn.Module]] = Registry("backbone")
register_model = MODELS.register


def register_variant(name: str, build: Callable[..., nn.Module], doc: str) -> None:
    """A family's builder made in a loop (iresnet50, vit_b, ...): named ``name``, documented, registered."""
    build.__name__, build.__doc__ = name, doc
    register_model(name)(build)


def list_models():
    return MODELS.names()


def create_model(name: str, **kwargs) -> nn.Module:
    return MODELS.get(name)(**kwargs)


def model_input_shape(in_shape) -> list:
    """A backbone's input per sample, as ``data.prepare_batch`` makes it from the sample shape: features
    (F,) stay (F,), grey images (H, W) -> (1, H, W), images (H, W, C) -> (C, H, W)."""
    shape = [int(s) for s in in_shape]
    return {1: shape, 2: [1] + shape, 3: shape[2:] + shape[:2]}[len(shape)]
