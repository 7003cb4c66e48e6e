"""The heads of the classifier modes (``modes.py`` registers the modes that build them).

* ``LocalHead`` (``local``, the method): softmax over this rank's slice, labels ``y - start``; with
  ``head.sample_rate`` r < 1 a sample of the slice's rows is scored and stepped (rowsparse.py).
* ``GlobalSoftmaxHead`` (``global``, exact model-parallel softmax, as InsightFace's PartialFC and Megatron's
  vocab-parallel cross entropy): features and labels are all-gathered, each rank scores the whole gathered
  batch against its own slice, and the softmax is normalised across ranks (allreduce of the row max, then
  of the row sum of exponentials and of the target logit, which only the owning rank holds). The loss is
  the mean over the gathered batch, the same number on every rank; the features' gradient is summed over
  ranks and multiplied by N (``CommBase.allgather_with_grad``), since the backbone's optimizer then averages.
  r < 1 keeps every positive centre of the gathered batch plus random negatives (PartialFC's sampling).
* ``ReplicatedHead`` (``replicated``, classic data parallel, PartialFC's "DP" column): the full C x D
  classifier on every rank, global labels; its gradient is averaged with the backbone's.
"""
from __future__ import annotations

from typing import Optional

import torch

from .margins import LocalClassifier, margin_cross_entropy
from .rowsparse import gather_rows, sample_rows

# sampled ``local`` scores int(sample_rate x width) of a rank's rows a step (plus its positives); fewer than
# this many and a start-up warning says so (``LocalHead.sampling_warning``: the measured reason)
FEW_SAMPLED_ROWS = 32


class LocalHead(LocalClassifier):
    """The method: softmax over this rank's slice (``LocalClassifier`` itself at ``sample_rate`` 1).

    ``sample_rate`` r < 1 (sampled heads): each step keeps every positive row of the rank's batch and random
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
        # it to the sampled-rows optimizer's catch_up)
        self.before_gather = None

    def sampling_warning(self) -> Optional[str]:
        """A line for the start of a run when ``sample_rate`` scores fewer than ``FEW_SAMPLED_ROWS`` of this
        rank's rows a step, else None. Measured (docs/evidence/accuracy.md, scale study, r = 0.1): 38 rows
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
        if self.before_gather is not None:   # the sampled step's catch-up of these rows (rowsparse.py)
            self.before_gather(self.weight, index)
        if not self.sparse_step:   # head.sampled_step=dense: PartialFC v2's step (every row moves by momentum)
            return self.weight.index_select(0, index), remapped
        return gather_rows(self.weight, index), remapped

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight, labels = self.scored_rows(labels)
        return margin_cross_entropy(features, weight, labels, self.margin, matmul=self.matmul)


class ReplicatedHead(LocalClassifier):
    """All C rows on every rank; labels are shifted back to global ones (``y + label_start``)."""

    def __init__(self, num_classes: int, dim: int, label_start: int, **margin):
        super().__init__(num_classes, dim, **margin)
        self.label_start, self.row_start = label_start, 0

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        glob = labels + self.label_start                                   # (B,) global labels
        return margin_cross_entropy(features, self.weight, glob, self.margin, matmul=self.matmul)


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
        return margin_cross_entropy(feats, weight, local, self.margin, comm, self.name, matmul=self.matmul)

    def _sample(self, local: torch.Tensor):
        """PartialFC v2's sampling: every positive centre, then random negatives up to rate x width rows.

        The gradient stays dense ((W, D), zero outside the sample) and the dense optimizer steps every row,
        as PartialFC v2 does: this is the baseline; ``local`` mode's sampled step is row-sparse."""
        index, remapped = sample_rows(local, self.width, self.sample_rate, self.weight.device)
        return self.weight[index], remapped                                # (keep, D), (M,)
