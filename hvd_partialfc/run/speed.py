"""The GPU speed settings (docs/gpu.md, "Speed on the GPU"): cuDNN's autotuner, channels_last, and the
precision of the head's matrix products. None of them changes an fp32 CPU run's numbers at its default.

* ``train.cudnn_benchmark`` (default on, as arcface_torch): cuDNN times its convolution algorithms for each
  new input shape once and keeps the fastest. The trainer's shapes are fixed (one batch size, one image
  size), so the search runs at the first step only. CPU: no effect.
* ``train.channels_last`` (default off): the backbone's 4-D weights and its image input in NHWC layout,
  what Tensor Cores read without a transpose under fp16 / bf16 autocast. CPU: allowed, but other
  convolution kernels run, so its numbers may differ from the contiguous run's in the last bits.
* ``head.matmul`` (``auto``: ``tf32`` on CUDA, ``fp32`` elsewhere): the head's three (M, W)-sized products
  (margins.py ``MATMUL``); the softmax's exponentials and sums stay float32 in every case.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def resolve_matmul(setting: str, device: torch.device) -> str:
    """``head.matmul`` for ``device``: ``auto`` is ``tf32`` on CUDA (TF32 products, float32 sums: the
    head's 0.4 TFLOP a step of ``global`` at 8 x 128 and 125k classes a GPU off the float32 units) and
    ``fp32`` elsewhere (today's CPU arithmetic, bitwise)."""
    if setting == "auto":
        return "tf32" if device.type == "cuda" else "fp32"
    return setting


def set_device_flags(cfg, device: torch.device) -> None:
    """Process-wide flags of ``device``: cuDNN's autotuner on CUDA (``train.cudnn_benchmark``)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = bool(cfg.train.cudnn_benchmark)


def to_channels_last(backbone: nn.Module, cfg) -> nn.Module:
    """The backbone's 4-D tensors in channels_last layout when ``train.channels_last`` (the step converts
    its image batches too); its state dict keeps the same values and names."""
    if cfg.train.channels_last:
        backbone.to(memory_format=torch.channels_last)
    return backbone
