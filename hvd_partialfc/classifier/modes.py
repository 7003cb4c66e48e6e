"""Classifier modes: the method and its two baselines, each one registered component, in one training loop.

A mode decides everything that differs between them, and nothing outside this module branches on a mode's
name: the head it builds (``create_head``), which optimizer steps the classifier (``averaged``: the
backbone's averaging optimizer, one param group more; else ``classifier_optimizer``, a plain local one),
the classifier gradient's scale (``grad_scale``), the checkpoint layout (``replicated_rows``: every rank's
file holds all C rows; else each holds its slice) and its terms in the memory and traffic estimator
(``estimate_*``). ``head.mode`` is looked up here when the parts are built (``get_mode``), as
``model.name`` is in ``models``; a new mode is a subclass registered with ``@register_mode("name")``.

* ``local`` (the method): a classifier as wide as the rank's slice, softmax over the slice, a plain local
  optimizer, never communicated. Traffic: the backbone gradient (plus, with ``head.negatives_every`` > 0,
  the cross-shard negatives' exchange: negatives.py). ``head.sample_rate`` < 1 scores a sample of the
  slice's rows and steps only those (rowsparse.py).
* ``global`` (exact model-parallel softmax, PartialFC's): each rank scores the gathered batch against its
  slice; the softmax is normalised across ranks (heads.py).
* ``replicated`` (classic data parallel): the full classifier on every rank, averaged with the backbone.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..registry import Registry
from .margins import LocalClassifier
from .heads import GlobalSoftmaxHead, LocalHead, ReplicatedHead
from .negatives import CrossShardNegativesHead
from .optimizers import classifier_group, make_optimizer

MODES: Registry["ClassifierMode"] = Registry("classifier mode", key="head.mode=", sort=False)
_MODES = MODES.entries      # the registry's dict (a test removes the toy mode it registered)


def register_mode(name: str) -> Callable:
    """Class decorator: register an instance of a ``ClassifierMode`` subclass as ``head.mode=name``."""
    def deco(cls):
        cls.name = name
        MODES.add(name, cls())
        return cls
    return deco


def list_modes():
    """The registered modes, in registration order (the method first)."""
    return MODES.names()


def get_mode(name: str) -> "ClassifierMode":
    return MODES.get(name)


def margin_args(head_cfg) -> Dict[str, Any]:
    return dict(loss=head_cfg.loss, scale=head_cfg.scale, margin=head_cfg.margin,
                interclass=head_cfg.interclass_filter)


class ClassifierMode:
    """What one classifier mode decides. The defaults are the sharded, locally stepped case."""

    name = ""
    averaged = False          # the classifier's gradient is averaged with the backbone's, by the same optimizer
    replicated_rows = False   # every rank holds all C rows (checkpoints: each rank's file holds them all)
    samples = False           # head.sample_rate < 1 is meaningful
    negatives = False         # head.negatives_every > 0 adds cross-shard negatives
    row_sparse_step = False   # sampled rows are stepped by the row-sparse optimizer (head.sampled_step applies)

    def check(self, head_cfg) -> None:
        """Refuse settings this mode does not use (called when the parts are built)."""
        if head_cfg.sample_rate < 1.0 and not self.samples:
            samplers = " or ".join(m for m in list_modes() if get_mode(m).samples)
            raise ValueError(f"head.sample_rate < 1 samples the centres of head.mode={samplers}, not {self.name}")

    def create_head(self, cfg, layout, rank: int, comm) -> LocalClassifier:
        """This rank's head; its ``row_start`` is the global label of its row 0 (for the rows' init)."""
        raise NotImplementedError

    def classifier_optimizer(self, head: LocalClassifier, cfg) -> Optional[torch.optim.Optimizer]:
        """The plain optimizer that steps the classifier with its local gradient (None when ``averaged``)."""
        o = cfg.optim
        return make_optimizer([classifier_group(head, o)], o.name, o.classifier_lr, o.classifier_momentum,
                              o.classifier_weight_decay)

    def grad_scale(self, cfg, world_size: int) -> float:
        """The factor of the classifier's local gradient before its step."""
        return 1.0

    # --- the estimator's terms (estimate.py) -----------------------------------------------------------
    def estimate_width(self, layout) -> int:
        """Classifier rows the widest rank holds on ``layout`` (``data.layout.RankLayout``)."""
        return max(layout.widths)

    def estimate_logit_rows(self, batch: int, world_size: int) -> int:
        """Rows of the logits a rank computes per step."""
        return batch

    def estimate_terms(self, s) -> Tuple[Dict[str, int], Dict[str, float]]:
        """Memory components (overriding ``estimate.estimate``'s defaults) and traffic components of this
        mode, from the sizes in ``s`` (classes, world_size, dim, batch, e: bytes a value, state: optimizer
        copies, width, rows, own: rows scored, sampled, optimizer, sampled_step, fp16_compression)."""
        return {}, {}


@register_mode("local")
class LocalMode(ClassifierMode):
    """The method (and, with ``head.negatives_every`` > 0, the method plus cross-shard negatives)."""

    samples = True
    negatives = True
    row_sparse_step = True

    def create_head(self, cfg, layout, rank, comm):
        h, dim, sl = cfg.head, cfg.model.embedding_dim, layout.slices[rank]
        sparse = h.sampled_step != "dense"
        if h.negatives_every > 0:
            return CrossShardNegativesHead(sl.width, dim, sl.start, comm, h.negatives_every, h.negatives_share,
                                           layout.widths, cfg.train.seed, sample_rate=h.sample_rate,
                                           pool=h.negatives_pool, sparse_step=sparse, **margin_args(h))
        head = LocalHead(sl.width, dim, h.sample_rate, sparse, **margin_args(h))
        head.row_start = sl.start
        return head

    @staticmethod
    def sampled_rule(cfg) -> str:
        """The sampled-rows optimizer's rule ("": a plain torch optimizer). AdamW has no exact rule (its
        zero-gradient steps are not linear): "exact" means "lazy" there (rowsparse.py)."""
        h = cfg.head
        if h.sample_rate >= 1.0 or h.sampled_step == "dense":
            return ""
        return "lazy" if cfg.optim.name == "adamw" else h.sampled_step

    def classifier_optimizer(self, head, cfg):
        # sampled: the gradient is row-sparse and the step touches the sampled rows only; the exact rule
        # brings a sampled row up to the dense step's value before it is scored (rowsparse.py)
        o, rule = cfg.optim, self.sampled_rule(cfg)
        opt = make_optimizer([classifier_group(head, o)], o.name, o.classifier_lr, o.classifier_momentum,
                             o.classifier_weight_decay, sampled_rows=rule)
        if rule:   # the exact rule's catch-up; both rules note the gathered rows (no host read, rowsparse.py)
            head.before_gather = opt.catch_up
        return opt

    def grad_scale(self, cfg, world_size):
        # the loss is the mean over this rank's batch, so the classifier's gradient is N times the one np=1
        # (or `global`, whose loss is the mean over the gathered batch) computes for the same rows; "global"
        # divides it back
        return 1.0 / world_size if cfg.optim.classifier_grad_mean == "global" else 1.0

    def estimate_terms(self, s):
        mem = {}
        if s.sampled:
            # a row-sparse gradient (K rows), the K rows and the sampled step's gathered rows of the weight
            # and of its state; SGD's exact rule: the catch-up's gathered rows (weight, momentum, a copy),
            # the (W,) lag vector and one block of the sweep (rowsparse.py)
            from .rowsparse import SWEEP_BLOCK
            mem["classifier grads"] = s.own * s.dim * s.e
            mem["classifier temporaries"] = (2 + s.state) * s.own * s.dim * s.e
            if s.optimizer.startswith("sgd") and s.sampled_step == "exact":
                mem["exact sampled step"] = (3 * s.own * s.dim * s.e + s.width * 4
                                             + min(s.width, SWEEP_BLOCK) * s.dim * s.e)
        return mem, {}


@register_mode("global")
class GlobalMode(ClassifierMode):
    """Exact softmax over all classes, model parallel (PartialFC's; sampled: PartialFC v2's)."""

    samples = True

    def create_head(self, cfg, layout, rank, comm):
        sl = layout.slices[rank]
        return GlobalSoftmaxHead(sl.width, cfg.model.embedding_dim, sl.start, comm, cfg.head.sample_rate,
                                 **margin_args(cfg.head))

    def estimate_logit_rows(self, batch, world_size):
        return batch * world_size

    def estimate_terms(self, s):
        # sampled: the K rows, their gradient, the scatter into a dense (W, D) gradient (PartialFC v2's)
        mem = {"gathered features": 3 * s.rows * s.dim * 4}
        if s.sampled:
            mem["classifier temporaries"] = (2 * s.own * s.dim + s.width * s.dim) * s.e
        traffic = {"features (allgather)": s.batch * s.dim * 4, "labels (allgather)": s.batch * 8 + 8,
                   "feature gradient (allreduce)": s.rows * s.dim * 4,
                   "softmax max + sums (allreduce)": 3 * s.rows * 4}
        return mem, traffic


@register_mode("replicated")
class ReplicatedMode(ClassifierMode):
    """Classic data parallel: the full classifier's gradient is averaged with the backbone's."""

    averaged = True
    replicated_rows = True

    def create_head(self, cfg, layout, rank, comm):
        return ReplicatedHead(layout.num_classes, cfg.model.embedding_dim, layout.slices[rank].start,
                              **margin_args(cfg.head))

    def classifier_optimizer(self, head, cfg):
        return None

    def estimate_width(self, layout):
        return layout.num_classes

    def estimate_terms(self, s):
        return {}, {"classifier gradient": s.classes * s.dim * (2 if s.fp16_compression else 4)}

