"""Cross-shard negatives: ``local`` plus other ranks' class centres as extra, frozen softmax columns.

Every K steps (``head.negatives_every``) the ranks all-gather a share of their centres; each keeps the
others' as a buffer scored beside its own rows. Its traffic and its accuracy are measured in
docs/accuracy.md.
"""
from __future__ import annotations

import torch

from .margins import margin_cross_entropy
from .heads import LocalHead
from ..seeds import derive_seed


def negatives_share(width: int, world_size: int, share: int, pool: int) -> int:
    """Centres a rank of slice ``width`` publishes per exchange: ``share`` of them (0: all), at most
    ceil(``pool`` / N) when ``pool`` > 0. Every rank receives every share, so without the pool what a rank
    receives and holds grows with N: at iresnet50's D = 512 and 1,024 a rank, 0.11% of the gradient's traffic
    at N=8 but 3.1% at N=256 (docs/evidence/accuracy.md, "At 64-256 ranks"); with it, ~pool rows at any N."""
    k = min(share or width, width)
    return min(k, -(-pool // world_size)) if pool > 0 else k


class CrossShardNegativesHead(LocalHead):
    """The method plus other ranks' class centres as extra, frozen negatives (for accuracy).

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
        # peak of memory (np=4, 4 x 10^5 x 128, whole slices: 956 -> 806 MB per rank, docs/evidence/benchmarks.md)
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
        return margin_cross_entropy(features, weight, labels, self.margin, frozen=frozen, matmul=self.matmul)

    def extra_state_for_checkpoint(self) -> dict:
        return {"remote": self.remote.detach().cpu(), "exchanges": self.exchanges, "rows": "raw"}

    def extra_state_bytes(self) -> int:
        """The remote rows once exchanged: every other rank's share, at the rows' precision."""
        return (sum(self.shares) - self.shares[self.comm.rank]) * self.weight.shape[1] * self.weight.element_size()

    def load_extra_state(self, state: dict) -> None:
        # Checkpoints written before the rows travelled raw hold normalised rows: right for the margin
        # losses (they normalise every column), wrong for softmax, whose remote buffer then stays empty
        # and is exchanged again at the resume step (every rank reads the same kind of checkpoint).
        if "remote" in state and (state.get("rows") == "raw" or self.margin.normalized):
            self.remote = state["remote"].to(self.weight.device)
            self.exchanges = state.get("exchanges", 0)
