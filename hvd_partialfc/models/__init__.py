"""Backbones: a small registry feeding one factory (timm's ``register_model`` / ``create_model``).

Every backbone maps a batch of inputs to embeddings (B, embedding_dim) and takes what it needs as
explicit constructor arguments: it never reads rank state and never moves itself to a device.
"""
from __future__ import annotations

from .model_registry import create_model, list_models, model_input_shape, register_model  # noqa: F401
from . import iresnet, mlp, mobilefacenet, resnet, vit  # noqa: E402,F401  (registers the backbones)
