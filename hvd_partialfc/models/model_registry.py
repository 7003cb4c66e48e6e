"""The backbone registry: ``register_model`` (a decorator) and ``create_model`` (the one factory)."""
from __future__ import annotations

from typing import Callable, Dict

import torch.nn as nn

from ..config import did_you_mean

_MODELS: Dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    def deco(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ValueError(f"backbone {name!r} registered twice")
        _MODELS[name] = fn
        return fn
    return deco


def register_variant(name: str, build: Callable[..., nn.Module], doc: str) -> None:
    """A family's builder made in a loop (iresnet50, vit_b, ...): named ``name``, documented, registered."""
    build.__name__, build.__doc__ = name, doc
    register_model(name)(build)


def list_models():
    return sorted(_MODELS)


def create_model(name: str, **kwargs) -> nn.Module:
    if name not in _MODELS:
        raise ValueError(f"unknown backbone {name!r}; known: {', '.join(list_models())}{did_you_mean(name, list_models())}")
    return _MODELS[name](**kwargs)


def model_input_shape(in_shape) -> list:
    """A backbone's input per sample, as ``data.prepare_batch`` makes it from the sample shape: features
    (F,) stay (F,), grey images (H, W) -> (1, H, W), images (H, W, C) -> (C, H, W)."""
    shape = [int(s) for s in in_shape]
    return {1: shape, 2: [1] + shape, 3: shape[2:] + shape[:2]}[len(shape)]
