"""arcface_torch's per-rank checkpoint files as its train_v2.py writes them (the published layout: the keys
of each file, Partial FC v2's class partition, the one SGD over two parameter groups, the lr scheduler's
state_dict), written here from a state for the import's tests. No arcface_torch code: only the format facts.

The scheduler's state, as ``_LRScheduler.state_dict()`` gives it (the scheduler's attributes but its
optimizer): today's ``PolynomialLRWarmup`` keeps ``total_iters``, ``warmup_iters``, ``power`` (1.0 unless
given) and ends a run of G batches at ``last_epoch`` G; the older ``PolyScheduler`` keeps ``max_steps``,
``warmup_steps``, ``power`` 2, ``base_lr``, and resets ``last_epoch`` to -1 after its first step, so it ends
the same run at G - 1. Both step once per batch, gradient accumulation or not."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, List, Optional

import torch


def pfc_slices(classes: int, world: int) -> List[tuple]:
    """Partial FC v2's (start, rows) of each rank: C // W + (r < C % W) rows from C // W * r + min(r, C % W)."""
    base, extra = divmod(classes, world)
    return [(base * r + min(r, extra), base + (r < extra)) for r in range(world)]


def write_run(out: str, backbone: Dict[str, torch.Tensor], param_names: List[str], rows: torch.Tensor,
              rows_momentum: Optional[torch.Tensor], backbone_momentum: Dict[str, torch.Tensor], world: int,
              step: int, epoch: int = 1, lr: float = 0.1, weight_decay: float = 5e-4,
              rank_buffers: Optional[List[Dict[str, torch.Tensor]]] = None, total: Optional[int] = None,
              warmup: float = 0, power: float = 2, scheduler: str = "poly_warmup", optimizer: str = "sgd") -> List[str]:
    """``checkpoint_gpu_{r}.pt`` for r < ``world``: every rank the backbone (its own BatchNorm buffers from
    ``rank_buffers``), its rows of ``rows`` and their momentum, the optimizer's state and groups, the
    scheduler's state (``scheduler``: ``poly_warmup``, today's, or ``poly``, the older one; ``total``
    batches, 10 x ``step`` unless given, ``warmup`` of them, ``power``) after ``step`` batches (arcface's
    ``global_step``). ``optimizer="adamw"`` (its ViT recipes): torch's AdamW groups, and each "momentum" is
    then a dict of AdamW's state (``exp_avg``, ``exp_avg_sq``, ``step``; the rows' moments (C, D), cut per
    rank, their ``step`` one scalar). Returns the paths."""
    os.makedirs(out, exist_ok=True)
    k = len(param_names)
    group = {"lr": lr, "momentum": 0.9, "dampening": 0, "weight_decay": weight_decay, "nesterov": False,
             "maximize": False, "foreach": None, "differentiable": False, "fused": None, "initial_lr": lr}
    if optimizer == "adamw":
        group = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "initial_lr": lr}
    paths = []
    for r, (start, n) in enumerate(pfc_slices(rows.shape[0], world)):
        sd = OrderedDict((name, t.clone()) for name, t in backbone.items())
        if rank_buffers:
            sd.update({name: t.clone() for name, t in rank_buffers[r].items()})
        if optimizer == "adamw":
            state = {i: {key: t.clone() for key, t in backbone_momentum[name].items()}
                     for i, name in enumerate(param_names) if name in backbone_momentum}
            if rows_momentum is not None:
                state[k] = {key: t.clone() if key == "step" else t[start:start + n].clone()
                            for key, t in rows_momentum.items()}
        else:
            state = {i: {"momentum_buffer": backbone_momentum[name].clone()} for i, name in enumerate(param_names)
                     if name in backbone_momentum}
            if rows_momentum is not None:
                state[k] = {"momentum_buffer": rows_momentum[start:start + n].clone()}
        opt_state = {"state": state, "param_groups": [dict(group, params=list(range(k))), dict(group, params=[k])]}
        total = 10 * step if total is None else total
        if scheduler == "poly_warmup":
            sched = {"base_lrs": [lr, lr], "last_epoch": step, "_step_count": step + 1, "_last_lr": [lr, lr],
                     "warmup_iters": warmup, "total_iters": total, "power": power}
        else:
            sched = {"base_lr": lr, "warmup_lr_init": 0.0001, "max_steps": total, "warmup_steps": warmup,
                     "power": power, "base_lrs": [lr, lr], "last_epoch": step - 1, "verbose": False,
                     "_step_count": step + 1, "_last_lr": [lr, lr]}
        path = os.path.join(out, f"checkpoint_gpu_{r}.pt")
        torch.save({"epoch": epoch, "global_step": step, "state_dict_backbone": sd,
                    "state_dict_softmax_fc": OrderedDict(weight=rows[start:start + n].clone()),
                    "state_optimizer": opt_state, "state_lr_scheduler": sched}, path)
        paths.append(path)
    return paths
