"""The local classifier (width = the rank's slice) and the margin losses.

Contract: the classifier receives its width and the loss settings as constructor arguments; it never
reads rank state. Labels given to it are *local* (``y - start``) and are never modified in place.
A label of -1 means "this sample's class is not in this slice" (used by modes that score other ranks'
samples against a slice); such rows get no margin.

Losses (s = scale, m = margin, cos = normalised feature . normalised class centre):
* ``softmax``: plain linear logits ``x W^T`` (no normalisation), cross entropy;
* ``cosface`` (Wang et al. 2018): target logit ``s (cos - m)``, others ``s cos``;
* ``arcface`` (Deng et al. 2019): target logit ``s cos(theta + m)``, others ``s cos``; where
  ``theta + m > pi`` the curve is continued by ``cos - m sin(m)`` (InsightFace's CombinedMarginLoss), so
  the target logit stays monotone in theta.

Inter-class filtering (``interclass`` > 0, arcface_torch's ``interclass_filtering_threshold``): in each row, a
column other than the row's target whose cosine exceeds the threshold is scored as cosine 0 (logit 0) and
passes no gradient: a class that close to the sample is taken for the same person under another label (web
sets such as WebFace hold many), and not pushed away. Margin losses only (``softmax`` has no cosines).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..registry import Registry

LOSSES: Registry[Callable[..., "MarginLoss"]] = Registry("loss")
register_margin = LOSSES.register


def list_losses():
    return LOSSES.names()


def create_margin(name: str, scale: float = 64.0, margin: float = 0.5, interclass: float = 0.0) -> "MarginLoss":
    loss = LOSSES.get(name)(scale=scale, margin=margin)
    if interclass > 0 and not loss.normalized:
        raise ValueError(f"head.interclass_filter={interclass:g} with head.loss={name}: the filter reads cosines; "
                         "use arcface or cosface")
    loss.interclass = float(interclass)
    return loss


def interclass_dirty(cos: torch.Tensor, has: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     threshold: float) -> torch.Tensor:
    """(M, W) bool: the non-target cosines above ``threshold`` (``has``: the row's target is a column here,
    at ``cols``; a row without one has every column filtered alike)."""
    dirty = cos > threshold
    dirty[rows, cols] &= ~has
    return dirty


class MarginLoss(nn.Module):
    """Turns (cosines or raw logits, local labels) into the logits fed to cross entropy."""

    normalized = True
    interclass = 0.0          # inter-class filtering's threshold (module docstring); create_margin sets it

    def __init__(self, scale: float, margin: float):
        super().__init__()
        self.scale, self.margin = float(scale), float(margin)

    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, cos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # cos: (B, W) cosines; labels: (B,) local, -1 = class not in this slice
        has = labels >= 0
        if self.interclass > 0:     # the filtered columns: cosine 0, no gradient
            with torch.no_grad():
                keep = ~interclass_dirty(cos, has, torch.arange(cos.shape[0], device=cos.device),
                                         labels.clamp_min(0), self.interclass)
            cos = cos * keep
        rows = torch.nonzero(has, as_tuple=True)[0]
        cols = labels[rows]
        target = self.target_logit(cos[rows, cols])
        out = cos.index_put((rows, cols), target)  # out of place: autograd sees both paths
        return out * self.scale


@register_margin("softmax")
class Softmax(MarginLoss):
    normalized = False

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits


@register_margin("cosface")
class CosFace(MarginLoss):
    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        return cos_target - self.margin


@register_margin("arcface")
class ArcFace(MarginLoss):
    def __init__(self, scale: float, margin: float):
        super().__init__(scale, margin)
        self.cos_m, self.sin_m = math.cos(margin), math.sin(margin)
        self.theta_limit = math.cos(math.pi - margin)     # beyond it theta + m would pass pi
        self.continuation = math.sin(math.pi - margin) * margin

    def target_logit(self, cos_target: torch.Tensor) -> torch.Tensor:
        sin_target = torch.sqrt((1.0 - cos_target * cos_target).clamp_min(1e-7))
        cos_theta_m = cos_target * self.cos_m - sin_target * self.sin_m   # cos(theta + m)
        return torch.where(cos_target > self.theta_limit, cos_theta_m, cos_target - self.continuation)


class LocalClassifier(nn.Module):
    """The rank's class centres (width x dim) and its margin loss.

    ``width`` is ``end - start`` of the rank's slice and may differ between ranks. Weights start
    N(0, 0.01) as in InsightFace's PartialFC; they are seeded per rank by the caller.
    """

    def __init__(self, width: int, dim: int, loss: str = "arcface", scale: float = 64.0, margin: float = 0.5,
                 interclass: float = 0.0):
        super().__init__()
        self.width, self.dim = width, dim
        self.weight = nn.Parameter(torch.empty(width, dim).normal_(0, 0.01))
        self.margin = create_margin(loss, scale, margin, interclass)
        self.matmul = "fp32"      # the precision of the head's matrix products (``MATMUL``; the run sets it)

    def logits(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, D) features, (B,) local labels -> (B, width) logits with the margin applied (the unfused
        reference of `margin_cross_entropy`)."""
        if self.margin.normalized:
            cos = F.linear(F.normalize(features.float()), F.normalize(self.weight.float())).clamp(-1, 1)
            return self.margin(cos, labels)
        return self.margin(F.linear(features.float(), self.weight.float()), labels)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the batch, on local labels (``F.cross_entropy(self.logits(...))``, fused)."""
        return margin_cross_entropy(features, self.weight, labels, self.margin, matmul=self.matmul)

    def before_step(self, step: int) -> None:
        """Called by the loop on every rank before each step; heads with periodic work override it."""

    def describe(self, backbone_grad_bytes: int) -> Optional[str]:
        """A line for the start of a multi-rank run about this head's own traffic (None: it has none)."""
        return None

    def sampling_warning(self) -> Optional[str]:
        """A warning for the start of a run about this head's sampling (None: nothing to say)."""
        return None

    def extra_state_for_checkpoint(self) -> dict:
        """Per-rank state beyond ``weight`` that a bitwise resume needs (none here)."""
        return {}

    def extra_state_bytes(self) -> int:
        """The most bytes ``extra_state_for_checkpoint``'s tensors ever hold (a snapshot copy's size limit)."""
        return 0

    def load_extra_state(self, state: dict) -> None:
        pass


# The precisions of the head's matrix products (``head.matmul``; run/speed.py resolves ``auto``). Only the
# products change: the cosines, the softmax's exponentials and its sums over the columns stay float32
# whatever the products' precision, since a sum over more than 65,504 columns of values up to 1 overflows
# fp16's range, and bf16 keeps 8 bits of a sum (a 125k-column sum would lose every term below 1/256 of it).
MATMUL = ("fp32", "tf32", "bf16")


@contextmanager
def _products_in(precision: str):
    """``tf32``: CUDA's TF32 units for the float32 products inside (10-bit mantissa products, float32
    sums; no effect on CPU); ``fp32`` and ``bf16`` change nothing here (``bf16`` rounds operands itself)."""
    if precision != "tf32":
        yield
        return
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def _bf16_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b from bf16-rounded operands, summed and returned in float32. CUDA: one bf16 GEMM with a float32
    result (``out_dtype``, torch >= 2.8); elsewhere (CPU, older torch) the rounded operands multiplied in
    float32: the same rounding, so a CPU run measures the bf16 head's accuracy, not its speed."""
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if a.is_cuda:
        try:
            return torch.mm(a16, b16, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    return torch.mm(a16.float(), b16.float())


def _mm(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """a @ b (2-D) in ``precision``; ``fp32`` and ``tf32`` are torch's own product (bitwise today's on CPU)."""
    return _bf16_mm(a, b) if precision == "bf16" else a.matmul(b)


class _MarginSoftmaxCE(torch.autograd.Function):
    """Mean cross entropy of margin logits ``s * m(cos(x, w))``, computed in ONE (M, W) buffer.

    The unfused path (``F.normalize(w)``, linear, clamp, ``index_put``, ``* s``, ``log_softmax``, and their
    backward) allocates about eight (M, W) and four (W, D) arrays per step; at 10^5-10^6 classes per rank
    those allocations and passes over memory cost more than the matrix products. Here the cosines are
    made in place in the matmul's output, turned into the softmax in place, and the backward reuses that
    buffer for the gradient; the weight's normalisation is folded into column scalings, so the only
    (W, D) array made is the weight's gradient. ``comm`` (None: local) makes the softmax span ranks:
    allreduce of the row max, then of the row sum of exponentials and of the target logit, which only
    the rank owning the class holds (Megatron-LM's vocab-parallel cross entropy).

    ``frozen`` (R, D) rows (cross-shard negatives' remote centres) are R more columns, after the weight's,
    scored like them but given no gradient. Their products go into the same (M, W + R) buffer by a second
    matmul, and the backward multiplies only the buffer's first W columns into the weight's gradient:
    ``torch.cat([weight, frozen])`` instead made a (W + R, D) copy per step and a (W + R, D) gradient whose
    storage the weight then kept as its ``.grad``: 3 x W x D bytes more at np=2 with whole slices shared
    (10^6 x 128: 2328 -> 1596 MB peak RSS per rank, docs/evidence/benchmarks.md). The loss and the weight's
    gradient came out bitwise equal to the cat's (2 x 10^4 + 3 x 10^4 columns, softmax and ArcFace); the
    features' gradient adds its two parts separately (1e-6 relative).

    Exact up to rounding, except that the clamp of the cosines to [-1, 1] passes gradient everywhere but
    at the targets (non-target cosines leave [-1, 1] only by rounding error).

    The targets are written through a row mask, not a ``nonzero`` list of the rows holding one: every row
    writes its column (label -1: column 0, its own value back), so no shape depends on the labels and
    the step needs no host synchronisation here (``nonzero`` waits for the device). Each target's value is
    computed as before, elementwise, so the numbers are bitwise those of the row list.
    ``precision`` (``MATMUL``) is that of the three (M, W)-sized products only.
    """

    @staticmethod
    def forward(ctx, xn, weight, frozen, labels, margin, normalized, comm, name, precision="fp32"):
        # xn: (M, D) normalised features (raw for 'softmax'); weight: (W, D); frozen: (R, D) or None;
        # labels: (M,) column, -1: elsewhere
        m, w = xn.shape[0], weight.shape[0]
        with _products_in(precision):
            if frozen is None:
                out = _mm(xn, weight.t(), precision)                              # (M, W), the one buffer
            else:
                out = xn.new_empty(m, w + frozen.shape[0])                        # (M, W + R), the one buffer
                if precision == "bf16":
                    out[:, :w].copy_(_bf16_mm(xn, weight.t()))
                    out[:, w:].copy_(_bf16_mm(xn, frozen.t()))
                else:
                    torch.matmul(xn, weight.t(), out=out[:, :w])                  # BLAS writes the strided views
                    torch.matmul(xn, frozen.t(), out=out[:, w:])
        norm = None
        if normalized:
            norm = weight.norm(dim=1) if frozen is None else torch.cat([weight.norm(dim=1), frozen.norm(dim=1)])
            norm = norm.clamp_min(1e-12)                                          # (W + R,)
        has = labels >= 0                                                         # (M,) rows with a target here
        rows = torch.arange(m, device=labels.device)
        cols = labels.clamp_min(0)                                                # -1: column 0, left as it is
        scale = margin.scale if normalized else 1.0
        dirty = None
        if normalized and margin.interclass > 0:     # (eager: the filter's passes are not compiled)
            out.div_(norm).clamp_(-1.0, 1.0)
            dirty = interclass_dirty(out, has, rows, cols, margin.interclass)
            out.masked_fill_(dirty, 0.0)
            t_cos, target, row_max = _logits_pass(out, None, has, rows, cols, margin, scale, normalized)
        else:
            t_cos, target, row_max = _PASSES["logits"](out, norm, has, rows, cols, margin, scale, normalized)
        if comm is not None:
            row_max = comm.allreduce_tensor(row_max, "max", f"{name}.max")
        sums = _PASSES["exp_sums"](out, row_max, target)                          # (2, M)
        if comm is not None:
            sums = comm.allreduce_tensor(sums, "sum", f"{name}.sum")
        out.div_(sums[0][:, None])                                                # softmax (this rank's columns)
        ctx.save_for_backward(out, xn, weight, xn.new_empty(0) if frozen is None else frozen,
                              norm if normalized else xn.new_empty(0), has, cols, t_cos,
                              has.new_empty(0) if dirty is None else dirty)
        ctx.margin, ctx.normalized, ctx.scale, ctx.m, ctx.precision = margin, normalized, scale, m, precision
        return (sums[0].log() + row_max - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad_out):
        prob, xn, weight, frozen, norm, has, cols, t_cos, dirty = ctx.saved_tensors
        w, precision = weight.shape[0], ctx.precision
        rows = torch.arange(ctx.m, device=cols.device)
        g = prob.clone() if torch.is_grad_enabled() else prob   # reuse the buffer unless double backward
        slope = None
        if ctx.normalized:
            with torch.enable_grad():                            # the margin's slope at the targets (small)
                t = t_cos.detach().requires_grad_(True)
                slope, = torch.autograd.grad(ctx.margin.target_logit(t).sum(), t)
        _PASSES["logit_grads"](g, has, rows, cols, grad_out * ctx.scale / ctx.m, slope)
        if dirty.numel():
            g.masked_fill_(dirty, 0.0)                           # a filtered logit is 0 x cos: no gradient
        with _products_in(precision):
            return _MarginSoftmaxCE._grads(g, xn, weight, frozen, norm, w, ctx.normalized, precision)

    @staticmethod
    def _grads(g, xn, weight, frozen, norm, w: int, normalized: bool, precision: str):
        """The weight's and the features' gradients from ``g`` = d loss / d raw logit (M, W + R)."""
        grad_w = _mm(g[:, :w].t(), xn, precision)                # d / d (w / |w|) or d / d w, (W, D)
        if normalized:
            g.div_(norm)                                         # d / d raw product = d / d cos / |w_j|
            # d/dw of w/|w|: (G - w (G.w) / |w|^2) / |w|, in place; the row dots by a batched matmul
            nw = norm[:w]
            dots = torch.bmm(grad_w.unsqueeze(1), weight.unsqueeze(2)).view(-1)   # (W,)
            grad_w.addcmul_(weight, (dots / (nw * nw))[:, None], value=-1.0).div_(nw[:, None])
        grad_x = _mm(g[:, :w], weight, precision)                # (M, D)
        if frozen.numel():
            if precision == "bf16":
                grad_x.add_(_bf16_mm(g[:, w:], frozen))
            else:
                grad_x.addmm_(g[:, w:], frozen)                  # the frozen columns' share
        return grad_x, grad_w, None, None, None, None, None, None, None


def _logits_pass(out, norm, has, rows, cols, margin, scale: float, normalized: bool):
    """In place: ``out``'s products -> cosines -> margin logits (x s); returns (the targets' cosines, the
    targets' logits (0 where none), each row's max)."""
    if normalized:
        if norm is not None:                                                      # (None: cosines already)
            out.div_(norm).clamp_(-1.0, 1.0)                                      # cosines
        t_cos = out[rows, cols]
        out[rows, cols] = torch.where(has, margin.target_logit(t_cos), t_cos)
    else:
        t_cos = out[rows, cols]
    out.mul_(scale)                                                               # logits
    target = torch.where(has, out[rows, cols], 0.0)
    return t_cos, target, out.max(dim=1).values                                   # (M,) each


def _exp_sums_pass(out, row_max, target):
    """In place: ``out`` -> exp(logit - row max); returns (2, M): the rows' sums of it and the targets."""
    out.sub_(row_max[:, None]).exp_()
    return torch.stack([out.sum(dim=1), target])


def _logit_grads_pass(g, has, rows, cols, factor, slope) -> None:
    """In place: the softmax ``g`` -> d loss / d (logit / s): minus 1 at the targets, times ``factor``, times
    the margin's ``slope`` at the targets (None: no margin)."""
    g[rows, cols] -= has.to(g.dtype)                         # 1 at the targets, 0 (no change) elsewhere
    g.mul_(factor)                                           # d loss / d (logit / s), (M, W)
    if slope is not None:
        g[rows, cols] *= torch.where(has, slope, 1.0)


# The passes over the (M, W) buffer, eager or torch.compile'd (``train.compile_head``, ``compile_passes``):
# compiled, each pass's elementwise chain runs as one or two kernels instead of one kernel a step of it.
_EAGER = {"logits": _logits_pass, "exp_sums": _exp_sums_pass, "logit_grads": _logit_grads_pass}
_PASSES = dict(_EAGER)


def compile_passes(enabled: bool, backend: str = "inductor") -> None:
    """Process-wide: the softmax's passes torch.compile'd (each compiled at its first call; never CUDA graphs,
    which would copy the (M, W) buffer into the graph's own each step) or eager (the numbers of every pinned
    run). A setting of the process, as cuDNN's flags are: every head in it alike."""
    _PASSES.clear()
    _PASSES.update({k: torch.compile(f, backend=backend) for k, f in _EAGER.items()} if enabled else _EAGER)


def probe_passes(batch: int, width: int, margin: "MarginLoss", device: torch.device) -> None:
    """Each pass once on zero tensors of a (batch, width) step's shapes and kinds (``compile_passes``: they
    compile now, not at the first step). Without autograd, as inside the softmax's forward and backward."""
    with torch.no_grad():
        _probe(batch, width, margin, device)


def _probe(batch: int, width: int, margin: "MarginLoss", device: torch.device) -> None:
    out = torch.zeros(batch, width, device=device)
    labels = torch.arange(batch, device=device) % width
    rows, has = torch.arange(batch, device=device), labels >= 0
    normalized = margin.normalized
    t_cos, target, row_max = _PASSES["logits"](out, torch.ones(width, device=device), has, rows, labels, margin,
                                                margin.scale if normalized else 1.0, normalized)
    _PASSES["exp_sums"](out, row_max, target)
    _PASSES["logit_grads"](out, has, rows, labels, torch.ones((), device=device),
                           torch.ones_like(t_cos) if normalized else None)


def margin_cross_entropy(features: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         margin: "MarginLoss", comm=None, name: str = "head",
                         frozen: Optional[torch.Tensor] = None, matmul: str = "fp32") -> torch.Tensor:
    """Mean CE of ``margin`` logits of (M, D) features against (W, D) rows, then the (R, D) ``frozen`` rows
    (no gradient, never a target); labels index the rows (-1: the class lives on another rank, ``comm``
    given). Equals ``F.cross_entropy(logits, labels)`` over the W + R columns. ``matmul``: the precision
    of the products (``MATMUL``)."""
    normalized = margin.normalized
    x = F.normalize(features.float()) if normalized else features.float()
    if frozen is not None:
        frozen = frozen.detach().float().contiguous()
    return _MarginSoftmaxCE.apply(x, weight.float(), frozen, labels, margin, normalized, comm, name, matmul)
