"""Per-rank memory and per-step traffic of the three classifier modes, from the sizes alone.

    hvd-partialfc estimate --classes C --world-size N --dim D --batch B --backbone NAME [--mode ...] [--dtype ...]
                           [--negatives-every K [--negatives-share S]] [--memory-every K [--ranks-per-node R]]

The model counts what this trainer allocates (fp32 training on one device; ``--dtype`` is the storage of
the classifier, its gradient, its optimizer state and the logits):

* classifier rows: W = ceil(C / N) for ``local`` / ``global``, W = C for ``replicated``;
* classifier: weights, gradient and optimizer state (SGD momentum: 1 copy; AdamW: 2); the fused head
  (``heads.margin_cross_entropy``) and the fused optimizer make no other (W, D) array, except, for
  sampled ``global``, the sampled rows, their gradient and the scatter back into a (W, D) gradient;
* sampled ``local`` (``sample_rate`` < 1): a row-sparse gradient of the K = rate x W sampled rows, and the
  sampled step's gathered copies of those rows (weight and optimizer state); with SGD and
  ``head.sampled_step=exact`` also the catch-up's three (K, D) copies, a (W,) lag vector and one sweep block;
* logits: rows M (B for ``local`` / ``replicated``, B x N gathered rows for ``global``) x W columns
  (x ``sample_rate`` for sampled ``global`` and ``local``) in ``LOGIT_COPIES`` buffer (the fused head makes the
  cosines, the softmax and its gradient in the same buffer);
* gathered features (``global``): the (M, D) features, their normalised copy and their gradient;
* cross-shard negatives (``local``, ``--negatives-every``): the remote centres' buffer (R = (N - 1) x share
  rows, fp32) and their R logit columns (the fused head scores them into the same buffer, with no
  (W + R, D) copy and no gradient). The exchange, before the step's forward, frees the old buffer and
  then holds the all-gathered (R + share, D) rows and the new (R, D) buffer (plus the published rows'
  copy when share < W): R + share rows more than between exchanges. No gradient, logits or activations
  exist then, so ``negatives exchange`` counts only what it needs beyond the step's own transients
  (classifier gradient, logits, activations, backbone gradient); at np=2 with whole slices shared the
  two are about equal;
* backbone: parameters, gradient, optimizer state, and activations (the leaf modules' outputs for one
  batch, measured with a forward pass of 2 samples and scaled to B);
* runtime: what a process holds regardless of the sizes: ~238 MB before any model exists (Python,
  torch, Horovod) plus ~95 MB that appears with the first training step of any size (autograd engine,
  BLAS/oneDNN buffers, allocator caches), both measured by the benchmark on this machine
  (``runtime_rss`` in its JSON; ``--runtime-mb`` to change).

Traffic: bytes this rank hands to collectives per step (what the benchmark counts): the averaged gradients
(backbone; plus the full classifier for ``replicated``), for ``global`` the gathered features and
labels, the allreduce of the features' gradient, the row max and the sums of exponentials/targets, and
for cross-shard negatives this rank's shared centres once every K steps (amortised).

Host memory (``--memory-every K``, ``checkpoint.memory_every``): memory snapshots live in each node's
``/dev/shm``, not on the GPU, so they are a separate result (``host_bytes``, per node: ``snapshot_host_bytes``)
and never part of ``memory_total``; their copy to the buddy rank (TCP, beside the step, not a collective)
is added to the traffic, amortised over K steps, because it shares the node's network with the step's.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..classifier.modes import get_mode, list_modes
from ..data.layout import RankLayout
from ..classifier.negatives import negatives_share as negatives_share_rows
from ..sizes import human

DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
LOGIT_COPIES = 1
RUNTIME_MB = 335.0
DEFAULT_IN_SHAPE = {"mlp": [512], "resnet": [112, 112, 3], "resnet18": [112, 112, 3]}
FACE_BACKBONES = ("iresnet", "mobilefacenet")   # 112x112x3 only


def backbone_figures(name: str, dim: int, batch: int, in_shape: Optional[Sequence[int]] = None,
                     kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
    """Parameter count and activation bytes per batch of ``batch`` samples (fp32) of a registered backbone."""
    from ..models import create_model, model_input_shape
    shape = list(in_shape or DEFAULT_IN_SHAPE.get(name, [112, 112, 3] if name.startswith(FACE_BACKBONES) else [512]))
    model = create_model(name, in_shape=shape, embedding_dim=dim, **(kwargs or {}))
    params = sum(p.numel() for p in model.parameters())
    outputs: List[int] = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o.numel()))
             for m in model.modules() if not list(m.children())]
    model.train()
    with torch.no_grad():
        model(torch.zeros(2, *model_input_shape(shape)))  # the input data.prepare_batch makes
    for h in hooks:
        h.remove()
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())    # BatchNorm statistics
    return {"params": params, "activation_bytes": int(sum(outputs) * 4 * batch / 2), "in_shape": shape,
            "buffer_bytes": buffer_bytes}


def snapshot_host_bytes(width: int, dim: int, state: int, params: int, buffer_bytes: int, world_size: int,
                        ranks_per_node: int, memory_every: int) -> Dict[str, Any]:
    """Host memory of memory snapshots (``checkpoint.memory_every`` = ``memory_every``), by the formula that
    ``run/snapshots/memory_plan.py`` applies to the live tensors: ``snapshot_bytes`` (a rank's file: its ``width`` classifier
    rows and their ``state`` optimizer slots, plus its own BatchNorm buffers; the node's backbone file:
    parameters and their optimizer state, plus the buffers) and the room check in ``NodeMemory.open``
    (``memory_store.room_error``'s need: 2 x (the files a node hosts + the backbone file), two snapshots at a
    time). The two count the same things: tests/test_bench_estimate.py checks these file sizes against
    ``snapshot_bytes`` of the same tensors.

    The classifier is float32 whatever ``--dtype`` or ``train.precision`` (the head's weight is a float32
    parameter under every precision: autocast casts only for the products), so 4 bytes a value. A node hosts its
    own ranks' files and the files of the previous node's ranks, whose buddies it holds (``memory_plan.Plan``: a
    rank's buddy is on the next node); with the ranks placed ``ranks_per_node`` a node in order, the busiest
    node's count is the figure. One node has no buddies (``Plan.buddy`` is None): its own files only, and no traffic. The
    RNG streams and counters (a few KB) and torch.save's framing are left out."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be at least 1, not {ranks_per_node}")
    per_rank = width * dim * 4 * (1 + state) + buffer_bytes
    backbone = params * 4 * (1 + state) + buffer_bytes
    sizes = [min(ranks_per_node, world_size - start) for start in range(0, world_size, ranks_per_node)]
    hosted = max(n + (sizes[i - 1] if len(sizes) > 1 else 0) for i, n in enumerate(sizes))
    return {"rank": per_rank, "backbone": backbone, "node": 2 * (hosted * per_rank + backbone),
            "buddy_per_step": per_rank / memory_every if len(sizes) > 1 else 0}


def _check_request(m, dtype: str, negatives_every: int) -> None:
    """Refuse what no run can ask for: cross-shard negatives in a mode that has none, an unknown dtype."""
    if negatives_every and not m.negatives:
        raise ValueError(f"cross-shard negatives (negatives_every) belong to mode "
                         f"{' or '.join(n for n in list_modes() if get_mode(n).negatives)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")


def _memory_terms(width: int, dim: int, e: int, state: int, rows: int, cols: int, remote: int,
                  bb: Dict[str, int], runtime_mb: float) -> Dict[str, int]:
    """The components every mode has, in the table's order; the mode's own terms (modes.py) and the negatives'
    exchange fill in the zeros."""
    return {
        "classifier weights": width * dim * e,
        "classifier grads": width * dim * e,
        "classifier optimizer state": state * width * dim * e,
        "classifier temporaries": 0,
        "exact sampled step": 0,
        "logits": LOGIT_COPIES * rows * cols * e,
        "gathered features": 0,
        "remote centres (negatives)": remote * dim * 4,
        "backbone (params, grads, state)": (2 + state) * bb["params"] * 4,
        "backbone activations": bb["activation_bytes"],
        "negatives exchange (beyond the step)": 0,
        "runtime": int(runtime_mb * 2 ** 20),
    }


def _snapshot_terms(width: int, dim: int, state: int, bb: Dict[str, int], world_size: int, ranks_per_node: int,
                    memory_every: int):
    """Memory snapshots' buddy copy a step (traffic) and the result's host-memory fields: host RAM is a
    separate result, never part of ``memory_total`` (see the module)."""
    snap = snapshot_host_bytes(width, dim, state, bb["params"], bb.get("buffer_bytes", 0), world_size,
                               ranks_per_node, memory_every)
    return snap["buddy_per_step"], {
        "memory_every": memory_every, "ranks_per_node": ranks_per_node, "host_total": snap["node"],
        "host_bytes": {"memory snapshot (one rank's file)": snap["rank"], "backbone file": snap["backbone"],
                       "memory snapshots per node (host RAM)": snap["node"]}}


def estimate(classes: int, world_size: int, dim: int, batch: int, backbone: str = "mlp", mode: str = "local",
             dtype: str = "fp32", optimizer: str = "sgd", sample_rate: float = 1.0,
             in_shape: Optional[Sequence[int]] = None, backbone_kwargs: Optional[Dict[str, Any]] = None,
             runtime_mb: float = RUNTIME_MB, fp16_compression: bool = False,
             bb: Optional[Dict[str, int]] = None, negatives_every: int = 0,
             negatives_share: int = 0, sampled_step: str = "exact", negatives_pool: int = 0,
             memory_every: int = 0, ranks_per_node: int = 8) -> Dict[str, Any]:
    """Per-rank bytes by component and per-step bytes handed to collectives, for one (C, N, D, B, mode).

    ``negatives_every`` = K > 0 (``local`` only): cross-shard negatives; the other ranks' shared centres
    ((N - 1) x share rows, share = ``negatives_share`` or the whole slice, at most ceil(``negatives_pool`` / N)
    when the pool is > 0: ``negatives.negatives_share``) are held as a buffer and are extra logit columns, and the
    all-gather of this rank's share is amortised over K steps.

    ``memory_every`` = K > 0: memory snapshots with ``ranks_per_node`` ranks a node (``snapshot_host_bytes``):
    ``host_bytes`` (host memory, beside the GPU's ``memory_bytes``; absent at K = 0, so results without
    snapshots are what they were) and the buddy copy in ``traffic_bytes``.
    """
    from types import SimpleNamespace
    m = get_mode(mode)
    _check_request(m, dtype, negatives_every)
    e = DTYPES[dtype]
    width = m.estimate_width(RankLayout.even(classes, world_size))   # the widest rank's slice
    rows = m.estimate_logit_rows(batch, world_size)
    sampled = sample_rate < 1.0 and m.samples
    own = max(1, int(width * sample_rate)) if sampled else width     # this rank's columns scored per step
    cols = own
    share = negatives_share_rows(width, world_size, negatives_share, negatives_pool) if negatives_every else 0
    remote = (world_size - 1) * share                  # frozen remote centres (rows), fp32 buffer
    cols += remote
    bb = bb or backbone_figures(backbone, dim, batch, in_shape, backbone_kwargs)
    state = {"sgd": 1, "sgd-nomomentum": 0, "adamw": 2}[optimizer]
    mem = _memory_terms(width, dim, e, state, rows, cols, remote, bb, runtime_mb)
    grad_bytes = bb["params"] * (2 if fp16_compression else 4)
    traffic = {"backbone gradient": grad_bytes}
    sizes = SimpleNamespace(classes=classes, world_size=world_size, dim=dim, batch=batch, e=e, state=state,
                            width=width, rows=rows, own=own, sampled=sampled, optimizer=optimizer,
                            sampled_step=sampled_step, fp16_compression=fp16_compression)
    mode_mem, mode_traffic = m.estimate_terms(sizes)   # the mode's own components (modes.py)
    mem.update(mode_mem)
    traffic.update(mode_traffic)
    if negatives_every:  # gathered R + share rows and the new R-row buffer, the old one freed first
        exchange = (remote + share + (share if share < width else 0)) * dim * 4
        step = mem["classifier grads"] + mem["logits"] + bb["activation_bytes"] + bb["params"] * 4
        mem["negatives exchange (beyond the step)"] = max(0, exchange - step)
        traffic["centres (allgather, amortised)"] = share * dim * 4 / negatives_every
    extra: Dict[str, Any] = {}
    if memory_every > 0:
        traffic["memory snapshot to buddy (amortised)"], extra = _snapshot_terms(
            width, dim, state, bb, world_size, ranks_per_node, memory_every)
    return {"classes": classes, "world_size": world_size, "dim": dim, "batch": batch, "backbone": backbone,
            "mode": mode + (f"+negatives(K={negatives_every})" if negatives_every else ""), "dtype": dtype,
            "width": width, "logit_rows": rows, "memory_bytes": mem,
            "memory_total": sum(mem.values()), "traffic_bytes": traffic, "traffic_total": sum(traffic.values()),
            "backbone_params": bb["params"], **extra}


def table(results: Sequence[Dict[str, Any]]) -> str:
    """Markdown: one column per estimate, one row per memory component, then the totals and the traffic; with
    memory snapshots, their host-memory rows after the GPU's totals (the per-node row is the node's whole
    snapshot memory, so no separate total)."""
    head = "| per rank | " + " | ".join(f"{r['mode']} C={r['classes']:,} N={r['world_size']}" for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    for key in results[0]["memory_bytes"]:
        lines.append(f"| {key} | " + " | ".join(human(r["memory_bytes"][key]) for r in results) + " |")
    lines.append("| **memory total** | " + " | ".join(f"**{human(r['memory_total'])}**" for r in results) + " |")
    lines.append("| **traffic / step** | " + " | ".join(f"**{human(r['traffic_total'])}**" for r in results) + " |")
    host = next((r["host_bytes"] for r in results if "host_bytes" in r), {})
    for key in host:
        lines.append(f"| host: {key} | " + " | ".join(human(r["host_bytes"][key]) if "host_bytes" in r else "-"
                                                      for r in results) + " |")
    return "\n".join(lines)


def add_arguments(p) -> None:
    """``hvd-partialfc estimate``'s arguments (cli.py makes the subcommand), beside the function they feed."""
    p.add_argument("--classes", type=lambda x: int(float(x)), required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    p.add_argument("--backbone", default="resnet18", help="registered backbone name (mlp, resnet, resnet18, "
                                                          "iresnet18..200, mobilefacenet)")
    p.add_argument("--in-shape", type=lambda x: [int(v) for v in x.split(",")], help="sample shape, e.g. 112,112,3")
    p.add_argument("--mode", action="append", help="a registered classifier mode (local, global, replicated); "
                                                   "repeatable; default all")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="classifier and logits storage")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "sgd-nomomentum", "adamw"])
    p.add_argument("--sample-rate", type=float, default=1.0, help="global, local: PartialFC's sampled fraction")
    from ..config import HeadConfig
    head = HeadConfig()                    # training's defaults, so an estimate means what a run does
    p.add_argument("--negatives-every", type=int, default=0,
                   help=f"also a row of local + cross-shard negatives every K steps (training's default: "
                        f"{head.negatives_every})")
    p.add_argument("--negatives-share", type=int, default=head.negatives_share,
                   help="centres each rank shares (0: its whole slice; default: training's head.negatives_share)")
    p.add_argument("--negatives-pool", type=int, default=head.negatives_pool,
                   help="at most this many centres shared by all ranks together (the share capped at ceil(pool / N); "
                        "0: no cap; default: training's head.negatives_pool)")
    p.add_argument("--memory-every", type=int, default=0, metavar="K",
                   help="host-memory rows for memory snapshots every K steps (checkpoint.memory_every; 0: none)")
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="ranks a node, for the snapshots' per-node host memory (with --memory-every)")
    p.add_argument("--json", action="store_true")
