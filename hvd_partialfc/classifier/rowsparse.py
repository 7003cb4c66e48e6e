"""Sampled classifier rows: the sampling rule, a row gather whose gradient is row-sparse, and a classifier
optimizer whose step costs what the sampled rows cost.

Contract: nothing here reads rank state; ``sample_rows`` draws from torch's global RNG (which checkpoints
save and restore, so a sampled run resumes bitwise).

Why a sparse step: with ``head.sample_rate`` = r the head scores K = r x W rows, but a dense
``weight[index]`` makes a (W, D) gradient, zero outside them (autograd zero-fills it and scatters the K
rows in), and torch's fused SGD-momentum step then reads and writes every row. Measured, one thread,
W = 5 x 10^5, D = 128 (docs/bench/sampled_step.py, docs/evidence/benchmarks.md): gradient + step 124 ms dense
against 18 ms here at r = 0.1, 136 against 68 ms at r = 0.3. Most of the dense cost is making the (W, D)
gradient (~100 ms); the fused dense step alone is fast (22 ms) and the step here beats it only below
r ~ 0.15 (17 ms at 0.1; 42 ms at 0.3). Here the gradient is a sparse (W, D) tensor holding only the K
sampled rows, and ``SampledRowsOptimizer`` gathers, updates and scatters back those K rows of the weight
and of its state.

Two rules (``head.sampled_step``; ``dense`` is a third: a dense gradient and torch's step, no code here).

``exact`` (the default, SGD): the numbers of the dense step at the sampled rows' cost. A step with a zero
gradient is linear in a row's (weight, momentum) and the same for every row: with lr_k of step k,
A_k = [[1 - lr_k wd, -lr_k mu], [wd, mu]]. So a row may skip steps and be brought up later by the product
of the A_k it skipped, a 2 x 2 map per element: the head calls ``catch_up`` on the rows it samples *before*
scoring them (so the logits see what the dense step would have made of them), then the step updates them
as torch's fused SGD does. The products come from the lrs of the steps since the last *sweep*, which
brings every row up each ``sweep_every`` = 64 steps (O(W D) once per 64 steps), so the table stays short
and no row lags further. Tested against torch's dense SGD (momentum, weight decay, a changing lr) to
1e-12 in float64 (``test_rowsparse.py``); in float32 the difference is round-off, since the sums are
ordered differently. Why: on the demo data at np=2, r=0.1 (docs/accuracy.md), the lazy rule below lost
4% of all-pairs TAR@1e-3 against r=1, the dense step lost nothing. A lazily stepped row misses the weight
decay of every step it is not sampled in (about 90% of them at r=0.1), so its norm grows, and with
normalised (cosine) logits a larger norm means a smaller effective learning rate. The rows shared as
cross-shard negatives are shared as they are, up to 63 steps behind their dense values. AdamW has no exact
rule (its zero-gradient steps are not linear): it always runs the lazy rule below.

``lazy``: PartialFC v1's and PLSC's *sparse momentum* (PLSC, sample_ratio < 1: its
``gather_optimization_pass`` replaces the classifier's momentum op by ``sparse_momentum`` fed with the
gather's ``Index`` and the gathered (K, D) gradient, weight decay included in the op): a row that is not
sampled this step is left exactly as it is, weight and optimizer state (no weight decay, no momentum
drift); a sampled row takes one ordinary optimizer step with its own state. Numerically, per row:

* SGD (momentum mu, weight decay wd, lr_t of the step): on the steps t where the row is sampled,
  ``m <- mu m + g + wd w``, ``w <- w - lr_t m``; on the other steps nothing. It equals the dense step on a
  row that is sampled every step (tested: all rows sampled == torch.optim.SGD). It is *not* the dense
  step of PartialFC v2 (``global`` mode's sampling), where an unsampled row keeps moving by its momentum
  (``w -= lr mu^k m``) and decays (``wd w``) with a zero gradient: here its momentum waits until the row
  is sampled again (it is not decayed by mu^k meanwhile).
* AdamW (beta1, beta2, eps, wd): on the steps where the row is sampled, the decoupled decay
  ``w <- w (1 - lr_t wd)`` and the Adam update with the row's own moments, bias-corrected with the row's
  own count of updates ``t_row`` (a per-row (W,) ``step`` vector): each row is an AdamW on the sequence of
  its own gradients. torch's SparseAdam corrects with the global step instead, which over-trusts the
  moments of rarely sampled rows (1 - beta2^t ~ 1 while the row has seen one gradient).

Cost per step: O(K x D) for gather, update and scatter (the K rows come sorted and unique: no sort), plus
for ``exact`` the catch-up (three more passes over the K rows) and the sweep (O(W x D) / 64). The per-row
state ((W, D) moments, (W,) AdamW step, (W,) ``since_base`` of the exact rule: a row's step count since
the last sweep, small integers exact in any float type) is allocated once, saved by ``state_dict`` and cut per
row by ``reshard.gather_classifier_rows`` for re-sharding (which first brings the rows current with
``sweep_rows`` when the old ranks' ``lrs`` differ: a rank-local classifier skip appends nothing).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


def sample_rows(labels: torch.Tensor, width: int, rate: float, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """PartialFC's sampling of one slice: every positive row of ``labels`` (local, -1: not in this slice),
    then uniformly random others up to ``max(int(rate x width), positives)`` rows.

    Returns (index (K,) sorted unique rows, labels remapped to positions in ``index``, -1 kept). One
    ``torch.rand(width)`` draw from the global stream per call (a sampled run resumes bitwise).

    No shape depends on the labels unless the sample is smaller than the batch: the positives are marked
    by a scatter (a ``unique`` of the labels waited for the device), and their count, a host read, is
    needed only when it may exceed ``int(rate x width)``, i.e. when that is below the batch's size.
    """
    has = labels >= 0
    score = torch.rand(width, device=device)                             # in [0, 1)
    # positives always win: 2 at every row a label names (a max, so repeated labels agree; a -1 label
    # leaves row 0 as it is)
    score.scatter_reduce_(0, labels.clamp_min(0), torch.where(has, 2.0, 0.0).to(score.dtype), "amax")
    keep = int(rate * width)
    if keep < labels.numel():
        keep = max(keep, int((score == 2.0).sum()))                      # the positives' count: a host read
    index = torch.sort(torch.topk(score, keep).indices).values           # (K,) rows, increasing
    remapped = torch.searchsorted(index, labels.clamp_min(0))
    remapped = torch.where(labels >= 0, remapped, labels)                # -1 stays -1
    return index, remapped


class _RowGather(torch.autograd.Function):
    """``weight[index]`` whose gradient is a coalesced sparse (W, D) tensor of the K rows (not a dense one)."""

    @staticmethod
    def forward(ctx, weight, index):
        ctx.save_for_backward(index)
        ctx.shape = weight.shape
        return weight.index_select(0, index)           # (K, D) copy; ~4x faster than weight[index] on CPU

    @staticmethod
    def backward(ctx, grad):
        index, = ctx.saved_tensors                                       # sorted and unique: coalesced
        return torch.sparse_coo_tensor(index[None], grad.contiguous(), ctx.shape, is_coalesced=True,
                                       check_invariants=False), None


def gather_rows(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(K, D) rows ``index`` (sorted, unique) of ``weight``; ``weight.grad`` becomes row-sparse."""
    return _RowGather.apply(weight, index)


def sparse_rows(grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows (K,), values (K, D)) of a row-sparse gradient, each row once.

    Autograd's accumulation drops the coalesced flag of ``gather_rows``' gradient, and ``coalesce()`` then
    sorts again: 19 ms at K = 5 x 10^4 on one thread, about the whole sparse step. The rows are checked
    instead (strictly increasing: O(K)); only a gradient summed over several backward passes (duplicated
    or unordered rows) is coalesced. A gradient flagged coalesced is taken as it is: the check is a host
    read, and ``SampledRowsOptimizer`` flags the gradient of its head's one gather."""
    rows = grad._indices()[0]
    if grad.is_coalesced():
        return rows, grad._values()
    if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
        grad = grad.coalesce()
        rows = grad._indices()[0]
    return rows, grad._values()


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` for sorted unique rows. On CPU through numpy's row copy: 3.0 ms against 4.6 ms for
    ``index_copy_`` and 5.6 ms for ``index_put_`` (5 x 10^4 rows of 5 x 10^5, D = 128, one thread)."""
    if dst.device.type == "cpu" and dst.dtype != torch.bfloat16:      # numpy has no bfloat16
        dst.detach().numpy()[rows.numpy()] = src.detach().numpy()
    else:
        dst.index_copy_(0, rows, src)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same memory (so equal without reading them: no host synchronisation)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def grad_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a gradient (a sparse one's K rows; a dense one itself), for norms and checks."""
    return sparse_rows(grad)[1] if grad.is_sparse else grad


SWEEP_BLOCK = 65536   # rows per block of the exact rule's sweep: a 32 MB temporary at D = 128


def _apply_catch_up(coef: torch.Tensor, w: torch.Tensor, m, tmp: torch.Tensor) -> None:
    """In place, per row: (w, m) <- (a w + b m, c w + d m) with ``coef`` (K, 4) rows [a, b, c, d]."""
    a, b, c, d = (coef[:, i:i + 1] for i in range(4))                                 # (K, 1) each
    if m is None:                                   # no momentum: only the weight decay's factor
        w.mul_(a)
        return
    tmp.copy_(w)
    w.mul_(a).addcmul_(m, b)
    m.mul_(d).addcmul_(tmp, c)


def catch_up_table(state, mu: float, wd: float, dtype=torch.float32) -> torch.Tensor:
    """(n + 1, 4): for a row current through step ``base + j`` (j = 0..n, n steps since the sweep), the
    2 x 2 map [[a, b], [c, d]] of (weight, momentum) over the zero-gradient steps base + j + 1 .. base + n;
    ``state``: the exact rule's ``lrs`` and ``since_base``.

    A step with a zero gradient and lr_k is linear in (w, m): m' = mu m + wd w, w' = w - lr_k m', i.e.
    A_k = [[1 - lr_k wd, -lr_k mu], [wd, mu]] on every element; products in float64, n <= sweep_every."""
    lrs = state["lrs"]
    n = len(lrs)
    out = [None] * (n + 1)
    a, b, c, d = 1.0, 0.0, 0.0, 1.0                 # identity: a row current through the last step
    out[n] = (a, b, c, d)
    for j in range(n - 1, -1, -1):                  # Q_j = Q_{j+1} @ A_{base + j + 1}
        lr = lrs[j]
        e, f, g, h = 1.0 - lr * wd, -lr * mu, wd, mu
        a, b, c, d = a * e + b * g, a * f + b * h, c * e + d * g, c * f + d * h
        out[j] = (a, b, c, d)
    return torch.tensor(out, dtype=dtype, device=state["since_base"].device)


def sweep_rows(weight: torch.Tensor, momentum, state, mu: float, wd: float, tmp: torch.Tensor) -> None:
    """The exact rule's sweep, in place: every row of ``weight`` (W, D) and ``momentum`` (or None) brought
    up through the steps of ``state["lrs"]`` from its ``state["since_base"]``; both are then reset (no
    step since the sweep). In blocks of ``SWEEP_BLOCK`` rows, so the temporary ``tmp`` (at least
    min(W, SWEEP_BLOCK) rows) is one block, not a second (W, D) matrix. The optimizer's sweep, and
    re-sharding's catch-up of rows whose ranks have different histories (run/ckpt/reshard.py)."""
    table = catch_up_table(state, mu, wd, weight.dtype)
    since = state["since_base"].long()
    with torch.no_grad():
        for lo in range(0, weight.shape[0], SWEEP_BLOCK):
            hi = min(lo + SWEEP_BLOCK, weight.shape[0])
            _apply_catch_up(table[since[lo:hi]], weight[lo:hi], None if momentum is None else momentum[lo:hi],
                            tmp[:hi - lo])
    state["since_base"].zero_()
    state["lrs"] = []


class SampledRowsOptimizer(torch.optim.Optimizer):
    """SGD (momentum) or AdamW that steps only the rows present in each parameter's row-sparse gradient
    (all rows for a dense gradient); the rule and its numerical meaning are in the module docstring."""

    def __init__(self, params, kind: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 betas=(0.9, 0.999), eps: float = 1e-8, rule: str = "lazy", sweep_every: int = 64):
        if kind not in ("sgd", "adamw"):
            raise ValueError(f"unknown optimizer {kind!r}; known: sgd, adamw")
        if rule not in ("lazy", "exact") or (rule == "exact" and kind != "sgd"):
            raise ValueError(f"sampled-rows rule {rule!r} with {kind}: 'lazy' (sgd, adamw) or 'exact' (sgd)")
        self.kind, self.rule, self.sweep_every = kind, rule, int(sweep_every)
        self._scratch: Dict[str, torch.Tensor] = {}
        self._caught = None   # (param, rows, weight rows, momentum rows) of the last catch_up, for its step
        self._gathered = None  # (param, rows) of the last catch_up call, whatever the rule
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, betas=betas, eps=eps))
        for group in self.param_groups:
            for p in group["params"]:
                p.register_post_accumulate_grad_hook(self._flag_one_gather)

    def _flag_one_gather(self, p: torch.Tensor) -> None:
        """Autograd's hook after ``p.grad`` was accumulated: a gradient whose row list *is* (same memory)
        the rows the head just gathered (``catch_up`` was told them) is that one gather's, whose rows are
        sorted and unique: it is flagged coalesced, so ``sparse_rows`` needs no check (a host read).
        Autograd's accumulation drops the flag the gather set; a sum of several passes is never flagged."""
        g, seen = p.grad, self._gathered
        if g is None or not g.is_sparse or g.is_coalesced() or seen is None or seen[0] is not p:
            return
        if _same_tensor(g._indices()[0], seen[1]):
            g._coalesced_(True)

    def _rows(self, name: str, k: int, like: torch.Tensor) -> torch.Tensor:
        """A (k, D) scratch buffer kept between steps. Fresh (K, D) arrays cost more than the step itself:
        the allocator maps each anew and every page faults on first touch (an out-of-place add of
        5 x 10^4 x 128 floats: 21 ms; in place: 1 ms, one thread). Not state: never saved."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < k or buf.shape[1:] != like.shape[1:] or buf.device != like.device:
            buf = self._scratch[name] = like.new_empty((max(k, int(1.25 * k)), *like.shape[1:]))
        return buf[:k]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    rows, g = sparse_rows(p.grad)                          # (K,), (K, D)
                else:
                    rows, g = torch.arange(p.shape[0], device=p.device), p.grad
                # index_select / index_copy_: ~4x / 2x faster than p[rows] / p[rows] = w (5 x 10^4 of
                # 5 x 10^5 rows, D = 128, one thread: 25 -> 6 ms, 18 -> 9 ms)
                caught, self._caught = self._caught, None
                if caught is not None and (caught[0] is not p or not
                                           (_same_tensor(caught[1], rows) or torch.equal(caught[1], rows))):
                    caught = None
                # the rows the head's catch_up just brought up are in its scratch: no second gather
                w = caught[2] if caught is not None else \
                    torch.index_select(p, 0, rows, out=self._rows("w", rows.numel(), p))   # (K, D) copy
                if self.kind == "sgd":
                    self._sgd(p, rows, w, g, group, None if caught is None else caught[3], caught is not None)
                else:
                    self._adamw(p, rows, w, g, group)
                scatter_rows(p, rows, w)

    def _sgd(self, p, rows, w, g, group, m_rows=None, current: bool = False) -> None:
        # torch's own fused SGD kernel (what SGD(fused=True) runs) on the K gathered rows: one pass instead
        # of three elementwise ones
        lr, mu, wd = group["lr"], group.get("momentum", 0.0), group["weight_decay"]
        state, bufs = self.state[p], []
        if mu:
            if "momentum_buffer" not in state:           # zeros: the first step gives m = d, as torch's clone
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            bufs = [m_rows if m_rows is not None else
                    torch.index_select(buf, 0, rows, out=self._rows("m", rows.numel(), p))]
        if self.rule == "exact":
            if "since_base" not in state:   # (W,): steps after the last sweep through which each row is current
                state.update(since_base=torch.zeros(p.shape[0], dtype=torch.float32, device=p.device), lrs=[])
            # rows the head's catch_up did not bring up (``current``: it brought up all of them)
            coef = None if current else self._lagging(state, rows, mu, wd, p.dtype)
            if coef is not None:
                _apply_catch_up(coef, w, bufs[0] if mu else None, self._rows("t", rows.numel(), p))
        torch._fused_sgd_([w], [g.contiguous()], bufs, weight_decay=wd, momentum=mu, lr=lr, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
        if mu:
            scatter_rows(buf, rows, bufs[0])
        if self.rule == "exact":
            state["lrs"].append(float(lr))
            scatter_rows(state["since_base"], rows, torch.full((rows.numel(),), float(len(state["lrs"])),
                                                               device=p.device))
            if len(state["lrs"]) >= self.sweep_every:
                self._sweep(p, state, mu, wd)

    @torch.no_grad()
    def catch_up(self, p: torch.Tensor, rows: torch.Tensor) -> None:
        """The exact rule's catch-up of rows ``rows`` (sorted, unique) of ``p`` to the last step, weight and
        momentum. The head calls it on the rows it samples *before* its forward, so the logits see the
        weights the dense step would have (a row's zero-gradient steps move it: momentum, weight decay).
        Every rule records the rows (``_flag_one_gather``).

        All K rows are mapped, those already current by the identity (as before whenever one row lagged):
        asking first whether any row lags was a host read, and its answer is yes but right after a sweep
        (no steps since it: returned above, without a read)."""
        self._caught, self._gathered = None, (p, rows)
        state = self.state.get(p)
        if self.rule != "exact" or not state or "since_base" not in state or not state["lrs"]:
            return
        group = self.param_groups[0]
        mu, wd, k = group.get("momentum", 0.0), group["weight_decay"], rows.numel()
        since = state["since_base"].index_select(0, rows).long()                  # (K,)
        coef = catch_up_table(state, mu, wd, p.dtype)[since]
        w = torch.index_select(p, 0, rows, out=self._rows("cw", k, p))
        m = torch.index_select(state["momentum_buffer"], 0, rows, out=self._rows("cm", k, p)) if mu else None
        _apply_catch_up(coef, w, m, self._rows("ct", k, p))
        scatter_rows(p, rows, w)
        if mu:
            scatter_rows(state["momentum_buffer"], rows, m)
        scatter_rows(state["since_base"], rows, torch.full((k,), float(len(state["lrs"])), device=p.device))
        self._caught = (p, rows, w, m)

    def _lagging(self, state, rows: torch.Tensor, mu: float, wd: float, dtype):
        """(K, 4) catch-up maps of ``rows``, or None when every one of them is current already."""
        if not state["lrs"]:                     # no step since the sweep: every row is current (no host read)
            return None
        since = state["since_base"].index_select(0, rows).long()                  # (K,)
        if not bool((since < len(state["lrs"])).any()):
            return None
        return catch_up_table(state, mu, wd, dtype)[since]

    def _sweep(self, p, state, mu: float, wd: float) -> None:
        """Bring every row up to the last step (every ``sweep_every`` steps: O(W D) / sweep_every per step),
        so no row is ever more than ``sweep_every`` steps behind and the table stays short."""
        sweep_rows(p.data, state["momentum_buffer"] if mu else None, state, mu, wd,
                   self._rows("sweep", min(SWEEP_BLOCK, p.shape[0]), p))

    def _adamw(self, p, rows, w, g, group) -> None:
        lr, wd, (b1, b2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        state, k = self.state[p], rows.numel()
        if "step" not in state:
            state["step"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)   # (W,) per row
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        t = state["step"].index_select(0, rows) + 1                        # (K,)
        scatter_rows(state["step"], rows, t)
        m = torch.index_select(state["exp_avg"], 0, rows, out=self._rows("m", k, p)).mul_(b1).add_(g, alpha=1 - b1)
        v = torch.index_select(state["exp_avg_sq"], 0, rows, out=self._rows("v", k, p))
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        scatter_rows(state["exp_avg"], rows, m)
        scatter_rows(state["exp_avg_sq"], rows, v)
        w.mul_(1 - lr * wd)
        bc1 = 1 - torch.pow(b1, t)[:, None]                                # (K, 1)
        bc2 = 1 - torch.pow(b2, t)[:, None]
        denom = torch.sqrt(v, out=self._rows("d", k, p)).div_(bc2.sqrt()).add_(eps).mul_(bc1 / lr)
        w.addcdiv_(m, denom, value=-1.0)
