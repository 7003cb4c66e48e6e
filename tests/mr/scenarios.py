"""Scenarios run by the tests under real ``horovodrun`` (or alone, as one rank).

Each scenario writes ``OUT/rank-<r>.json`` with what it observed; the pytest side asserts on those.

    python scenarios.py core  SHARDS OUT STEPS      # identical starts, averaged update, no classifier leakage,
                                                    # pooled BatchNorm statistics
    python scenarios.py np1   SHARDS OUT STEPS K... # trainer == a plain single-process PyTorch loop, for each
                                                    # backward_passes_per_step K (OUT/k<K>/rank-0.json)

tests/test_train_multirank.py runs them as items of tests/mr/np2_launch.py (``scenarios.scenario_core`` in a
launch beside other two-rank work, ``scenarios.scenario_np1`` in one process beside other one-rank work).
"""
from __future__ import annotations

import copy
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.engine import horovod as comm_lib  # noqa: E402
from hvd_partialfc.run import parts as parts_lib  # noqa: E402
from hvd_partialfc.digest import state_dict_digest  # noqa: E402
from hvd_partialfc.config_io import load_config  # noqa: E402
from hvd_partialfc.data.loader import RankShardDataset, EpochBatchSampler, prepare_batch  # noqa: E402
from hvd_partialfc.classifier.margins import LocalClassifier  # noqa: E402
from hvd_partialfc.models import create_model  # noqa: E402
from hvd_partialfc.run.parts import init_classifier_rows  # noqa: E402
from hvd_partialfc.run.startup import start_trainer  # noqa: E402


def param_digest(module):
    return state_dict_digest(dict(module.named_parameters()))


def buffer_digest(module):
    return state_dict_digest(dict(module.named_buffers()))


def local_grads(trainer, batch, classifier=False):
    """Gradients of the backbone (and, with ``classifier``, of the classifier's weight, under the key
    ``"classifier"``) from this rank's batch alone: a copy of the model, no Horovod hooks."""
    bb, cls = copy.deepcopy(trainer.parts.backbone), copy.deepcopy(trainer.parts.head)
    bb.train(), cls.train()
    x, y = prepare_batch(*batch, trainer.step.device, trainer.manifest.kind)
    cls(bb(x), y).backward()
    out = {n: p.grad.detach().clone() for n, p in bb.named_parameters()}
    if classifier:
        out["classifier"] = cls.weight.grad.detach().clone()
    return out


def _perturbed_create_model(rank, record):
    """``create_model`` whose backbone starts *rank-dependent*: noise on every parameter and buffer
    (BatchNorm running mean, variance and count included). The trainer seeds every rank alike, so without
    this the ranks would start equal with or without the broadcast. Records the pre-broadcast digest."""
    def create(*args, **kwargs):
        model = create_model(*args, **kwargs)
        g = torch.Generator().manual_seed(1_000 + rank)
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
            for name, b in model.named_buffers():
                if name.endswith("running_var"):
                    b.mul_(1 + 0.5 * torch.rand(b.shape, generator=g))       # stays positive
                elif b.is_floating_point():
                    b.add_(0.1 * torch.randn(b.shape, generator=g))
                else:
                    b.add_(rank + 1)                                          # num_batches_tracked
        record["init_digest_before_broadcast"] = state_dict_digest(model.state_dict())
        record["init_buffer_digest_before_broadcast"] = buffer_digest(model)
        return model
    return create


def _bn_stats(module):
    """{layer name: (running_mean, running_var)} of every BatchNorm layer that tracks statistics."""
    return {n: (m.running_mean.detach().clone().cpu(), m.running_var.detach().clone().cpu())
            for n, m in module.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats}


def _sgd_direction(buf, grad, param, momentum, weight_decay):
    """torch.optim.SGD's step direction (no dampening, no Nesterov): d = g + wd p; buf = d at the first
    step, momentum buf + d afterwards. The step is ``param - lr * buf``."""
    d = grad + weight_decay * param
    return d if buf is None else momentum * buf + d


def scenario_core(shards, out, steps):
    """Identical starts (ranks built *different*, then broadcast), the averaged backbone update and the
    local classifier update over two momentum steps (both ranks training), BatchNorm pooling."""
    cfg = load_config(None, [f"data.shards={shards}", f"out={out}", f"train.steps={steps}", "data.batch_size=8",
                             "model.name=resnet", "model.kwargs={width: 8}", "optim.schedule=constant",
                             "head.loss=arcface", "head.scale=16", "optim.backbone_lr=0.05",
                             "head.negatives_every=0"])   # the bare method's update (negatives: negatives_scenarios.py)
    comm = comm_lib.init()
    rec = {"rank": comm.rank, "size": comm.size}
    with mock.patch.object(parts_lib, "create_model", _perturbed_create_model(comm.rank, rec)):
        trainer = start_trainer(cfg, comm)
    rec["init_digest_after_broadcast"] = state_dict_digest(trainer.parts.backbone.state_dict())
    rec.update({"slice": [trainer.label_slice.start, trainer.label_slice.end],
                "classifier_shape": list(trainer.parts.head.weight.shape)})
    w_init = trainer.parts.head.weight.detach().clone()
    # the classifier starts from its own rows of the global init (never broadcast from another rank)
    ref = torch.empty_like(w_init)
    init_classifier_rows(ref, trainer.label_slice.start, cfg.train.seed)
    rec["classifier_init_max_abs_err"] = float((w_init - ref).abs().max())
    batches = iter(trainer.loader)

    # Steps 0 and 1, both ranks training with the same lr (constant schedule: factor 1), SGD with momentum
    # and weight decay: the applied updates against offline ones. Backbone: from the mean of the ranks'
    # local gradients. Classifier: from this rank's own gradient alone, over the global batch's mean
    # (1/N of the local mean's), and never from another rank's (whose batch holds other classes).
    o, n_ranks = cfg.optim, comm.size
    buf_bb, buf_cls = {}, None
    for key in ("update_max_abs_err", "classifier_update_max_abs_err", "classifier_step_change", "param_digests",
                "batch_labels"):
        rec[key] = []
    for step in range(2):
        batch = next(batches)
        rec["batch_labels"].append((batch[1] + trainer.label_slice.start).tolist())  # global labels
        grads = local_grads(trainer, batch, classifier=True)
        g_cls = grads.pop("classifier")
        all_grads = comm.allgather_object({k: v.cpu() for k, v in grads.items()}, name=f"test.grads.{step}")
        all_cls = comm.allgather_object(g_cls.cpu(), name=f"test.cls_grads.{step}")
        p_old = {n: p.detach().clone() for n, p in trainer.parts.backbone.named_parameters()}
        w_old = trainer.parts.head.weight.detach().clone()
        trainer.train_step(step, iter([batch]))
        rec["param_digests"].append(param_digest(trainer.parts.backbone))
        worst = 0.0
        for n, p in trainer.parts.backbone.named_parameters():
            mean_grad = sum(g[n] for g in all_grads) / n_ranks
            buf_bb[n] = _sgd_direction(buf_bb.get(n), mean_grad, p_old[n], o.backbone_momentum,
                                       o.backbone_weight_decay)
            worst = max(worst, float((p.detach() - (p_old[n] - o.backbone_lr * buf_bb[n])).abs().max()))
        rec["update_max_abs_err"].append(worst)
        w = trainer.parts.head.weight.detach()
        if step == 0:
            # What the alternatives would have applied: how far apart they are sets what the checks can see.
            rec["local_grad_differs_from_mean"] = any(
                float((grads[n] - sum(g[n] for g in all_grads) / n_ranks).abs().max()) > 1e-6 for n in grads)
            leaked = sum(all_cls) / n_ranks  # the classifier gradient averaged like the backbone's
            rec["classifier_update_vs_averaged_grad"] = float((w - (
                w_old - o.classifier_lr * (leaked / n_ranks + o.classifier_weight_decay * w_old))).abs().max())
            rec["classifier_update_vs_local_mean"] = float((w - (
                w_old - o.classifier_lr * (g_cls + o.classifier_weight_decay * w_old))).abs().max())
        buf_cls = _sgd_direction(buf_cls, g_cls / n_ranks, w_old, o.classifier_momentum, o.classifier_weight_decay)
        rec["classifier_update_max_abs_err"].append(float((w - (w_old - o.classifier_lr * buf_cls)).abs().max()))
        rec["classifier_step_change"].append(float((w - w_old).abs().max()))

    for step in range(2, steps):
        trainer.train_step(step, batches)
        rec["param_digests"].append(param_digest(trainer.parts.backbone))
    rec["buffer_digest_before_averaging"] = buffer_digest(trainer.parts.backbone)
    # BatchNorm: every rank's running statistics before the checkpoint averages them; the pooled
    # statistics of the union (equal counts per rank) computed here from them, in float64.
    everyone = comm.allgather_object(_bn_stats(trainer.parts.backbone), name="test.bn")
    ckpt = trainer.save_checkpoint(steps)    # unscheduled: the file gets the pooled statistics, the rank its own
    rec["live_buffers_kept"] = buffer_digest(trainer.parts.backbone) == rec["buffer_digest_before_averaging"]
    saved = copy.deepcopy(trainer.parts.backbone)
    saved.load_state_dict(torch.load(os.path.join(ckpt, "backbone.pt"), weights_only=True)["state_dict"])
    rec["full_digest_after_checkpoint"] = state_dict_digest(saved.state_dict())
    after = _bn_stats(saved)
    rec["bn_layers"] = len(after)
    rec["bn_pooled_max_err"] = rec["bn_rank0_vs_pooled"] = rec["bn_mean_of_vars_vs_pooled"] = 0.0
    for name, (mean_after, var_after) in after.items():
        means = torch.stack([e[name][0] for e in everyone]).double()     # (N, C)
        variances = torch.stack([e[name][1] for e in everyone]).double()  # (N, C)
        mean = means.mean(0)
        var = variances.mean(0) + (means * means).mean(0) - mean * mean   # law of total variance
        rel = lambda a, b: float(((a.double() - b).abs() / b.abs().clamp_min(1.0)).max())  # noqa: E731
        rec["bn_pooled_max_err"] = max(rec["bn_pooled_max_err"], rel(mean_after, mean), rel(var_after, var))
        rec["bn_rank0_vs_pooled"] = max(rec["bn_rank0_vs_pooled"], rel(everyone[0][name][0], mean),
                                        rel(everyone[0][name][1], var))
        rec["bn_mean_of_vars_vs_pooled"] = max(rec["bn_mean_of_vars_vs_pooled"], rel(variances.mean(0), var))
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
    trainer = start_trainer(cfg, comm)
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
    err_bb = max(float((a - b).abs().max()) for a, b in zip(trainer.parts.backbone.state_dict().values(),
                                                            model.state_dict().values()))
    err_cls = float((trainer.parts.head.weight.detach() - head.weight.detach()).abs().max())
    moved = float((head.weight.detach() - w_init).abs().max())
    with open(os.path.join(out, "rank-0.json"), "w") as f:
        json.dump({"backbone_max_abs_err": err_bb, "classifier_max_abs_err": err_cls, "steps": steps,
                   "classifier_moved": moved}, f)


if __name__ == "__main__":
    from hvd_partialfc.cli_support import freeze_at_exit
    freeze_at_exit()      # the exit skips the shutdown's collections over torch's objects (cli_support.py)
    name, shards, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    extra = [int(a) for a in sys.argv[5:]]
    if name == "np1":   # one process (one Horovod start-up) for every K asked for
        for k in extra or [1]:
            os.makedirs(os.path.join(out, f"k{k}"), exist_ok=True)
            scenario_np1(shards, os.path.join(out, f"k{k}"), steps, k)
        sys.exit(0)
    os.makedirs(out, exist_ok=True)
    {"core": scenario_core}[name](shards, out, steps, *extra)
