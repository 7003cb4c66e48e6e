"""arcface_torch's training step, built from a user's own checkout of InsightFace at run time, for the
side-by-side benchmark (arcface_compare.py). Nothing of InsightFace is copied here: its ``backbones``,
``partial_fc_v2``, ``losses`` and ``lr_scheduler`` are imported from ``--arcface-dir`` under private names.

The step is train_v2.py's, per iteration: the backbone (its iresnet, ``fp16`` autocast inside it) wrapped in
DDP as train_v2 wraps it (engine/torchdist.py ``arcface_data_parallel``), PartialFC_V2 (its margin loss
``CombinedMarginLoss(64, 1.0, 0.5, 0.0)``, ``sample_rate``, fp32 logits: train_v2 passes ``fp16=False``),
then under fp16 ``GradScaler(growth_interval=100)``: scale, backward, unscale, ``clip_grad_norm_(backbone,
5)``, step, update, ``zero_grad``; the polynomial lr scheduler's step; ``loss.item()`` (train_v2 reads it
every step for its running mean). One SGD over both (lr 0.1, momentum 0.9, weight decay 5e-4).

On CPU (the tiny runs that test this script) PartialFC_V2 calls ``.cuda()`` on its tensors: while its step
runs, ``torch.Tensor.cuda`` returns the tensor itself (``cpu_cuda_calls``); on a GPU nothing is changed.
``gathered`` N > 1 gives its head the rows a rank of N holds after the all-gather (the batch's own plus
(N - 1) x B others, whose labels are classes of other ranks), without the communication: one rank's share
of an N-GPU job's head work (docs/benchmarks.md, "Side by side with arcface_torch").
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import torch

from .arcface_config import NETWORKS

# the backbones the side-by-side times, theirs -> ours (config --from-arcface's names; their ViTs need timm)
ARCFACE_NAMES = {name: NETWORKS[name] for name in ("r18", "r50", "r100", "vit_t", "vit_s", "vit_b")}


class ArcfaceDirError(ValueError):
    """``--arcface-dir`` holds no arcface_torch: one line, exit 2 (cli_support)."""


def find_arcface(path: str) -> str:
    """The arcface_torch folder in ``path``: the folder itself, or ``recognition/arcface_torch`` of an
    InsightFace checkout."""
    for cand in (path, os.path.join(path, "recognition", "arcface_torch")):
        if os.path.isfile(os.path.join(cand, "partial_fc_v2.py")) and os.path.isdir(os.path.join(cand, "backbones")):
            return os.path.abspath(cand)
    raise ArcfaceDirError(f"{path}: no arcface_torch here (partial_fc_v2.py and backbones/ are looked for in it and "
                          "in its recognition/arcface_torch); give --arcface-dir an InsightFace checkout "
                          "(git clone https://github.com/deepinsight/insightface)")


def _load(name: str, path: str, package: bool = False):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py") if package else path,
        submodule_search_locations=[path] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_LOADED: Dict[str, Dict[str, Any]] = {}


def load_arcface(path: str) -> Dict[str, Any]:
    """Its modules, imported from the checkout once per process: backbones (a package), partial_fc_v2, losses,
    lr_scheduler (a second import of the package would not rebind its submodules)."""
    root = find_arcface(path)
    if root not in _LOADED:
        _LOADED[root] = _import_all(root)
    return _LOADED[root]


def _import_all(root: str) -> Dict[str, Any]:
    return {"root": root, "backbones": _load("_arcface_backbones", os.path.join(root, "backbones"), package=True),
            "pfc": _load("_arcface_partial_fc_v2", os.path.join(root, "partial_fc_v2.py")),
            "losses": _load("_arcface_losses", os.path.join(root, "losses.py")),
            "lr": _load("_arcface_lr_scheduler", os.path.join(root, "lr_scheduler.py"))}


@contextmanager
def cpu_cuda_calls(device: torch.device) -> Iterator[None]:
    """On CPU, ``Tensor.cuda()`` returns the tensor (PartialFC_V2 moves its tensors with it); else nothing."""
    if device.type == "cuda":
        yield
        return
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = saved


class ArcfaceStep:
    """One train_v2 iteration on a batch of uint8 (B, H, W, C) images and global labels (see the module)."""

    def __init__(self, mods: Dict[str, Any], network: str, classes: int, sample_rate: float, fp16: bool,
                 device: torch.device, gathered: int = 1, ddp: bool = True, dim: int = 512, steps: int = 10 ** 6,
                 blocks: str = ""):
        from ..engine.torchdist import arcface_data_parallel
        self.device, self.fp16, self.gathered, self.classes = device, fp16, gathered, classes
        if blocks:    # its IResNet class with other blocks per stage (CPU-sized runs); else its get_model
            ir = mods["backbones"].iresnet
            backbone = ir.IResNet(ir.IBasicBlock, [int(b) for b in blocks.split(",")], dropout=0.0, num_features=dim,
                                  fp16=fp16)
        else:
            try:
                backbone = mods["backbones"].get_model(network, dropout=0.0, fp16=fp16, num_features=dim)
            except ModuleNotFoundError as e:       # its vit.py imports timm's layers
                raise ValueError(f"arcface_torch's {network} needs {e.name} (pip install {e.name})") from None
        backbone = backbone.to(device)
        self.backbone = arcface_data_parallel(backbone, device) if ddp else backbone
        self.backbone.train()
        margin = mods["losses"].CombinedMarginLoss(64, 1.0, 0.5, 0.0, 0)
        with cpu_cuda_calls(device):
            self.pfc = mods["pfc"].PartialFC_V2(margin, dim, classes, sample_rate, False).train().to(device)
        self.opt = torch.optim.SGD([{"params": self.backbone.parameters()}, {"params": self.pfc.parameters()}],
                                   lr=0.1, momentum=0.9, weight_decay=5e-4)
        self.sched, self.sched_dropped = build_scheduler(mods["lr"].PolynomialLRWarmup, optimizer=self.opt,
                                                         warmup_iters=0, total_iters=steps)
        self.scaler = torch.amp.GradScaler("cuda", growth_interval=100) if fp16 and device.type == "cuda" else None
        # steps asked for and optimizer steps taken: GradScaler skips the optimizer's step on an inf/nan
        # gradient, and a skipped step is cheaper, so a timed round counts them (arcface_compare.measure)
        self.calls, self.taken = 0, 0
        self.opt.register_step_post_hook(lambda *args: setattr(self, "taken", self.taken + 1))
        self.peers = self.peer_labels = None    # the other ranks' gathered rows (gathered > 1), made at the first batch

    def _head_input(self, emb: torch.Tensor, labels: torch.Tensor):
        """The embeddings and labels PartialFC_V2 scores: the batch's, plus the other ranks' rows."""
        if self.gathered == 1:
            return emb, labels.clone()
        b = emb.shape[0]
        if self.peers is None or self.peers.shape[0] != (self.gathered - 1) * b:
            g = torch.Generator(device="cpu").manual_seed(1)
            self.peers = torch.randn((self.gathered - 1) * b, emb.shape[1], generator=g).to(self.device)
            self.peer_labels = torch.randint(0, self.classes * self.gathered, ((self.gathered - 1) * b,),
                                             generator=g).to(self.device)
        return torch.cat([emb, self.peers.to(emb.dtype)]), torch.cat([labels, self.peer_labels])

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        # as the trainer's prepare_batch, contiguous (B, C, H, W) as train_v2's loader gives: the permuted
        # tensor is NHWC in memory, and convolutions given one run channels_last through the whole backbone
        self.calls += 1
        img = images.permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0).contiguous()
        with cpu_cuda_calls(self.device):
            emb = self.backbone(img)
            loss = self.pfc(*self._head_input(emb, labels))
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.backbone.parameters(), 5)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.backbone.parameters(), 5)
            self.opt.step()
        self.opt.zero_grad()
        if self.sched is not None:
            self.sched.step()
        return loss.item()

    def skipped(self) -> int:
        """Steps whose optimizer step GradScaler skipped (a non-finite fp16 gradient), so far."""
        return self.calls - self.taken


def build_scheduler(cls, **kwargs) -> Tuple[Any, List[str]]:
    """arcface_torch's scheduler ``cls(**kwargs)``, and the keyword arguments its ``__init__`` passed to torch's
    base class that this torch no longer takes (its ``verbose``: torch 2.13's ``LRScheduler`` has none, and
    the ``TypeError`` used to leave arcface's step without its scheduler, silently). Those are dropped on the
    way to the base class, so the scheduler and its step are arcface's own; the names are returned to be
    recorded (``scheduler_dropped`` in the comparison's JSON)."""
    try:
        return cls(**kwargs), []
    except TypeError:
        pass
    base = cls.__mro__[1]
    taken = inspect.signature(base.__init__).parameters
    dropped: List[str] = []

    class DropUnknown(base):
        def __init__(self, *args, **kw):
            for name in [k for k in kw if k not in taken]:
                dropped.append(name)
                del kw[name]
            super().__init__(*args, **kw)

    class Tolerant(cls, DropUnknown):   # the MRO puts DropUnknown between cls and its base
        pass
    Tolerant.__name__ = cls.__name__
    return Tolerant(**kwargs), dropped


def check_precision(fp16: bool, device: torch.device) -> None:
    """Their iresnet autocasts through ``torch.cuda.amp`` only: an fp16 run on CPU would silently be fp32."""
    if fp16 and device.type != "cuda":
        raise ValueError("--precision fp16 on CPU: arcface_torch's iresnet autocasts through torch.cuda.amp only; "
                         "use --precision fp32 on CPU")
