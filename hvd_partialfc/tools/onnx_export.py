"""``hvd-partialfc export RUN --onnx --out model.onnx``: the backbone as an ONNX model, checked before written.

The model takes what arcface_torch's ONNX files take: float32 NCHW images already normalised
((pixel - 127.5) / 127.5, as ``data.prepare_batch`` does; features (B, F) for ``mlp``), with a dynamic
batch dimension (input ``input``, output ``embedding``: (B, D), not normalised).

Check: onnxruntime (CPU) and PyTorch embed the same ``samples`` = 64 random inputs in [-1, 1] (a batch of
64, while the graph was traced at batch 2: the dynamic batch is exercised too); the largest absolute
difference of the L2-normalised embeddings must be at most ``TOLERANCE`` = 1e-4, else the export fails
and no file is written (the bytes are checked in memory, then written by ``atomic.write_bytes``).
Measured (docs/evidence/faces.md): 1.1e-7 (mobilefacenet) to 8.2e-7 (iresnet100) at D = 512, 1.3e-6 for an iresnet18
after a training step; the limit leaves two orders of magnitude.

Exporter: torch's ``torch.export``-based ONNX exporter (``dynamo=True``, the default since torch 2.9;
needs onnxscript). The TorchScript exporter (``dynamo=False``) gave the same differences and exported
mobilefacenet in 4.5 s instead of 13 s here, but torch 2.13 marks it deprecated (DeprecationWarning) and
it is no longer developed; the export is a one-off, so the maintained path wins.
onnx, onnxscript and onnxruntime are optional: only this command imports them (scripts/setup/install.sh pins them).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Sequence

import numpy as np
import torch
import torch.nn as nn

from .. import atomic
from ..models.pretrained import build_backbone, load_backbone
from .export import ExportError, verified_backbone
from ..models import model_input_shape

TOLERANCE = 1e-4
SAMPLES = 64
TRACE_BATCH = 2


def _l2(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def onnx_bytes(model: nn.Module, in_shape: Sequence[int]) -> bytes:
    """The serialised ONNX model of ``model`` (eval mode) for samples of ``in_shape``, batch dynamic."""
    try:
        import onnxscript  # noqa: F401  (the exporter needs it; fail here with the install hint)
    except ImportError as e:
        raise ExportError(f"ONNX export needs onnx and onnxscript ({e}); scripts/setup/install.sh installs "
                          "them") from None
    example = torch.zeros(TRACE_BATCH, *model_input_shape(in_shape))
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(model.eval(), (example,), dynamo=True, verbose=False,
                                    input_names=["input"], output_names=["embedding"],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},))
    finally:
        quiet.setLevel(level)
    return program.model_proto.SerializeToString()


def max_normalised_diff(data: bytes, model: nn.Module, in_shape: Sequence[int], samples: int = SAMPLES,
                        seed: int = 0) -> float:
    """Largest |a - b| between the L2-normalised embeddings of onnxruntime and PyTorch on ``samples``
    random inputs in [-1, 1]."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ExportError(f"checking the ONNX model needs onnxruntime ({e}); scripts/setup/install.sh "
                          "installs it") from None
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(samples, *model_input_shape(in_shape), generator=g) * 2 - 1
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()   # the threads torch was given, no more
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    got = session.run(["embedding"], {"input": x.numpy()})[0]
    with torch.no_grad():
        want = model.eval()(x).numpy()
    if got.shape != want.shape:
        raise ExportError(f"onnxruntime returned {got.shape}, PyTorch {want.shape}")
    return float(np.abs(_l2(got.astype(np.float64)) - _l2(want.astype(np.float64))).max())


def export_onnx(model: nn.Module, in_shape: Sequence[int], out: str, tolerance: float = TOLERANCE,
                samples: int = SAMPLES) -> Dict[str, Any]:
    """Export, check against PyTorch, then write ``out`` atomically; nothing is written when the check fails."""
    data = onnx_bytes(model, in_shape)
    diff = max_normalised_diff(data, model, in_shape, samples)
    if not diff <= tolerance:
        raise ExportError(f"{out}: not written: the ONNX model's L2-normalised embeddings differ from PyTorch's "
                          f"by up to {diff:.3g} on {samples} random inputs (limit {tolerance:g})")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic.write_bytes(out, data)
    return {"out": out, "bytes": len(data), "max_abs_diff_normalised": diff, "samples": samples,
            "input": ["batch"] + model_input_shape(in_shape)}


def export_onnx_file(path: str, out: str, rank: int = 0) -> Dict[str, Any]:
    """``export --onnx``: from a run or checkpoint folder (rank ``rank``'s backbone, digests checked as for
    a plain export) or from an exported backbone file."""
    if os.path.isdir(path):
        state, meta, digest = verified_backbone(path, rank)
        model, m = build_backbone(state["model"], state["state_dict"]), state["model"]
        source = {"digest": digest, "step": meta["step"], "rank": rank}
    else:
        model, m = load_backbone(path)
        source = {}
    info = export_onnx(model, m["in_shape"], out)
    return {**info, **source, "model": m}
