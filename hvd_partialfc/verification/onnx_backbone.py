"""``hvd-partialfc eval --backbone model.onnx``: an ONNX face model evaluated by the same protocols as a PyTorch
backbone (pairs, all-pairs, IJB-B/C, identification): InsightFace's model-zoo recognition models, arcface_torch's
``torch2onnx.py`` output, or this package's ``export --onnx``. The baseline a team compares against is often
such a file; scored here, it meets the same pairs, templates and metrics as the model trained here.

The file runs in onnxruntime (CPU; CUDA when its GPU build sees one), never in Python: nothing in it executes
here but the graph. Its first input must be (batch, C, H, W); the batch may be fixed (then fed in chunks of it,
the last padded). The embedding is the first output, (batch, D).

Pixels. This package's pipeline gives a backbone RGB images as ``(pixel - 127.5) / 127.5``, which is what
arcface_torch's ONNX files and this package's take. Models converted from MXNet (InsightFace's older releases)
normalise inside the graph and take raw 0..255 pixels: their first nodes subtract and multiply. ``pixels``
``auto`` (the default) feeds raw pixels when a Sub and a Mul are among the graph's first 8 nodes, else the
normalised ones; ``normalized`` and ``pixels`` force either (``eval --onnx-input``).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.nn as nn

INPUTS = ("auto", "normalized", "pixels")
FIRST_NODES = 8


def takes_raw_pixels(path: str) -> bool:
    """Whether the graph normalises its input itself: a Sub and a Mul among its first ``FIRST_NODES`` nodes."""
    import onnx
    ops = {node.op_type for node in onnx.load(path, load_external_data=False).graph.node[:FIRST_NODES]}
    return {"Sub", "Mul"} <= ops


class OnnxBackbone(nn.Module):
    """``forward(x)``: (B, C, H, W) normalised images -> (B, D) float32 embeddings from the ONNX file's session."""

    def __init__(self, path: str, pixels: str = "auto", threads: int = 0):
        super().__init__()
        if pixels not in INPUTS:
            raise ValueError(f"--onnx-input {pixels!r}: one of {', '.join(INPUTS)}")
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ValueError(f"{path}: an ONNX model needs onnxruntime and onnx ({e}); scripts/setup/install.sh "
                             "installs them, or pip install onnxruntime onnx") from None
        options = ort.SessionOptions()
        if threads > 0:
            options.intra_op_num_threads = threads
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
        try:
            self.session = ort.InferenceSession(path, options, providers=providers)
        except Exception as e:     # not an ONNX file, or an operator this onnxruntime lacks
            raise ValueError(f"{path}: onnxruntime cannot load it ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]})") from None
        first = self.session.get_inputs()[0]
        shape = list(first.shape)
        if len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]):
            raise ValueError(f"{path}: its input {first.name} is {shape}; a face model's is (batch, C, H, W)")
        self.input_name, self.chw = first.name, tuple(shape[1:])
        self.batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else None
        self.raw = takes_raw_pixels(path) if pixels == "auto" else pixels == "pixels"
        self.path = path
        self.dim = int(self._run(np.zeros((1, *self.chw), np.float32)).shape[1])

    def _run(self, a: np.ndarray) -> np.ndarray:
        if self.batch is None:
            return self.session.run(None, {self.input_name: a})[0]
        outs = []
        for i in range(0, len(a), self.batch):
            chunk = a[i:i + self.batch]
            pad = self.batch - len(chunk)
            if pad:
                chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), chunk.dtype)])
            outs.append(self.session.run(None, {self.input_name: chunk})[0][:self.batch - pad])
        return np.concatenate(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.detach().float().cpu().numpy()
        if self.raw:
            a = a * 127.5 + 127.5
        out = self._run(np.ascontiguousarray(a, dtype=np.float32))
        return torch.from_numpy(np.asarray(out, np.float32).reshape(len(a), -1)).to(x.device)

    def model_args(self) -> Dict[str, Any]:
        """eval.json's ``model``: the file, its input (H, W, C) and width, and how its pixels were fed."""
        c, h, w = self.chw
        return {"name": "onnx", "file": self.path, "in_shape": [h, w] if c == 1 else [h, w, c],  # (grey: H, W)
                "embedding_dim": self.dim, "kwargs": {},
                "input": "pixels 0..255" if self.raw else "(pixel - 127.5) / 127.5"}


def load_onnx_backbone(path: str, pixels: str = "auto") -> Tuple[nn.Module, Dict[str, Any]]:
    model = OnnxBackbone(path, pixels, torch.get_num_threads())
    return model.eval(), model.model_args()
