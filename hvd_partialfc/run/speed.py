"""The GPU speed settings (docs/gpu.md, "Speed on the GPU"): cuDNN's autotuner, channels_last, the
precision of the head's matrix products, torch.compile and the optimizers' kernels. None of them changes
an fp32 CPU run's numbers at its default.

* ``train.cudnn_benchmark`` (default on, as arcface_torch): cuDNN times its convolution algorithms for each
  new input shape once and keeps the fastest. The trainer's shapes are fixed (one batch size, one image
  size), so the search runs at the first step only. CPU: no effect.
* ``train.channels_last`` (default off): the backbone's 4-D weights and its image input in NHWC layout,
  what Tensor Cores read without a transpose under fp16 / bf16 autocast. CPU: allowed, but other
  convolution kernels run, so its numbers may differ from the contiguous run's in the last bits.
* ``head.matmul`` (``auto``: ``tf32`` on CUDA, ``fp32`` elsewhere): the head's three (M, W)-sized products
  (margins.py ``MATMUL``); the softmax's exponentials and sums stay float32 in every case.
* ``train.compile`` (default none): the backbone's ``forward`` torch.compile'd (the module, its state-dict
  keys and its checkpoints stay as they are), the whole model's or each residual block's (``compile_units``);
  ``train.compile_mode``; ``train.compile_head``: the margin softmax's passes (margins.py ``compile_passes``).
  All compiled at start-up by one zero batch, timed and said; a backend that cannot compile there leaves
  the run eager, said at start-up, instead of failing at its first step. Figures: docs/gpu.md.
* ``optim.backbone_kernel`` / ``optim.classifier_kernel``: torch's loop, foreach or fused optimizer
  kernels (classifier/optimizers.py ``KERNELS``).
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.nn as nn

from ..classifier.margins import compile_passes, probe_passes
from ..models import model_input_shape
from ..models.recompute import batchnorm_stats_restored

# What ``auto`` turns on where the device is CUDA; elsewhere ``OFF``, today's CPU arithmetic. A key's default
# moves to ``auto`` in config.py when the GPU run measures it faster (docs/evidence/gpu.md, "Deciding the defaults"):
# one literal per key, and no CPU number changes with it.
ON_CUDA = {"channels_last": True, "backbone_kernel": "fused", "skip_decision": "device", "compile": "blocks"}
OFF = {"channels_last": False, "backbone_kernel": "torch", "skip_decision": "host", "compile": "none"}


@dataclass(frozen=True)
class FastPaths:
    """The fast-path keys as this run applies them on its device (``auto`` resolved)."""

    channels_last: bool
    backbone_kernel: str
    skip_decision: str
    compile: str


def resolve_fast_paths(cfg, device: torch.device) -> FastPaths:
    """``cfg``'s fast-path keys on ``device``: each ``auto`` is ``ON_CUDA``'s setting on CUDA, ``OFF``'s
    elsewhere. ``skip_decision: auto`` needs both optimizers fused; build_parts drops it to host where not."""
    t, o = cfg.train, cfg.optim
    values = {"channels_last": t.channels_last, "backbone_kernel": o.backbone_kernel,
              "skip_decision": t.skip_decision, "compile": t.compile}
    table = ON_CUDA if device.type == "cuda" else OFF
    return FastPaths(**{k: table[k] if v == "auto" else v for k, v in values.items()})


# The compiler behind train.compile; tests set "eager" (dynamo's tracing and the module wrapping without
# inductor's code generation: the numbers of the uncompiled model, in a second instead of half a minute).
COMPILE_BACKEND = "inductor"


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


def to_channels_last(backbone: nn.Module, cfg, device: torch.device = torch.device("cpu")) -> nn.Module:
    """The backbone's 4-D tensors in channels_last layout when ``train.channels_last`` is on for ``device``
    (the step converts its image batches too); its state dict keeps the same values and names."""
    if resolve_fast_paths(cfg, device).channels_last:
        backbone.to(memory_format=torch.channels_last)
    return backbone


def compile_units(model: nn.Module) -> List[nn.Module]:
    """The residual blocks of a backbone, for ``train.compile=blocks``: top-down, every module inside an
    ``nn.Sequential`` that has modules of its own (iresnet's ``IBlock``, resnet's ``IBasicBlock``,
    mobilefacenet's ``Bottleneck``), not looking inside one found. The stem and the embedding layers stay
    eager. Blocks of one shape share one compiled graph (torch traces the same code and guards on shapes,
    not on which block): resnet with blocks (1, 3, 3, 1) compiles its 8 blocks as 6 graphs."""
    units: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, nn.Sequential) and not isinstance(child, nn.Sequential) and any(child.children()):
                units.append(child)
            else:
                visit(child)
    visit(model)
    return units


def autocast_for(precision: str, device: torch.device):
    """The forward's autocast context of ``train.precision`` (fp32: none)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def compile_backbone(backbone: nn.Module, head: nn.Module, cfg, device: torch.device,
                     sample_shape) -> Dict[str, Any]:
    """``train.compile``: the backbone's ``forward`` (or each block's) replaced by its torch.compile'd self
    (the module, its state-dict keys and its hooks stay as they are); ``train.compile_head``: the softmax's
    passes too. Then one forward and backward of a zero batch of the run's shape, precision and layout
    compiles them now (BatchNorm statistics, gradients and random streams put back after), so that a
    backend that cannot compile here (no C++ compiler, no Triton) is found at start-up: the run goes on
    eager, saying why (``fallback``). Called before any optimizer hooks the parameters. Returns what was
    compiled, its seconds and where torch caches it."""
    t, scope = cfg.train, resolve_fast_paths(cfg, device).compile
    compile_passes(False)
    if scope == "none" and not t.compile_head:
        return {"compile": "none"}
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):    # one entry per block shape and mode (torch's name varies)
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    units = [backbone] if scope == "model" else compile_units(backbone) if scope == "blocks" else []
    if scope == "blocks" and not units:
        raise ValueError(f"train.compile=blocks: {type(backbone).__name__} has no residual blocks (modules inside "
                         "an nn.Sequential); use train.compile=model")
    mode = None if t.compile_mode == "default" else t.compile_mode
    # dynamic=False: one graph per shape (the run's shapes are fixed); with torch's automatic dynamic shapes
    # the second block shape recompiled symbolically and inductor 2.13 failed on it on CPU ("Cannot convert
    # expression to float")
    for unit in units:
        unit.forward = torch.compile(unit.forward, mode=mode, backend=COMPILE_BACKEND, dynamic=False)
    compile_passes(bool(t.compile_head), backend=COMPILE_BACKEND)
    info = {"compile": scope, "mode": t.compile_mode, "units": len(units), "head": bool(t.compile_head),
            "cache_dir": compile_cache_dir(), "backend": COMPILE_BACKEND}
    t0 = time.perf_counter()
    try:
        _compile_now(backbone, head, cfg, device, sample_shape)
    except Exception as e:     # the backend cannot compile here: eager, said at start-up
        for unit in units:
            del unit.forward
        compile_passes(False)
        why = " ".join(str(e).split())[:300]
        return dict(info, compile="none", head=False, fallback=f"{type(e).__name__}: {why}")
    return dict(info, compile_s=time.perf_counter() - t0)


def _compile_now(backbone: nn.Module, head: nn.Module, cfg, device: torch.device, sample_shape) -> None:
    """One training forward and backward of a zero batch through the compiled code (see compile_backbone)."""
    batch = cfg.data.batch_size
    x = torch.zeros(batch, *model_input_shape(list(sample_shape)), device=device)
    if resolve_fast_paths(cfg, device).channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    was = backbone.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), batchnorm_stats_restored(backbone):
        backbone.train()
        with autocast_for(cfg.train.precision, device):
            features = backbone(x)
        features.float().sum().backward()
        if cfg.train.compile_head:
            probe_passes(batch, head.width, head.margin, device)
    backbone.train(was)
    for p in backbone.parameters():
        p.grad = None


def compile_note(info: Dict[str, Any]) -> str:
    """The start-up line of ``train.compile`` / ``compile_head`` ("" when off): what compiled, in how long,
    where torch keeps it; or why it could not and that the run goes on eager."""
    if "fallback" in info:
        return (f"warning: train.compile: the {info['backend']} backend could not compile here ({info['fallback']}); "
                "training eager")
    if info.get("compile", "none") == "none" and not info.get("head"):
        return ""
    what = {"model": "the backbone", "blocks": f"{info['units']} backbone blocks"}.get(info["compile"], "")
    what = " and ".join(w for w in (what, "the softmax's passes" if info["head"] else "") if w)
    return (f"train.compile: {what} compiled in {info['compile_s']:.1f} s (mode {info['mode']}); torch keeps the "
            f"compiled code in {info['cache_dir']}, where a later run on this machine finds it")


def compile_cache_dir() -> str:
    """Where inductor keeps its compiled kernels and graphs between runs (``TORCHINDUCTOR_CACHE_DIR``, else
    torch's default under the system's temporary folder): a second run on the same machine loads them."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except ImportError:     # an older torch: its default, as it names it
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the system temporary folder's torchinductor_<user>")


def device_skips_on(cfg, fast: FastPaths, optimizers) -> bool:
    """Whether the step decides on the device (``train.skip_decision``, resolved in ``fast``): it skips inside
    torch's fused kernels (their ``found_inf``), so every param group of both optimizers must be fused (the
    sampled-rows step of sampled ``local`` is not). ``device`` without them is an error; ``auto``: host."""
    if fast.skip_decision != "device":
        return False
    for name, opt in optimizers.items():
        if any(not g.get("fused") for g in opt.param_groups):
            if cfg.train.skip_decision == "auto":
                return False
            raise ValueError(f"train.skip_decision=device skips inside torch's fused optimizer kernels, and the "
                             f"{name} optimizer has groups without one: set optim.backbone_kernel=fused and "
                             "optim.classifier_kernel=fused (sampled local, head.sample_rate < 1 with "
                             "head.sampled_step exact or lazy, steps its own way: use train.skip_decision=host)")
    return True
