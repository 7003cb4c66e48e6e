"""Scenarios run by the tests under real ``horovodrun`` (or alone, as one rank).

Each scenario writes ``OUT/rank-<r>.json`` with what it observed; the pytest side asserts on those.

    python scenarios.py core  SHARDS OUT STEPS      # identity, averaged update, no classifier leakage
    python scenarios.py np1   SHARDS OUT STEPS      # trainer == a plain single-process PyTorch loop
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc import comm as comm_lib  # noqa: E402
from hvd_partialfc.digest import state_dict_digest  # noqa: E402
from hvd_partialfc.config import load_config  # noqa: E402
from hvd_partialfc.data import RankShardDataset, EpochBatchSampler, prepare_batch  # noqa: E402
from hvd_partialfc.heads import LocalClassifier  # noqa: E402
from hvd_partialfc.models import create_model  # noqa: E402
from hvd_partialfc.train import Trainer, init_classifier_rows  # noqa: E402


def param_digest(module):
    return state_dict_digest(dict(module.named_parameters()))


def buffer_digest(module):
    return state_dict_digest(dict(module.named_buffers()))


def local_grads(trainer, batch, classifier=False):
    """Gradients of the backbone (and, with ``classifier``, of the classifier's weight, under the key
    ``"classifier"``) from this rank's batch alone: a copy of the model, no Horovod hooks."""
    bb, cls = copy.deepcopy(trainer.backbone), copy.deepcopy(trainer.classifier)
    bb.train(), cls.train()
    x, y = prepare_batch(*batch, trainer.device, trainer.manifest.kind)
    cls(bb(x), y).backward()
    out = {n: p.grad.detach().clone() for n, p in bb.named_parameters()}
    if classifier:
        out["classifier"] = cls.weight.grad.detach().clone()
    return out


def scenario_core(shards, out, steps):
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=8",
                             "model.name=resnet", "model.kwargs={width: 8}", "optim.schedule=constant",
                             "head.loss=arcface", "head.scale=16", "optim.backbone_lr=0.05",
                             "head.negatives_every=0"])   # the bare method's update (negatives: scenario_negatives)
    comm = comm_lib.init()
    trainer = Trainer(cfg, comm)
    rec = {"rank": comm.rank, "size": comm.size, "slice": [trainer.label_slice.start, trainer.label_slice.end],
           "classifier_shape": list(trainer.classifier.weight.shape)}
    if comm.rank == 0:  # rank 0's classifier must not move while rank 1 trains its own
        cfg.optim.classifier_lr = 0.0
    w0 = trainer.classifier.weight.detach().clone()
    batches = iter(trainer.loader)

    # Step 0: the applied backbone update equals the one from the mean of the ranks' local gradients.
    batch = next(batches)
    grads = local_grads(trainer, batch, classifier=True)
    g_cls = grads.pop("classifier")
    all_grads = comm.allgather_object({k: v.cpu() for k, v in grads.items()}, name="test.grads")
    p0 = {n: p.detach().clone() for n, p in trainer.backbone.named_parameters()}
    trainer.train_step(0, iter([batch]))
    o = cfg.optim
    worst = 0.0
    for n, p in trainer.backbone.named_parameters():
        mean_grad = sum(g[n] for g in all_grads) / len(all_grads)
        # SGD, first step: momentum buffer = grad (+ weight decay); lr factor 1 (constant schedule)
        expected = p0[n] - o.backbone_lr * (mean_grad + o.backbone_weight_decay * p0[n])
        worst = max(worst, float((p.detach() - expected).abs().max()))
    rec["update_max_abs_err"] = worst
    # ... and the classifier's: its local gradient over the global batch's mean (1/N of the local mean's)
    expected = w0 - o.classifier_lr * (g_cls / comm.size + o.classifier_weight_decay * w0)
    rec["classifier_update_max_abs_err"] = float((trainer.classifier.weight.detach() - expected).abs().max())
    rec["classifier_update_vs_local_mean"] = float((trainer.classifier.weight.detach() - (
        w0 - o.classifier_lr * (g_cls + o.classifier_weight_decay * w0))).abs().max())
    rec["local_grad_differs_from_mean"] = any(
        float((grads[n] - sum(g[n] for g in all_grads) / len(all_grads)).abs().max()) > 1e-6 for n in grads)

    rec["param_digests"] = [param_digest(trainer.backbone)]
    for step in range(1, steps):
        trainer.train_step(step, batches)
        rec["param_digests"].append(param_digest(trainer.backbone))
    rec["buffer_digest_before_averaging"] = buffer_digest(trainer.backbone)
    ckpt = trainer.save_checkpoint(steps)
    rec["full_digest_after_checkpoint"] = state_dict_digest(trainer.backbone.state_dict())
    rec["classifier_max_change"] = float((trainer.classifier.weight.detach() - w0).abs().max())
    rec["checkpoint"] = ckpt
    with open(os.path.join(out, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(rec, f)


def scenario_np1(shards, out, steps, k=1):
    """The trainer at np=1 against a plain loop over the same data, init and optimizers."""
    overrides = [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=16",
                 "model.name=mlp", "optim.schedule=constant", "head.loss=cosface", "head.scale=16",
                 "head.margin=0.2", "train.seed=3", "optim.clip_grad_norm=0.5",
                 f"optim.backward_passes_per_step={k}"]
    cfg = load_config(None, overrides)
    comm = comm_lib.init()
    trainer = Trainer(cfg, comm)
    batches = iter(trainer.loader)
    for step in range(steps):
        trainer.train_step(step, batches)

    # The plain single-process loop (no Horovod): same seeds, same batches, same optimizers.
    o = cfg.optim
    ds = RankShardDataset(shards, 0, 1)
    torch.manual_seed(cfg.train.seed)
    model = create_model("mlp", in_shape=ds.manifest.sample_shape, embedding_dim=cfg.model.embedding_dim)
    head = LocalClassifier(ds.label_slice.width, cfg.model.embedding_dim, "cosface", 16, 0.2)
    init_classifier_rows(head.weight, 0, cfg.train.seed)
    opt_m = torch.optim.SGD(model.parameters(), lr=o.backbone_lr, momentum=o.backbone_momentum,
                            weight_decay=o.backbone_weight_decay)
    opt_h = torch.optim.SGD(head.parameters(), lr=o.classifier_lr, momentum=o.classifier_momentum,
                            weight_decay=o.classifier_weight_decay)
    w_init = head.weight.detach().clone()
    sampler = iter(EpochBatchSampler(len(ds), 16, cfg.train.seed, 0))
    for _ in range(steps):
        opt_m.zero_grad(), opt_h.zero_grad()
        for _ in range(k):  # gradient accumulation: the mean over k batches
            x, y = ds[next(sampler)]
            (head(model(x.float()), y) / k).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the trainer clips the averaged backbone grad
        opt_m.step(), opt_h.step()
    err_bb = max(float((a - b).abs().max()) for a, b in zip(trainer.backbone.state_dict().values(),
                                                            model.state_dict().values()))
    err_cls = float((trainer.classifier.weight.detach() - head.weight.detach()).abs().max())
    moved = float((head.weight.detach() - w_init).abs().max())
    with open(os.path.join(out, "rank-0.json"), "w") as f:
        json.dump({"backbone_max_abs_err": err_bb, "classifier_max_abs_err": err_cls, "steps": steps,
                   "classifier_moved": moved}, f)


def scenario_nonfinite(shards, out, steps):
    """A NaN sample on rank 1 at step 2 with on_nonfinite=skip: no rank's parameters change in that step."""
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=8",
                             "model.name=mlp", "train.on_nonfinite=skip", "optim.schedule=constant"])
    comm = comm_lib.init()
    trainer = Trainer(cfg, comm)
    batches = iter(trainer.loader)
    rec = {"rank": comm.rank, "backbone": [], "classifier": []}
    for step in range(steps):
        batch = next(batches)
        if step == 2 and comm.rank == 1:
            batch[0][0, 0] = float("nan")  # one bad sample on one rank only
        trainer.train_step(step, iter([batch]))
        rec["backbone"].append(param_digest(trainer.backbone))
        rec["classifier"].append(param_digest(trainer.classifier))
    rec["skipped_steps"] = trainer.skipped_steps
    with open(os.path.join(out, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(rec, f)


def scenario_negatives(shards, out, steps, share=0):
    """Cross-shard negatives: the exchanged centres are the other ranks' (normalised) rows, frozen."""
    import torch.nn.functional as F
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=4",
                             "model.name=mlp", "optim.schedule=constant", "head.negatives_every=2",
                             f"head.negatives_share={share}", "head.scale=16", "head.margin=0.2"])
    comm = comm_lib.init()
    trainer = Trainer(cfg, comm)
    if comm.rank == 0:
        cfg.optim.classifier_lr = 0.0  # rank 0's classifier must stay put although it sees rank 1's centres
    head = trainer.classifier
    w0 = head.weight.detach().clone()
    batches = iter(trainer.loader)
    rec = {"rank": comm.rank, "width": head.width, "exchanges": []}
    for step in range(steps):
        if step % 2 == 0:
            everyone = comm.allgather_object(F.normalize(head.weight.detach().float(), dim=1), name=f"test.w{step}")
        trainer.train_step(step, batches)
        if step % 2 == 0:
            others = [w for r, w in enumerate(everyone) if r != comm.rank]
            if share == 0:
                rec["exchanges"].append(bool(torch.equal(head.remote, torch.cat(others))))
            else:  # a subset of each other rank's rows, each row one of theirs
                rec["exchanges"].append(all(any(torch.equal(row, o) for o in torch.cat(others)) for row in head.remote)
                                        and head.remote.shape[0] == sum(min(share, o.shape[0]) for o in others))
    rec["remote_rows"] = int(head.remote.shape[0])
    rec["remote_requires_grad"] = bool(head.remote.requires_grad)
    rec["remote_grad_is_none"] = head.remote.grad is None
    rec["classifier_max_change"] = float((head.weight.detach() - w0).abs().max())
    rec["digest"] = param_digest(trainer.backbone)
    rec["sent_bytes"] = comm.sent_bytes
    with open(os.path.join(out, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    name, shards, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    extra = [int(a) for a in sys.argv[5:]]
    os.makedirs(out, exist_ok=True)
    {"core": scenario_core, "np1": scenario_np1, "nonfinite": scenario_nonfinite,
     "negatives": scenario_negatives}[name](shards, out, steps, *extra)
