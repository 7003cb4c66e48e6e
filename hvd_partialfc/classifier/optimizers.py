"""The optimizers: torch's SGD / AdamW, the sampled-rows optimizer of sampled ``local``, the classifier's
param group, and the empty optimizer of a classifier that the backbone's averaging optimizer steps."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from .rowsparse import SampledRowsOptimizer


# ``optim.backbone_kernel`` / ``optim.classifier_kernel`` -> torch's optimizer flags (``auto`` is resolved per
# device before, run/speed.py). ``torch`` passes none: torch picks foreach on CUDA and the per-tensor loop on
# CPU (the numbers every CPU pin was recorded with).
KERNELS = {"torch": {}, "loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def kernel_flags(kernel: str) -> Dict[str, bool]:
    """torch's ``foreach`` / ``fused`` flags of a kernel setting (``KERNELS``), for an optimizer or a group."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown optimizer kernel {kernel!r}; known: {', '.join(KERNELS)}")
    return dict(KERNELS[kernel])


def adamw_betas(momentum: float):
    """AdamW's (beta1, beta2): ``optim.*_momentum`` is beta1 (0.9 by default: torch's own), beta2 torch's 0.999."""
    return (float(momentum), 0.999)


def make_optimizer(params, name: str, lr: float, momentum: float, weight_decay: float,
                   sampled_rows: str = "", kernel: str = "torch") -> torch.optim.Optimizer:
    """torch's SGD / AdamW with ``kernel``'s flags (``KERNELS``); ``sampled_rows`` ("exact" / "lazy"): the
    step over the rows of a row-sparse gradient only, with that rule (`rowsparse.SampledRowsOptimizer`, the
    classifier of sampled ``local``), whose kernels are its own."""
    if sampled_rows:
        return SampledRowsOptimizer(params, name, lr, momentum=momentum, weight_decay=weight_decay, rule=sampled_rows,
                                    betas=adamw_betas(momentum))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kernel_flags(kernel))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=adamw_betas(momentum),
                                 **kernel_flags(kernel))
    raise ValueError(f"unknown optimizer {name!r}; known: sgd, adamw")


def classifier_group(classifier, opt_cfg) -> Dict[str, Any]:
    """The classifier's param group: its own lr / momentum / weight decay, and ``lr_from``, the config key
    of its peak lr, which the schedule (``Step.set_lr``) reads whichever optimizer holds the group.

    ``optim.classifier_kernel`` (default ``fused``): torch's fused SGD / AdamW kernel updates the (W, D)
    matrix in one pass, without the (W, D) temporary the per-tensor loop makes for the weight decay: ~4x
    faster at 5 x 10^5 x 128 on one CPU thread (244 ms -> 60 ms), and the same formula.
    """
    group = {"params": list(classifier.parameters()), "lr": opt_cfg.classifier_lr,
             **kernel_flags(opt_cfg.classifier_kernel),
             "lr_from": "classifier_lr", "weight_decay": opt_cfg.classifier_weight_decay}
    if opt_cfg.name == "sgd":
        group["momentum"] = opt_cfg.classifier_momentum
    elif opt_cfg.name == "adamw":
        group["betas"] = adamw_betas(opt_cfg.classifier_momentum)
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
