"""Classifier modes (`head.mode`): `global` and `replicated` are exact, `local` == `global` at np=1.

Multi-rank claims run under real horovodrun (Gloo); the sampling and config checks are unit tests with a
one-rank fake of ``Comm`` (identity collectives).
"""
import json
import math
import os
import pathlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import helpers_np2
from conftest import require_horovod
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.classifier.margins import LocalClassifier, margin_cross_entropy
from hvd_partialfc.classifier.modes import CrossShardNegativesHead, GlobalSoftmaxHead, LocalHead
from hvd_partialfc.classifier.rowsparse import sample_rows


def _ranks(out, n):
    return [json.load(open(os.path.join(out, f"rank-{r}.json"))) for r in range(n)]


EXACT = [("global", "arcface"), ("global", "softmax"), ("replicated", "cosface")]


def _np2_items(request, folder):
    """The module's two-rank scenarios, one item of the shared launch (tests/helpers_np2.py): ``gather``, then
    ``exact`` for each case of EXACT (each builds its own trainer from the same seeds, as a launch of its own
    would)."""
    return [{"scenario": "np2", "call": "modes_scenarios.scenario_np2",
             "args": [request.getfixturevalue("feature_shards"), folder("np2"), [f"{m}:{l}" for m, l in EXACT]]}]


NP2_PART = helpers_np2.Part("modes", fixture="np2", build=_np2_items, timeout=180)


@pytest.fixture(scope="module")
def np2(request):
    """The folder of the module's scenarios, run under ``horovodrun -np 2`` (Gloo) in the launch that
    tests/helpers_np2.py shares with the other files' two-rank work."""
    return pathlib.Path(helpers_np2.shared(request).done("np2"))


@pytest.mark.multirank
def test_allgather_backward_sums_over_ranks(np2):
    """allgather_with_grad's backward sums the gathered rows' gradients over ranks (Horovod's own averages),
    with even and uneven row counts, and scales them by ``grad_scale``."""
    for r in _ranks(np2 / "gather", 2):
        for case in ("even", "uneven"):
            assert r[case]["forward_err"] == 0.0
            assert r[case]["grad_err"] < 1e-5 and r[case]["grad_norm"] > 1.0
            assert r[case]["scaled_grad_err"] < 1e-5
        assert r["hvd_allgather_grad"] == pytest.approx(1.0)   # Horovod's averages: 1, the sum is 2
        assert r["sent_bytes"] > 0


@pytest.mark.multirank
@pytest.mark.parametrize("mode,loss", EXACT)
def test_np2_mode_equals_full_softmax_on_union_batch(np2, mode, loss):
    """One train_step at np=2 in ``mode`` == one process computing the full softmax on the union batch:
    the loss, the backbone's and this rank's classifier gradients; each optimizer's lr is its own."""
    for r in _ranks(np2 / f"exact-{mode}-{loss}", 2):
        assert r["mode"] == mode
        assert r["classifier_shape"] == [40 if mode == "replicated" else 20, 128]
        assert r["mean_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        if mode == "global":   # the loss itself is global: the same number on every rank
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["backbone_grad_err"] < 1e-5 * max(1.0, r["backbone_grad_scale"])
        assert r["classifier_grad_err"] < 1e-5 * max(1.0, r["classifier_grad_scale"])
        # the classifier follows optim.classifier_lr whichever optimizer owns it (backbone_lr is 0.05)
        assert r["lrs"] == pytest.approx([0.05, 0.1])


def _np1_items(request, folder):
    """``local`` and ``global`` side by side at np=1 (4 steps), an item of the one-rank process that
    tests/helpers_np2.py shares with other files' one-rank work (Horovod alone: size 1, no launcher)."""
    return [{"scenario": "np1", "call": "modes_scenarios.scenario_np1",
             "args": [request.getfixturevalue("feature_shards"), folder("np1"), 4]}]


NP1_PART = helpers_np2.Part("modes", fixture="np1", build=_np1_items, timeout=180, np=1)


@pytest.fixture(scope="module")
def np1(request):
    require_horovod()
    return helpers_np2.shared(request, np=1).done("np1")


@pytest.mark.multirank
def test_np1_local_equals_global(np1):
    """At np=1 ``local`` and ``global`` train to the same numbers (one process, Horovod alone: size 1, no
    launcher needed)."""
    r = _ranks(np1, 1)[0]
    assert r["backbone_max_abs_err"] < 1e-5 and r["classifier_max_abs_err"] < 1e-5
    assert r["loss_max_abs_err"] < 1e-5


class OneRank:
    """Comm at world size 1: every collective is the identity (what Horovod does with one rank)."""
    rank, size, sent_bytes, wait_s = 0, 1, 0, 0.0

    def allgather_with_grad(self, t, name, grad_scale=1.0):
        return t

    def allgather_tensor(self, t, name):
        return t.clone()

    def allreduce_tensor(self, t, op, name):
        return t.clone()


@pytest.mark.parametrize("loss", ["softmax", "cosface", "arcface"])
@pytest.mark.parametrize("comm", [None, OneRank()])
def test_fused_margin_cross_entropy_equals_unfused(loss, comm):
    # the fused head (one (M, W) buffer) against F.cross_entropy of the margin logits, values and gradients
    torch.manual_seed(0)
    head = LocalClassifier(30, 8, loss, scale=16.0, margin=0.4)
    x = torch.randn(6, 8, requires_grad=True)
    labels = torch.tensor([0, 3, 29, 1, 1, 5])
    ours = margin_cross_entropy(x, head.weight, labels, head.margin, comm)
    g_ours = torch.autograd.grad(ours, [x, head.weight])
    ref = F.cross_entropy(head.logits(x, labels), labels)
    g_ref = torch.autograd.grad(ref, [x, head.weight])
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss", ["cosface", "arcface"])
def test_interclass_filter_is_arcface_torchs_rule(loss):
    """head.interclass_filter: against an independent computation of arcface_torch's rule (a non-target cosine
    above the threshold times 0, by a mask without gradient; every column of a row whose class is elsewhere),
    the fused loss and the gradients of features and rows, with frozen columns (cross-shard negatives) and a
    row of another rank; the reference path (``logits``) too."""
    torch.manual_seed(1)
    head = LocalClassifier(30, 8, loss, scale=16.0, margin=0.4, interclass=0.3)
    x = torch.randn(6, 8, requires_grad=True)
    frozen = torch.randn(5, 8)
    labels = torch.tensor([0, 3, 29, -1, 1, 5])
    ours = margin_cross_entropy(x, head.weight, labels, head.margin, OneRank(), frozen=frozen)
    g_ours = torch.autograd.grad(ours, [x, head.weight])

    cos = F.normalize(x) @ F.normalize(torch.cat([head.weight, frozen])).t()
    with torch.no_grad():
        dirty = cos > 0.3
        for r, y in enumerate(labels.tolist()):
            if y >= 0:
                dirty[r, y] = False
    assert 4 < int(dirty.sum()) < dirty.numel() // 2          # the threshold filters some, not most
    cos_f = cos * (~dirty).float()
    rows = []
    for r, y in enumerate(labels.tolist()):
        logits = 16.0 * cos_f[r]
        if y < 0:
            rows.append(torch.logsumexp(logits, 0))
            continue
        c = cos_f[r, y]
        if loss == "cosface":
            t = c - 0.4
        else:
            t = torch.where(c > math.cos(math.pi - 0.4), torch.cos(torch.acos(c.clamp(-1 + 1e-7, 1 - 1e-7)) + 0.4),
                            c - math.sin(math.pi - 0.4) * 0.4)
        logits = torch.cat([logits[:y], (16.0 * t).view(1), logits[y + 1:]])
        rows.append(torch.logsumexp(logits, 0) - 16.0 * t)
    ref = torch.stack(rows).mean()
    g_ref = torch.autograd.grad(ref, [x, head.weight])
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    for a, b in zip(g_ours, g_ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    unfiltered = LocalClassifier(30, 8, loss, scale=16.0, margin=0.4)
    unfiltered.weight.data.copy_(head.weight.data)
    plain = margin_cross_entropy(x, unfiltered.weight, labels, unfiltered.margin, OneRank(), frozen=frozen)
    assert abs(float(plain.detach()) - float(ours.detach())) > 1e-3     # the filter changes the loss
    # the unfused reference (LocalClassifier.logits: MarginLoss.forward filters too), local labels
    local = labels.clamp_min(0)
    fused = margin_cross_entropy(x, head.weight, local, head.margin)
    unfused = F.cross_entropy(head.logits(x, local), local)
    assert float(fused.detach()) == pytest.approx(float(unfused.detach()), rel=1e-5)
    for a, b in zip(torch.autograd.grad(fused, [x, head.weight]), torch.autograd.grad(unfused, [x, head.weight])):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="reads cosines"):
        LocalClassifier(30, 8, "softmax", interclass=0.3)
    for bad in (["head.loss=softmax", "head.interclass_filter=0.3"], ["head.interclass_filter=1.5"]):
        with pytest.raises(ConfigError, match="head.interclass_filter"):
            load_config(None, ["data.shards=x", *bad])


def test_fused_rows_of_other_ranks_get_no_target():
    # label -1: the row's class is on another rank; with one rank it is a row without a target
    torch.manual_seed(0)
    head = LocalClassifier(10, 4, "cosface", scale=8.0, margin=0.2)
    x, labels = torch.randn(3, 4), torch.tensor([2, -1, 7])
    lse = torch.logsumexp(head.logits(x, labels), dim=1)
    ours = margin_cross_entropy(x, head.weight, labels, head.margin, OneRank())
    tgt = head.logits(x, labels)
    ref = (lse[0] - tgt[0, 2] + lse[1] + lse[2] - tgt[2, 7]) / 3
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)


def test_sampling_keeps_positives_and_rate_of_rows():
    torch.manual_seed(0)
    head = GlobalSoftmaxHead(100, 8, label_start=0, comm=OneRank(), sample_rate=0.2, loss="cosface",
                             scale=16.0, margin=0.2)
    labels = torch.tensor([3, 3, 50, 99, 7, 64])
    loss = head(torch.randn(6, 8), labels)
    loss.backward()
    touched = (head.weight.grad.abs().sum(1) > 0).nonzero().flatten().tolist()
    assert len(touched) == 20                       # 0.2 x 100 centres, positives included
    assert set(labels.tolist()) <= set(touched)


def test_sampled_loss_is_softmax_over_kept_rows():
    torch.manual_seed(1)
    head = GlobalSoftmaxHead(50, 8, label_start=0, comm=OneRank(), sample_rate=0.3, loss="softmax")
    x, labels = torch.randn(5, 8), torch.tensor([1, 2, 40, 41, 2])
    torch.manual_seed(7)
    loss = head(x, labels)
    torch.manual_seed(7)
    weight, local = head._sample(labels)
    assert float(loss.detach()) == pytest.approx(float(F.cross_entropy(x @ weight.t(), local).detach()), rel=1e-5)


def _local_parts_and_step(cfg, classes):
    """One rank's parts and step on the no-communication engine, for ``classes`` classes (no shards)."""
    from hvd_partialfc.data.layout import RankLayout
    from hvd_partialfc.engine.local import LocalComm
    from hvd_partialfc.run.parts import build_parts
    from hvd_partialfc.run.step import Step
    comm, cpu = LocalComm(), torch.device("cpu")
    parts = build_parts(cfg, comm, RankLayout.even(classes, 1), [32], cpu)
    return parts, Step(cfg, comm, parts, cpu, "features", 2)


def test_mode_config_is_validated():
    # plain data at load time; the mode is looked up and checked when the parts are built
    from hvd_partialfc.classifier.modes import get_mode
    with pytest.raises(ConfigError, match="sample_rate"):
        load_config(None, ["data.shards=x", "head.sample_rate=0"])
    with pytest.raises(ValueError, match="head.mode='ring'; known: local, global, replicated"):
        get_mode(load_config(None, ["data.shards=x", "head.mode=ring"]).head.mode)
    cfg = load_config(None, ["data.shards=x", "head.mode=replicated", "head.sample_rate=0.5"])
    with pytest.raises(ValueError, match="not replicated"):
        get_mode("replicated").check(cfg.head)
    for mode in ("global", "local"):
        assert load_config(None, ["data.shards=x", f"head.mode={mode}", "head.sample_rate=0.1"]).head.mode == mode


@pytest.mark.parametrize("negatives", [False, True])
def test_local_sample_rate_one_is_the_unsampled_head_bitwise(negatives):
    # r = 1 draws nothing from the global stream and gives today's loss and dense gradient, bit for bit
    torch.manual_seed(0)
    kw = dict(loss="arcface", scale=16.0, margin=0.4)
    head = (CrossShardNegativesHead(30, 8, 0, OneRank(), every=1, share=0, slice_widths=[30], sample_rate=1.0, **kw)
            if negatives else LocalHead(30, 8, 1.0, **kw))
    if negatives:
        head.remote = torch.randn(7, 8)
    x, labels = torch.randn(6, 8), torch.tensor([0, 3, 29, 1, 1, 5])
    rng = torch.get_rng_state()
    loss = head(x, labels)
    loss.backward()
    assert torch.equal(torch.get_rng_state(), rng)
    w = head.weight.detach().clone().requires_grad_(True)
    ref = margin_cross_entropy(x, w, labels, head.margin, frozen=head.remote if negatives else None)
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    assert not head.weight.grad.is_sparse and torch.equal(head.weight.grad, w.grad)


@pytest.mark.parametrize("labels,rows", [([3, 3, 50, 99, 7, 64], 20), (list(range(0, 100, 4)), 25)])
def test_local_sampling_keeps_positives_and_rate_and_grads_only_sampled_rows(labels, rows):
    # 0.2 x 100 rows scored, every positive among them (25 positives > 20: all of them, nothing else);
    # the gradient is row-sparse: exactly the sampled rows, none other
    torch.manual_seed(0)
    head = LocalHead(100, 8, 0.2, loss="cosface", scale=16.0, margin=0.2)
    labels = torch.tensor(labels)
    head(torch.randn(len(labels), 8), labels).backward()
    g = head.weight.grad
    assert g.is_sparse and g.shape == (100, 8)
    g = g.coalesce()
    touched = g._indices()[0].tolist()
    assert len(touched) == len(set(touched)) == rows
    assert set(labels.tolist()) <= set(touched)
    assert (g._values().abs().sum(1) > 0).all()        # every sampled row is in the softmax


def test_local_sampled_loss_is_softmax_over_kept_rows_beside_all_frozen_columns():
    # cross-shard negatives beside sampling: own rows sampled, all R remote columns scored (never sampled)
    torch.manual_seed(1)
    head = CrossShardNegativesHead(50, 8, 0, OneRank(), every=1, share=0, slice_widths=[50], sample_rate=0.3,
                                   loss="softmax")
    head.remote = torch.randn(9, 8)
    x, labels = torch.randn(5, 8), torch.tensor([1, 2, 40, 41, 2])
    torch.manual_seed(7)
    loss = head(x, labels)
    torch.manual_seed(7)
    index, local = sample_rows(labels, 50, 0.3, "cpu")
    assert index.numel() == 15
    ref = F.cross_entropy(x @ torch.cat([head.weight[index], head.remote]).t(), local)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)


@pytest.mark.parametrize("loss", ["softmax", "cosface", "arcface"])
def test_frozen_columns_score_like_concatenated_rows_without_a_copy(loss):
    # cross-shard negatives' remote centres: R frozen columns after the weight's W, in the same buffer.
    # Reference: F.cross_entropy over the unfused logits of torch.cat([weight, remote]); the weight's
    # gradient is its own (W, D) array, not the first rows of a (W + R, D) one kept alive as its .grad
    torch.manual_seed(0)
    head = CrossShardNegativesHead(12, 8, 0, OneRank(), every=1, share=0, slice_widths=[12], loss=loss,
                                   scale=16.0, margin=0.4)
    head.remote = torch.randn(20, 8) * torch.rand(20, 1) * 3          # raw rows of different norms
    x, labels = torch.randn(6, 8, requires_grad=True), torch.tensor([0, 3, 11, 1, 1, 5])
    ours = head(x, labels)
    ours.backward()
    ref_w = head.weight.detach().clone().requires_grad_(True)
    ref_x = x.detach().clone().requires_grad_(True)
    cat = torch.cat([ref_w, head.remote])
    logits = LocalClassifier.logits(SimpleNamespace(weight=cat, margin=head.margin), ref_x, labels)  # unfused
    ref = F.cross_entropy(logits, labels)
    ref.backward()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-5, rtol=1e-4)
    assert torch.allclose(head.weight.grad, ref_w.grad, atol=1e-5, rtol=1e-4)
    grad_storage = head.weight.grad.untyped_storage().nbytes()
    assert grad_storage == 12 * 8 * 4                                   # (W, D), not (W + R, D)
    assert head.remote.grad is None and not head.remote.requires_grad



class TwoRanksSeenFromRankZero:
    """Comm of rank 0 of 2 whose all-gather appends rank 1's rows; it notes what the head holds meanwhile."""
    rank, size, sent_bytes, wait_s = 0, 2, 0, 0.0

    def __init__(self, other):
        self.other, self.head, self.remote_rows_during_gather, self.sent = other, None, [], []

    def allgather_tensor(self, t, name):
        self.remote_rows_during_gather.append(self.head.remote.shape[0])
        self.sent.append(t.clone())
        return torch.cat([t, self.other])


def test_exchange_frees_the_old_buffer_before_the_gather_and_keeps_raw_rows():
    # holding the old R rows through the gather and the cat made the exchange the peak of memory
    # (docs/evidence/benchmarks.md: np=4, 4 x 10^5 x 128: 956 -> 806 MB)
    other = torch.randn(5, 3) * 7
    comm = TwoRanksSeenFromRankZero(other)
    head = CrossShardNegativesHead(4, 3, 0, comm, every=1, share=0, slice_widths=[4, 5], loss="softmax")
    comm.head = head
    head.before_step(0)
    head.before_step(1)
    assert comm.remote_rows_during_gather == [0, 0]
    assert torch.equal(comm.sent[0], head.weight.detach())           # this rank's rows as it holds them
    assert torch.equal(head.remote, other)                           # the other rank's, as they came


@pytest.mark.parametrize("loss,kept", [("softmax", False), ("arcface", True)])
def test_checkpoints_with_normalised_remote_rows(loss, kept):
    # written before the rows travelled raw: fine for the margin losses, re-exchanged for softmax
    head = CrossShardNegativesHead(4, 3, 0, OneRank(), every=1, share=0, slice_widths=[4], loss=loss)
    head.load_extra_state({"remote": F.normalize(torch.randn(5, 3)), "exchanges": 2})
    assert (head.remote.shape[0] == 5) is kept
    head.load_extra_state(head.extra_state_for_checkpoint() | {"remote": torch.randn(6, 3)})
    assert head.remote.shape[0] == 6


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_sampled_local_train_step_changes_only_the_sampled_rows(optim):
    # the trainer's own parts and step (the benchmark's builder; one rank, the no-communication engine):
    # with momentum and weight decay on, exactly K = 0.2 x 50 rows of the classifier move, two steps running
    from hvd_partialfc.tools.bench import _synthetic_batches
    cfg = load_config(None, ["data.shards=synthetic", "train.device=cpu", "model.name=mlp", "data.batch_size=4",
                             "model.embedding_dim=16", "head.sample_rate=0.2", f"optim.name={optim}",
                             "optim.classifier_weight_decay=0.01", "head.negatives_every=0"])
    parts, step_fn = _local_parts_and_step(cfg, 50)
    batches = _synthetic_batches(4, [32], 50, seed=0)
    for step in range(2):
        before = parts.head.weight.detach().clone()
        step_fn(step, batches)
        moved = (parts.head.weight.detach() != before).any(1)
        assert int(moved.sum()) == 10


@pytest.mark.parametrize("classes,rate,warned", [(97, 0.1, True), (387, 0.1, False), (97, 1.0, False),
                                                 (300, 0.1, True), (320, 0.1, False)])
def test_sampled_local_warns_at_start_when_it_scores_few_rows(classes, rate, warned):
    # the scale study's finding as a start-up line: r = 0.1 of 97 classes (9 rows a step) lost 4%, 38 rows
    # nothing; the threshold is FEW_SAMPLED_ROWS = 32 rows (300 x 0.1 = 30 warns, 320 x 0.1 = 32 does not)
    cfg = load_config(None, ["data.shards=synthetic", "train.device=cpu", "model.name=mlp", "data.batch_size=4",
                             "model.embedding_dim=16", f"head.sample_rate={rate}", "head.negatives_every=0"])
    warning = _local_parts_and_step(cfg, classes)[0].head.sampling_warning()
    notes = [warning] if warning else []
    assert len(notes) == int(warned)
    if warned:
        assert f"scores {int(rate * classes)} of this rank's {classes} classifier rows" in notes[0]
    global_cfg = load_config(None, ["data.shards=synthetic", "train.device=cpu", "model.name=mlp",
                                    "model.embedding_dim=16", f"head.sample_rate={rate}", "head.mode=global"])
    # PartialFC's sampling of the global softmax: not measured
    assert _local_parts_and_step(global_cfg, classes)[0].head.sampling_warning() is None


@pytest.mark.parametrize("rate", [1.0, 0.2])
def test_adamw_takes_the_momentum_keys_as_beta1(rate):
    """``optim.*_momentum`` is AdamW's beta1 (the keys' documented meaning), for the backbone and for the
    classifier, dense or sampled rows: a step at beta1 0.5 equals torch's AdamW at betas (0.5, 0.999) from
    the same gradients, and differs from the default 0.9's."""
    cfg = load_config(None, ["data.shards=synthetic", "train.device=cpu", "model.name=mlp", "data.batch_size=4",
                             "model.embedding_dim=16", f"head.sample_rate={rate}", "optim.name=adamw",
                             "optim.backbone_momentum=0.5", "optim.classifier_momentum=0.6", "head.negatives_every=0"])
    parts, _ = _local_parts_and_step(cfg, 50)
    assert {g["betas"] for g in parts.backbone_opt.param_groups} == {(0.5, 0.999)}
    assert {g["betas"] for g in parts.head_opt.param_groups} == {(0.6, 0.999)}
    p = next(parts.backbone.parameters())
    ref = p.detach().clone().requires_grad_()
    theirs = torch.optim.AdamW([ref], lr=cfg.optim.backbone_lr, weight_decay=cfg.optim.backbone_weight_decay,
                               betas=(0.5, 0.999))
    for _ in range(3):
        g = torch.randn_like(p)
        p.grad, ref.grad = g.clone(), g.clone()
        parts.backbone_opt.step()
        theirs.step()
    assert torch.equal(p.detach(), ref.detach())
