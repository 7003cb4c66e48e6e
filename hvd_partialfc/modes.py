"""Classifier modes: the method and its two baselines, in the same training loop.

The mode decides only the head, the loss and which optimizer owns which parameters (``Trainer._build``);
the loop, the data path and the backbone are the same.

* ``local`` (the method, DESIGN §1): a classifier as wide as the rank's slice, softmax over the slice,
  labels ``y - start``; its optimizer is plain torch, never communicated. Traffic: the backbone gradient.
* ``global`` (exact model-parallel softmax, as InsightFace's PartialFC and Megatron's vocab-parallel
  cross entropy): features and labels are all-gathered, each rank scores the whole gathered batch
  (M = sum of the ranks' batches) against its own slice, and the softmax is normalised across ranks
  (allreduce of the row max, then of the row sum of exponentials and of the target logit, which only
  the owning rank holds). The loss is the mean over the M samples, the same number on every rank. Its
  classifier is local (plain optimizer); its features' gradient is summed over ranks and multiplied by
  N (``Comm.allgather_with_grad``), since the backbone's DistributedOptimizer then averages.
  ``head.sample_rate`` < 1 keeps, per step, every positive centre of the gathered batch plus random
  negatives up to ``sample_rate x width`` rows (PartialFC's sampling of negative centres).
* ``local`` with ``head.sample_rate`` < 1: the same rule on the rank's own slice and its own batch, and a
  classifier step over the sampled rows only (`LocalHead`, rowsparse.py).
* ``local`` with ``head.negatives_every = K`` > 0: the method plus cross-shard negatives
  (`CrossShardNegativesHead`): every K steps an all-gather of class centres, used as frozen columns.
* ``replicated`` (classic data parallel, PartialFC's "DP" column): every rank holds the full C x D
  classifier, scores its own batch against all C classes with global labels, and the classifier's
  gradient is averaged with the backbone's, by the same DistributedOptimizer (one param group each).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .heads import LocalClassifier, margin_cross_entropy
from .rowsparse import gather_rows, sample_rows
from .seeds import derive_seed

MODES = ("local", "global", "replicated")
# sampled ``local`` scores int(sample_rate x width) of a rank's rows a step (plus its positives); fewer than
# this many and a start-up warning says so (``LocalHead.sampling_warning``: the measured reason)
FEW_SAMPLED_ROWS = 32


class LocalHead(LocalClassifier):
    """The method: softmax over this rank's slice (``LocalClassifier`` itself at ``sample_rate`` 1).

    ``sample_rate`` r < 1 (issue 12): each step keeps every positive row of the rank's batch and random
    others up to r x width rows (PartialFC's rule, ``rowsparse.sample_rows``, shared with ``global`` mode),
    and the margin softmax runs over those rows only. Only they receive a gradient, and it is row-sparse
    (``rowsparse.gather_rows``): the classifier's optimizer is then ``SampledRowsOptimizer``, which steps
    only those rows (``head.sampled_step``: ``exact``, the default, brings a sampled row up to the dense step's
    value before it is scored; ``lazy`` lets an unsampled row wait; rowsparse.py). At r = 1
    nothing is drawn and the path is the unsampled one, bitwise.
    """

    row_start = 0  # overridden per instance: the global label of row 0 of ``weight``

    def __init__(self, width: int, dim: int, sample_rate: float = 1.0, sparse_step: bool = True, **margin):
        super().__init__(width, dim, **margin)
        self.sample_rate = float(sample_rate)
        self.sparse_step = bool(sparse_step)   # False: a dense (W, D) gradient, zero outside the sampled rows
        # called as before_gather(weight, rows) on the sampled rows before they are scored (the trainer sets
        # it to the exact sampled-rows optimizer's catch_up)
        self.before_gather = None

    def sampling_warning(self) -> Optional[str]:
        """A line for the start of a run when ``sample_rate`` scores fewer than ``FEW_SAMPLED_ROWS`` of this
        rank's rows a step, else None. Measured (docs/accuracy.md, scale study, 600 steps, r = 0.1): 38 rows
        a step (387 classes a rank) and 309 rows are level with unsampled ``local``; 9 rows (97 classes a
        rank, N = 256) cost 4% of TAR@1e-3 and 7% of TAR@1e-4 over two seeds, and 38 of those 97 rows
        (r = 0.4) were level again (1.004 / 1.006 of unsampled, two seeds): the rows scored a step count,
        not the slice's width. 19 rows (194 classes a rank, N = 128) were level too (1.003 of unsampled,
        two seeds), so the loss starts between 9 and 19 rows; 32 keeps a margin, since 19 was measured at
        one width and one per-rank batch (8) only."""
        if self.sample_rate >= 1.0:
            return None
        rows = int(self.sample_rate * self.width)
        if rows >= FEW_SAMPLED_ROWS:
            return None
        return (f"warning: head.sample_rate={self.sample_rate:g} scores {rows} of this rank's {self.width} "
                f"classifier rows a step (plus its batch's positives); below {FEW_SAMPLED_ROWS} rows sampled "
                f"local lost accuracy in the scale study (docs/accuracy.md): sample wide slices only, or set "
                f"head.sample_rate=1")

    def scored_rows(self, labels: torch.Tensor):
        """(rows scored this step (K, D), labels as positions in them): all rows, or a sample of them."""
        if self.sample_rate >= 1.0:
            return self.weight, labels
        index, remapped = sample_rows(labels, self.width, self.sample_rate, self.weight.device)
        if self.before_gather is not None:   # the exact sampled step's catch-up of these rows (rowsparse.py)
            self.before_gather(self.weight, index)
        if not self.sparse_step:   # head.sampled_step=dense: PartialFC v2's step (every row moves by momentum)
            return self.weight.index_select(0, index), remapped
        return gather_rows(self.weight, index), remapped

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight, labels = self.scored_rows(labels)
        return margin_cross_entropy(features, weight, labels, self.margin)


def negatives_share(width: int, world_size: int, share: int, pool: int) -> int:
    """Centres a rank of slice ``width`` publishes per exchange: ``share`` of them (0: all), at most
    ceil(``pool`` / N) when ``pool`` > 0. Every rank receives every share, so without the pool what a rank
    receives and holds grows with N: at iresnet50's D = 512 and 1,024 a rank, 0.11% of the gradient's traffic
    at N=8 but 3.1% at N=256 (docs/accuracy.md, "At 64-256 ranks"); with it, ~pool rows at any N."""
    k = min(share or width, width)
    return min(k, -(-pool // world_size)) if pool > 0 else k


class CrossShardNegativesHead(LocalHead):
    """The method plus other ranks' class centres as extra, frozen negatives (issue: accuracy).

    A rank's softmax otherwise contrasts only its own classes: classes on different ranks are never pushed
    apart. Every ``every`` steps each rank publishes ``share`` of its centres (all of them when ``share`` is
    0; a seeded random subset otherwise) through one all-gather; every rank keeps the others' centres as a
    *buffer* and appends them as extra columns of its softmax. The gradient reaches the features (and
    through them the backbone) but never the remote centres, and this rank's classifier is still updated
    from its own data only. Per-step traffic stays the backbone gradient; the exchange adds
    ``share x D x 4`` bytes per rank every ``every`` steps (amortised: divide by ``every``).

    The rows travel *raw*, exactly as the owner holds them, and are scored by the same loss as this rank's
    own columns, so a remote column's logit is the one its owner computes for that class (tested against
    the owner's logits under horovodrun for softmax, CosFace and ArcFace, tests/test_negatives.py).
    Normalised rows were right only for the margin losses, which divide every column by its norm anyway:
    with ``head.loss=softmax`` (logits ``x . w``) a unit-norm remote row scored ``|w|^-1`` times its owner's
    logit, ~9x at D=128 and the N(0, 0.01) init, so the remote classes dominated the softmax.

    With ``sample_rate`` < 1 only this rank's own rows are sampled (``LocalHead.scored_rows``); the frozen
    remote columns are NOT sampled: all R of them are scored every step, beside the K sampled own rows.
    """

    def __init__(self, width: int, dim: int, label_start: int, comm, every: int, share: int,
                 slice_widths, seed: int = 0, name: str = "negatives", sample_rate: float = 1.0,
                 sparse_step: bool = True, pool: int = 0, **margin):
        super().__init__(width, dim, sample_rate, sparse_step, **margin)
        self.row_start = label_start
        self.comm, self.every, self.share, self.seed, self.name = comm, int(every), int(share), int(seed), name
        # rows each rank publishes
        self.shares = [negatives_share(w, len(slice_widths), self.share, pool) for w in slice_widths]
        self.register_buffer("remote", torch.zeros(0, dim), persistent=False)   # (R, D), no gradient
        self.exchanges = 0

    def describe(self, backbone_grad_bytes: int) -> str:
        """One line for the start of a run: the exchange's cost, amortised, against the backbone gradient."""
        dim = self.weight.shape[1]
        remote = sum(self.shares) - self.shares[self.comm.rank]
        # bytes through this rank per step, amortised: its share handed in, every rank's share received;
        # against the gradient's allreduce, handed in and received (the convention of the scale study)
        per_step = (self.shares[self.comm.rank] + sum(self.shares)) * dim * 4 / self.every
        return (f"cross-shard negatives: every {self.every} steps, {self.shares[self.comm.rank]} of "
                f"{self.width} centres shared per rank, {remote} remote centres held "
                f"({remote * dim * 4 / 2 ** 20:.1f} MB); {per_step:,.0f} B/step sent + received, amortised = "
                f"{per_step / max(2 * backbone_grad_bytes, 1):.2%} of the backbone gradient's")

    def before_step(self, step: int) -> None:
        # Every rank takes the same decision: same config, and ``remote`` is empty on all ranks or none
        # (fresh start, or a resume at another world size).
        if self.comm.size > 1 and (step % self.every == 0 or self.remote.numel() == 0):
            self.exchange(step)

    @torch.no_grad()
    def exchange(self, step: int) -> None:
        """One all-gather of raw centres; a collective: every rank calls it at the same steps."""
        rank, k = self.comm.rank, self.shares[self.comm.rank]
        if k < self.width:
            g = torch.Generator().manual_seed(derive_seed(self.seed, rank, step))
            rows = torch.sort(torch.randperm(self.width, generator=g)[:k]).values.to(self.weight.device)
            mine = self.weight[rows]
        else:
            mine = self.weight.detach()
        mine = mine.float().contiguous()                                              # (k, D), raw rows
        # the old buffer goes first: held through the gather and the cat, its R rows made the exchange the
        # peak of memory (np=4, 4 x 10^5 x 128, whole slices: 956 -> 806 MB per rank, docs/benchmarks.md)
        self.remote = self.remote.new_zeros(0, self.weight.shape[1])
        gathered = self.comm.allgather_tensor(mine, f"{self.name}.centres")           # (sum shares, D)
        lo = sum(self.shares[:rank])
        self.remote = torch.cat([gathered[:lo], gathered[lo + k:]])                   # others' centres only
        self.exchanges += 1

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # W + R columns: this rank's centres (trained) then the remote ones (frozen buffer), scored into one
        # (B, W + R) buffer without a (W + R, D) copy; the targets are local, so the margin only ever
        # touches this rank's own columns.
        frozen = self.remote if self.remote.numel() else None
        weight, labels = self.scored_rows(labels)                         # own rows: all, or the sample
        return margin_cross_entropy(features, weight, labels, self.margin, frozen=frozen)

    def extra_state_for_checkpoint(self) -> dict:
        return {"remote": self.remote.detach().cpu(), "exchanges": self.exchanges, "rows": "raw"}

    def load_extra_state(self, state: dict) -> None:
        # Checkpoints written before the rows travelled raw hold normalised rows: right for the margin
        # losses (they normalise every column), wrong for softmax, whose remote buffer then stays empty
        # and is exchanged again at the resume step (every rank reads the same kind of checkpoint).
        if "remote" in state and (state.get("rows") == "raw" or self.margin.normalized):
            self.remote = state["remote"].to(self.weight.device)
            self.exchanges = state.get("exchanges", 0)


class ReplicatedHead(LocalClassifier):
    """All C rows on every rank; labels are shifted back to global ones (``y + label_start``)."""

    def __init__(self, num_classes: int, dim: int, label_start: int, **margin):
        super().__init__(num_classes, dim, **margin)
        self.label_start, self.row_start = label_start, 0

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        glob = labels + self.label_start                                   # (B,) global labels
        return margin_cross_entropy(features, self.weight, glob, self.margin)


class GlobalSoftmaxHead(LocalClassifier):
    """This rank's slice of the classifier, scored against the whole gathered batch (exact softmax)."""

    def __init__(self, width: int, dim: int, label_start: int, comm, sample_rate: float = 1.0,
                 name: str = "head", **margin):
        super().__init__(width, dim, **margin)
        self.label_start, self.row_start = label_start, label_start
        self.comm, self.sample_rate, self.name = comm, float(sample_rate), name

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        feats = comm.allgather_with_grad(features, f"{self.name}.features", grad_scale=comm.size)  # (M, D)
        glob = comm.allgather_tensor(labels + self.label_start, f"{self.name}.labels")              # (M,)
        local = glob - self.label_start
        local = torch.where((local >= 0) & (local < self.width), local, torch.full_like(local, -1))  # (M,)
        weight = self.weight
        if self.sample_rate < 1.0:
            weight, local = self._sample(local)
        # softmax over all ranks' columns (allreduce of row max, of sums of exponentials and targets)
        return margin_cross_entropy(feats, weight, local, self.margin, comm, self.name)

    def _sample(self, local: torch.Tensor):
        """PartialFC v2's sampling: every positive centre, then random negatives up to rate x width rows.

        The gradient stays dense ((W, D), zero outside the sample) and the dense optimizer steps every row,
        as PartialFC v2 does: this is the baseline; ``local`` mode's sampled step is row-sparse."""
        index, remapped = sample_rows(local, self.width, self.sample_rate, self.weight.device)
        return self.weight[index], remapped                                # (keep, D), (M,)


def create_head(mode: str, label_slice, num_classes: int, dim: int, head_cfg, comm, slice_widths=None,
                seed: int = 0) -> LocalClassifier:
    """The classifier of ``mode``; ``.row_start`` is the global label of its row 0 (for the init)."""
    margin = dict(loss=head_cfg.loss, scale=head_cfg.scale, margin=head_cfg.margin)
    if mode == "local" and head_cfg.negatives_every > 0:
        return CrossShardNegativesHead(label_slice.width, dim, label_slice.start, comm, head_cfg.negatives_every,
                                       head_cfg.negatives_share, slice_widths, seed,
                                       sample_rate=head_cfg.sample_rate, pool=head_cfg.negatives_pool,
                                       sparse_step=head_cfg.sampled_step != "dense", **margin)
    if mode == "local":
        head = LocalHead(label_slice.width, dim, head_cfg.sample_rate, head_cfg.sampled_step != "dense", **margin)
        head.row_start = label_slice.start
        return head
    if mode == "global":
        return GlobalSoftmaxHead(label_slice.width, dim, label_slice.start, comm, head_cfg.sample_rate, **margin)
    if mode == "replicated":
        return ReplicatedHead(num_classes, dim, label_slice.start, **margin)
    raise ValueError(f"unknown classifier mode {mode!r}; known: {', '.join(MODES)}")


def classifier_group(mode: str, classifier, opt_cfg) -> Dict[str, Any]:
    """The classifier's param group: its own lr / momentum / weight decay, and ``lr_from``, the config key
    of its peak lr, which the schedule (``Trainer._set_lr``) reads whichever optimizer holds the group.

    ``fused``: torch's fused SGD / AdamW kernel updates the (W, D) matrix in one pass, without the
    (W, D) temporary the per-tensor loop makes for the weight decay: ~4x faster at 5 x 10^5 x 128 on
    one CPU thread (244 ms -> 60 ms), and the same formula.
    """
    group = {"params": list(classifier.parameters()), "lr": opt_cfg.classifier_lr, "fused": True,
             "lr_from": "classifier_lr", "weight_decay": opt_cfg.classifier_weight_decay}
    if opt_cfg.name == "sgd":
        group["momentum"] = opt_cfg.classifier_momentum
    return group


class NoOptimizer:
    """``classifier_opt`` in ``replicated`` mode, where the backbone's DistributedOptimizer owns the
    classifier: it holds nothing, so the loop's classifier step, zero_grad and state are no-ops."""

    param_groups: List[Dict[str, Any]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass
