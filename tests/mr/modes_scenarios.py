"""Scenarios for the classifier modes (``head.mode``), run under real ``horovodrun`` (or alone, as one rank).

Each writes ``OUT/rank-<r>.json``; ``tests/test_modes.py`` asserts on them (it runs ``scenario_np2`` and
``scenario_np1`` as items of tests/mr/np2_launch.py, beside other files' work).

    python modes_scenarios.py gather OUT                      # allgather_with_grad's backward, even and uneven rows
    python modes_scenarios.py exact  SHARDS OUT MODE LOSS     # one train_step == full softmax on the union batch
    python modes_scenarios.py np1    SHARDS OUT STEPS         # local == global at np=1
    python modes_scenarios.py np2    SHARDS OUT MODE:LOSS...  # gather (OUT/gather), then exact for each case
                                                              # (OUT/exact-MODE-LOSS): one Horovod start-up
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
from hvd_partialfc.classifier.margins import LocalClassifier  # noqa: E402
from hvd_partialfc.run.parts import init_classifier_rows  # noqa: E402
from hvd_partialfc.run.startup import start_trainer  # noqa: E402


def _write(out, rank, rec):
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)


def scenario_gather(out):
    """Each rank's loss is <gathered, c_r>; the right gradient of the total loss for x_r is
    the sum over ranks of c_r's rows of r. hvd.allgather's own autograd gives the average instead."""
    comm = comm_lib.init()
    rec = {"rank": comm.rank}
    for case, rows in (("even", [3] * comm.size), ("uneven", [2 + r for r in range(comm.size)])):
        total, dim = sum(rows), 4
        x = torch.randn(rows[comm.rank], dim, generator=torch.Generator().manual_seed(10 + comm.rank),
                        requires_grad=True)
        coeffs = [torch.randn(total, dim, generator=torch.Generator().manual_seed(100 + r)) for r in range(comm.size)]
        start = sum(rows[:comm.rank])
        expected = sum(c[start:start + rows[comm.rank]] for c in coeffs)
        gathered = comm.allgather_with_grad(x, f"test.{case}", grad_scale=1.0)
        everyone = comm.allgather_tensor(x.detach(), f"test.{case}.x")
        (gathered * coeffs[comm.rank]).sum().backward()
        rec[case] = {"forward_err": float((gathered.detach() - everyone).abs().max()),
                     "grad_err": float((x.grad - expected).abs().max()),
                     "grad_norm": float(expected.norm())}
        x.grad = None
        scaled = comm.allgather_with_grad(x, f"test.{case}.scaled", grad_scale=comm.size)
        (scaled * coeffs[comm.rank]).sum().backward()
        rec[case]["scaled_grad_err"] = float((x.grad - comm.size * expected).abs().max())
    import horovod.torch as hvd  # only to show why ours exists: Horovod's own backward averages
    x = torch.ones(3, 2, requires_grad=True)
    (hvd.allgather(x, name="test.hvd") * 1.0).sum().backward()
    rec["hvd_allgather_grad"] = float(x.grad[0, 0])   # the right value is comm.size
    rec["sent_bytes"] = comm.sent_bytes
    _write(out, comm.rank, rec)


def _config(shards, out, mode, loss, steps=1, extra=()):
    return load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=8",
                              "model.name=mlp", "optim.schedule=constant", f"head.loss={loss}", "head.scale=16",
                              "head.margin=0.3", f"head.mode={mode}", "train.seed=5", "optim.backbone_lr=0.05",
                              *extra])


def scenario_exact(shards, out, mode, loss):
    """One train_step in `mode` against a single process computing the full softmax on the union batch."""
    cfg = _config(shards, out, mode, loss)
    comm = comm_lib.init()
    trainer = start_trainer(cfg, comm)
    batch = next(iter(trainer.loader))
    bb = copy.deepcopy(trainer.parts.backbone)
    bb.train()
    out_step = trainer.train_step(0, iter([batch]))

    # The reference: one process, the full C x D classifier, every rank's batch. The backbone runs once
    # per rank batch (BatchNorm statistics are per batch, as in the distributed run).
    batches = comm.allgather_object(batch, name="test.batches")
    starts = comm.allgather_object(trainer.label_slice.start, name="test.starts")
    num_classes = trainer.manifest.num_classes
    feats, labels = [], []
    for (x, y), start in zip(batches, starts):
        x, y = prepare_batch(x, y, trainer.step.device, trainer.manifest.kind)
        feats.append(bb(x))
        labels.append(y + start)
    full = LocalClassifier(num_classes, cfg.model.embedding_dim, loss, 16, 0.3)
    init_classifier_rows(full.weight, 0, cfg.train.seed)
    glob = torch.cat(labels)
    ref_loss = F.cross_entropy(full.logits(torch.cat(feats), glob), glob)
    ref_loss.backward()

    s, e = trainer.label_slice.start, trainer.label_slice.end
    cls_grad = trainer.parts.head.weight.grad
    ref_cls = full.weight.grad if mode == "replicated" else full.weight.grad[s:e]
    mean_loss = comm.allreduce_scalar(out_step["loss"], "average", name="test.loss")
    rec = {"rank": comm.rank, "mode": mode, "loss": out_step["loss"], "mean_loss": mean_loss,
           "ref_loss": float(ref_loss), "classifier_shape": list(trainer.parts.head.weight.shape),
           "backbone_grad_err": max(float((p.grad - q.grad).abs().max())
                                    for p, q in zip(trainer.parts.backbone.parameters(), bb.parameters())),
           "backbone_grad_scale": max(float(q.grad.abs().max()) for q in bb.parameters()),
           "classifier_grad_err": float((cls_grad - ref_cls).abs().max()),
           "classifier_grad_scale": float(ref_cls.abs().max()),
           "lrs": [g["lr"] for opt in (trainer.parts.backbone_opt, trainer.parts.head_opt) for g in opt.param_groups]}
    _write(out, comm.rank, rec)


def scenario_np1(shards, out, steps):
    """`local` and `global` trained side by side at np=1: the same numbers (allclose)."""
    comm = comm_lib.init()
    states = {}
    for mode in ("local", "global"):
        trainer = start_trainer(_config(shards, os.path.join(out, mode), mode, "arcface", steps), comm)
        batches = iter(trainer.loader)
        losses = [trainer.train_step(step, batches)["loss"] for step in range(steps)]
        states[mode] = (trainer.parts.backbone.state_dict(), trainer.parts.head.weight.detach().clone(), losses)
    (bl, cl, ll), (bg, cg, lg) = states["local"], states["global"]
    rec = {"backbone_max_abs_err": max(float((bl[k].float() - bg[k].float()).abs().max()) for k in bl),
           "classifier_max_abs_err": float((cl - cg).abs().max()),
           "loss_max_abs_err": max(abs(a - b) for a, b in zip(ll, lg)), "losses": ll}
    _write(out, comm.rank, rec)


def scenario_np2(shards, out, cases):
    """``gather``, then ``exact`` for each ``MODE:LOSS`` case, one after another in this launch (each case
    builds its own trainer from the same seeds, as a launch of its own would)."""
    folder = os.path.join(out, "gather")
    os.makedirs(folder, exist_ok=True)
    scenario_gather(folder)
    for case in cases:
        mode, loss = case.split(":")
        folder = os.path.join(out, f"exact-{mode}-{loss}")
        os.makedirs(folder, exist_ok=True)
        scenario_exact(shards, folder, mode, loss)


if __name__ == "__main__":
    from hvd_partialfc.cli_support import freeze_at_exit
    freeze_at_exit()      # the exit skips the shutdown's collections over torch's objects (cli_support.py)
    name, args = sys.argv[1], sys.argv[2:]
    out = args[0] if name == "gather" else args[1]
    os.makedirs(out, exist_ok=True)
    if name == "np2":
        scenario_np2(args[0], args[1], args[2:])
    elif name == "gather":
        scenario_gather(out)
    elif name == "exact":
        scenario_exact(args[0], args[1], args[2], args[3])
    elif name == "np1":
        scenario_np1(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown scenario {name!r}")
