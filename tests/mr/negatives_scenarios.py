"""Scenarios for cross-shard negatives (``head.negatives_every``), run under real ``horovodrun``.

Each writes ``OUT/rank-<r>.json``; ``tests/test_negatives.py`` asserts on them (it runs ``scenario_all`` as an item
of tests/mr/np2_launch.py, beside other files' two-rank work). The references never read
the head's remote buffer for its values: the remote columns' rows come from their owners (gathered with
``allgather_object``), so the way the head stores and scores them is what is under test.

    python negatives_scenarios.py logits OUT                      # remote logits == their owner's, per loss
    python negatives_scenarios.py step   SHARDS OUT STEPS SHARE LOSS POOL   # exchange, update, uneven slices
    python negatives_scenarios.py all    SHARDS OUT STEPS SHARE:LOSS:POOL...  # logits (OUT/logits), then step
                                                          # for each case (OUT/step-SHARE-LOSS-POOL): one launch
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.engine import horovod as comm_lib  # noqa: E402
from hvd_partialfc.config_io import load_config  # noqa: E402
from hvd_partialfc.data.loader import prepare_batch  # noqa: E402
from hvd_partialfc.digest import state_dict_digest  # noqa: E402
from hvd_partialfc.classifier.margins import LocalClassifier  # noqa: E402
from hvd_partialfc.classifier.modes import get_mode  # noqa: E402
from hvd_partialfc.data.layout import RankLayout  # noqa: E402
from hvd_partialfc.data.partition import LabelSlice  # noqa: E402
from hvd_partialfc.run.parts import init_classifier_rows  # noqa: E402
from hvd_partialfc.run.startup import start_trainer  # noqa: E402

LOSSES = ("softmax", "cosface", "arcface")
SCALE, MARGIN = 16.0, 0.3


def _write(out, rank, rec):
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)


def owner_rows(remote, others):
    """For each remote column, the owner's raw row it stands for, and the owner's index of that row.

    ``others``: the other ranks' raw (W_o, D) weights in rank order, whose published rows the remote
    buffer holds in that order. A row is recognised by its direction (cosine ~1), whatever its scale, so
    this works for raw and for normalised buffers alike. Returns (rows (R, D), [(owner, row)], min cosine).
    """
    everything = torch.cat([w for _, w in others])                                  # (sum W_o, D)
    flat = [(o, j) for o, w in others for j in range(w.shape[0])]
    best = (F.normalize(remote.float(), dim=1) @ F.normalize(everything.float(), dim=1).t()).max(dim=1)
    return everything[best.indices], [flat[i] for i in best.indices.tolist()], float(best.values.min())


def _head(comm, loss, share, widths):
    cfg = load_config(None, ["data.shards=/unused", f"head.loss={loss}", f"head.scale={SCALE}",
                             f"head.margin={MARGIN}", "head.negatives_every=1", f"head.negatives_share={share}",
                             "model.embedding_dim=16", "train.seed=1"])
    start = sum(widths[:comm.rank])
    bounds = [sum(widths[:r]) for r in range(len(widths) + 1)]
    layout = RankLayout(bounds[-1], tuple(LabelSlice(r, bounds[r], bounds[r + 1]) for r in range(len(widths))),
                        tuple(() for _ in widths))
    head = get_mode("local").create_head(cfg, layout, comm.rank, comm)
    init_classifier_rows(head.weight, start, seed=1)
    with torch.no_grad():  # rows of different norms (as after training), so a row's scale matters
        g = torch.Generator().manual_seed(50 + comm.rank)
        head.weight.mul_(torch.rand(head.width, 1, generator=g) * 20 + 0.5)
    return head


def scenario_logits(out):
    """Each rank scores the same features against its remote columns, with its own loss; the owner of
    those classes scores the same features against its own rows. The two must agree, per column, and
    the fused forward (loss and gradients) must equal cross entropy over [own rows | owners' raw rows]."""
    comm = comm_lib.init()
    widths = [7 + 2 * r for r in range(comm.size)]      # uneven slices
    rec = {"rank": comm.rank, "cases": {}}
    for loss in LOSSES:
        for share in (0, 3):
            name = f"{loss}-share{share}"
            head = _head(comm, loss, share, widths)
            head.before_step(0)                                          # the exchange (a collective)
            x = torch.randn(6, 16, generator=torch.Generator().manual_seed(7)) * 3   # same features everywhere
            none = torch.full((6,), -1, dtype=torch.long)                # no targets: no margin anywhere
            own = LocalClassifier.logits(head, x, none).detach()         # (6, W): this rank's own scoring
            everyone = comm.allgather_object({"weight": head.weight.detach().clone(), "logits": own},
                                             name=f"test.{name}")
            others = [(o, e["weight"]) for o, e in enumerate(everyone) if o != comm.rank]
            raw, index, match = owner_rows(head.remote, others)
            # this rank's logits for its remote columns, scored with its own loss (scale included)
            scorer = LocalClassifier(head.remote.shape[0], 16, loss, SCALE, MARGIN)
            with torch.no_grad():
                scorer.weight.copy_(head.remote)
            mine = scorer.logits(x, none).detach()                       # (6, R)
            theirs = torch.stack([everyone[o]["logits"][:, j] for o, j in index], dim=1)   # (6, R)
            # the production forward against the reference: cross entropy over [own rows | owners' raw rows]
            y = torch.arange(6) % head.width
            xa = x.clone().requires_grad_(True)
            fused = head(xa, y)
            fused.backward()
            ref = LocalClassifier(head.width + raw.shape[0], 16, loss, SCALE, MARGIN)
            with torch.no_grad():
                ref.weight.copy_(torch.cat([head.weight.detach(), raw]))
            xb = x.clone().requires_grad_(True)
            ref_loss = F.cross_entropy(ref.logits(xb, y), y)
            ref_loss.backward()
            rec["cases"][name] = {
                "remote_rows": int(head.remote.shape[0]), "match_min_cos": match,
                "logit_err": float((mine - theirs).abs().max()), "logit_scale": float(theirs.abs().max()),
                "loss": float(fused), "ref_loss": float(ref_loss),
                "grad_x_err": float((xa.grad - xb.grad).abs().max()), "grad_x_scale": float(xb.grad.abs().max()),
                "grad_w_err": float((head.weight.grad - ref.weight.grad[:head.width]).abs().max()),
                "grad_w_scale": float(ref.weight.grad[:head.width].abs().max())}
    _write(out, comm.rank, rec)


def scenario_step(shards, out, steps, share, loss, pool):
    """Training with negatives every 2 steps: what each exchange delivered, and step 0's applied updates
    against the offline ones computed from the owners' raw rows (classifier: its own gradient / N)."""
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=4",
                             "model.name=mlp", "optim.schedule=constant", "head.negatives_every=2",
                             f"head.negatives_share={share}", f"head.negatives_pool={pool}",
                             f"head.loss={loss}", f"head.scale={SCALE}",
                             f"head.margin={MARGIN}", "optim.backbone_lr=0.05"])
    comm = comm_lib.init()
    trainer = start_trainer(cfg, comm)
    head = trainer.parts.head
    batches = iter(trainer.loader)
    rec = {"rank": comm.rank, "width": head.width, "exchanges": []}
    for step in range(steps):
        batch = next(batches)
        if step % 2 == 0:
            everyone = comm.allgather_object(head.weight.detach().clone(), name=f"test.w{step}")
            others = [(r, w) for r, w in enumerate(everyone) if r != comm.rank]
        if step == 0:
            bb, w0 = copy.deepcopy(trainer.parts.backbone), head.weight.detach().clone()
            p0 = {n: p.detach().clone() for n, p in trainer.parts.backbone.named_parameters()}
        trainer.train_step(step, iter([batch]))
        if step % 2 == 0:  # the buffer holds the other ranks' raw rows (all, or `share` of each, at most
            raw, index, match = owner_rows(head.remote, others)              # ceil(pool / N) of each)
            cap = -(-pool // comm.size) if pool else 10 ** 9
            rec["exchanges"].append(bool(torch.equal(head.remote, raw))
                                    and len(set(index)) == len(index) == sum(min(share or w.shape[0], w.shape[0], cap)
                                                                             for _, w in others))
        if step == 0:
            rec.update(_offline_update_errors(trainer, bb, w0, p0, raw, batch))
    rec["remote_rows"] = int(head.remote.shape[0])
    rec["remote_requires_grad"] = bool(head.remote.requires_grad)
    rec["remote_grad_is_none"] = head.remote.grad is None
    rec["remote_is_buffer"] = any(b is head.remote for b in head.buffers())
    rec["digest"] = state_dict_digest(dict(trainer.parts.backbone.named_parameters()))
    _write(out, comm.rank, rec)


def _offline_update_errors(trainer, bb, w0, p0, raw, batch):
    """Step 0 without the trainer: unfused cross entropy over [w0 | owners' raw rows], the backbone copy
    taken before the step. SGD's first step, constant lr: w1 = w0 - lr (g + wd w0), the classifier's
    g its own gradient / N (``optim.classifier_grad_mean=global``), the backbone's the mean over ranks."""
    comm, cfg, head = trainer.comm, trainer.cfg, trainer.parts.head
    o = cfg.optim
    ref = LocalClassifier(head.width + raw.shape[0], cfg.model.embedding_dim, cfg.head.loss, SCALE, MARGIN)
    with torch.no_grad():
        ref.weight.copy_(torch.cat([w0, raw]))
    bb.train()
    x, y = prepare_batch(*batch, trainer.step.device, trainer.manifest.kind)
    features = bb(x)
    F.cross_entropy(ref.logits(features, y), y).backward()
    g_cls = ref.weight.grad[:head.width]
    bare = LocalClassifier(head.width, cfg.model.embedding_dim, cfg.head.loss, SCALE, MARGIN)   # no negatives
    with torch.no_grad():
        bare.weight.copy_(w0)
    F.cross_entropy(bare.logits(features.detach(), y), y).backward()
    grads = comm.allgather_object({n: p.grad.detach().clone() for n, p in bb.named_parameters()}, name="test.g")
    worst = 0.0
    for n, p in trainer.parts.backbone.named_parameters():
        mean = sum(g[n] for g in grads) / len(grads)
        worst = max(worst, float((p.detach() - (p0[n] - o.backbone_lr * (mean + o.backbone_weight_decay * p0[n])))
                                 .abs().max()))
    expected = w0 - o.classifier_lr * (g_cls / comm.size + o.classifier_weight_decay * w0)
    applied = head.weight.detach()
    return {"update_max_abs_err": worst,
            "classifier_update_max_abs_err": float((applied - expected).abs().max()),
            "classifier_update_size": float((applied - w0).abs().max()),
            "classifier_update_vs_bare": float((applied - (w0 - o.classifier_lr * (
                bare.weight.grad / comm.size + o.classifier_weight_decay * w0))).abs().max())}


def scenario_all(shards, out, steps, cases):
    """``logits``, then ``step`` for each ``SHARE:LOSS:POOL`` case, one after another in this launch (each
    case builds its own trainer from the same seeds, as a launch of its own would)."""
    os.makedirs(os.path.join(out, "logits"), exist_ok=True)
    scenario_logits(os.path.join(out, "logits"))
    for case in cases:
        share, loss, pool = case.split(":")
        folder = os.path.join(out, f"step-{share}-{loss}-{pool}")
        os.makedirs(folder, exist_ok=True)
        scenario_step(shards, folder, steps, int(share), loss, int(pool))


if __name__ == "__main__":
    from hvd_partialfc.cli_support import freeze_at_exit
    freeze_at_exit()      # the exit skips the shutdown's collections over torch's objects (cli_support.py)
    name, args = sys.argv[1], sys.argv[2:]
    out = args[0] if name == "logits" else args[1]
    os.makedirs(out, exist_ok=True)
    if name == "all":
        scenario_all(args[0], args[1], int(args[2]), args[3:])
    elif name == "logits":
        scenario_logits(out)
    elif name == "step":
        scenario_step(args[0], args[1], int(args[2]), int(args[3]), args[4], int(args[5]))
    else:
        raise SystemExit(f"unknown scenario {name!r}")
