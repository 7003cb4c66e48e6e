"""The sampled-rows classifier step (rowsparse.py): the documented per-row rule, against torch's optimizers."""
import copy

import pytest
import torch

from hvd_partialfc.classifier import rowsparse
from hvd_partialfc.classifier.rowsparse import SampledRowsOptimizer, gather_rows

KINDS = {"sgd": dict(momentum=0.9, weight_decay=5e-4), "adamw": dict(weight_decay=0.1)}


def _torch_opt(kind, params, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False, **KINDS[kind])
    return torch.optim.AdamW(params, lr=lr, foreach=False, **KINDS[kind])


def _loss(rows, x):
    return (rows @ x).square().sum()


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_row_sampled_equals_torch_optimizer(kind):
    # a row sampled at every step takes torch's own step (dense gradient: all rows)
    torch.manual_seed(0)
    w0 = torch.randn(6, 3)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt, ref_opt = SampledRowsOptimizer([ours], kind, lr=0.05, **KINDS[kind]), _torch_opt(kind, [ref], 0.05)
    for step in range(4):
        x = torch.randn(3)
        for p, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(gather_rows(p, torch.arange(6)) if p is ours else p, x).backward()
            o.step()
    assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_unsampled_rows_wait_and_sampled_rows_step_on_their_own_state(kind):
    # Reference of the rule: one torch optimizer per row, stepped only on the steps where its row is
    # sampled (SGD: momentum and weight decay of unsampled rows wait; AdamW: each row's bias correction
    # counts its own updates). Unsampled rows stay bitwise as they were, weight and state.
    torch.manual_seed(0)
    w0 = torch.randn(6, 3)
    ours = torch.nn.Parameter(w0.clone())
    opt = SampledRowsOptimizer([ours], kind, lr=0.05, **KINDS[kind])
    rows = [torch.nn.Parameter(w0[i].clone()) for i in range(6)]
    row_opts = [_torch_opt(kind, [r], 0.05) for r in rows]
    for index in ([0, 2, 5], [1, 2], [2, 3, 4, 5], [0, 2]):
        x = torch.randn(3)
        index = torch.tensor(index)
        before = ours.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state[ours].items()}
        opt.zero_grad()
        _loss(gather_rows(ours, index), x).backward()
        assert ours.grad.is_sparse and ours.grad._nnz() == index.numel()
        opt.step()
        others = torch.ones(6, dtype=torch.bool)
        others[index] = False
        assert torch.equal(ours.detach()[others], before[others])
        for k, v in state_before.items():
            assert torch.equal(opt.state[ours][k][others], v[others])
        for i in index.tolist():
            row_opts[i].zero_grad()
            _loss(rows[i][None], x).backward()
            row_opts[i].step()
        assert torch.allclose(ours.detach(), torch.stack([r.detach() for r in rows]), atol=1e-6, rtol=1e-5)
    if kind == "adamw":   # the per-row step count: rows 0..5 were sampled 2, 1, 4, 1, 1, 2 times
        assert opt.state[ours]["step"].tolist() == [2, 1, 4, 1, 1, 2]


def test_state_dict_round_trip_resumes_bitwise():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 2))
    opt = SampledRowsOptimizer([p], "adamw", lr=0.1, weight_decay=0.1)
    _loss(gather_rows(p, torch.tensor([1, 3])), torch.randn(2)).backward()
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = SampledRowsOptimizer([q], "adamw", lr=0.1, weight_decay=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))   # as read from a file: no shared tensors
    x = torch.randn(2)
    for param, o in ((p, opt), (q, opt2)):
        o.zero_grad()
        _loss(gather_rows(param, torch.tensor([0, 3])), x).backward()
        o.step()
    assert torch.equal(p, q)
    assert opt2.state[q]["step"].shape == (5,)


def test_two_backward_passes_step_the_union_of_their_rows_once():
    # backward_passes_per_step = 2: the sparse gradients add up (rows 1 and 3 twice, unordered); the step
    # takes their sum, once per row, as the dense step of the summed gradient on those rows would
    torch.manual_seed(0)
    w0 = torch.randn(6, 3)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = SampledRowsOptimizer([ours], "sgd", lr=0.05, momentum=0.9)
    x1, x2 = torch.randn(3), torch.randn(3)
    _loss(gather_rows(ours, torch.tensor([1, 3, 4])), x1).backward()
    _loss(gather_rows(ours, torch.tensor([0, 1, 3])), x2).backward()
    opt.step()
    g = torch.zeros(6, 3)
    for rows, x in (([1, 3, 4], x1), ([0, 1, 3], x2)):
        r = ref[rows].detach().requires_grad_(True)
        _loss(r, x).backward()
        g[rows] += r.grad
    expect = w0 - 0.05 * g
    assert torch.allclose(ours.detach(), expect, atol=1e-6)
    assert torch.equal(ours.detach()[[2, 5]], w0[[2, 5]])
    assert torch.allclose(opt.state[ours]["momentum_buffer"], g, atol=1e-6)


def _exact_and_dense(sweep_every, steps, lrs, seed=0, width=7):
    """Run the exact rule and torch's dense SGD (a zero gradient on the unsampled rows) side by side."""
    torch.manual_seed(seed)
    w0 = torch.randn(width, 3, dtype=torch.float64)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = SampledRowsOptimizer([ours], "sgd", lr=0.05, rule="exact", sweep_every=sweep_every, **KINDS["sgd"])
    ref_opt = _torch_opt("sgd", [ref], 0.05)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        index = torch.sort(torch.randperm(width, generator=g)[:2]).values   # 2 of 7 rows: most rows wait
        x = torch.randn(3, generator=g, dtype=torch.float64)
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = lrs(step)
        opt.catch_up(ours, index)                 # what the head does before scoring the sampled rows
        for p, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            _loss(gather_rows(p, index) if p is ours else p[index], x).backward()
            o.step()
    return ours, ref, opt, ref_opt


@pytest.mark.parametrize("sweep_every", [1, 4, 1000])
def test_exact_rule_gives_the_dense_step(sweep_every, monkeypatch):
    monkeypatch.setattr(rowsparse, "SWEEP_BLOCK", 3)   # the sweep's blocks: rows 0-2, 3-5, 6
    # The exact rule touches only the sampled rows, yet every row ends where torch's dense SGD (momentum,
    # weight decay, a changing lr) puts it, unsampled rows included: they are caught up when next sampled
    # and at every sweep. float64, so only the summation order differs. 1000: no sweep within the run.
    ours, ref, opt, ref_opt = _exact_and_dense(sweep_every, 40, lambda s: 0.05 * (1 + 0.5 * (s % 3)))
    opt._sweep(ours, opt.state[ours], 0.9, 5e-4)   # bring the rows that wait up to the last step
    assert torch.allclose(ours.detach(), ref.detach(), rtol=0, atol=1e-12)
    assert torch.allclose(opt.state[ours]["momentum_buffer"], ref_opt.state[ref]["momentum_buffer"],
                          rtol=0, atol=1e-12)
    lazy = SampledRowsOptimizer([torch.nn.Parameter(torch.zeros(1))], "sgd", lr=0.1)
    assert lazy.rule == "lazy"        # the default stays the documented lazy rule


def test_exact_rule_resumes_bitwise_mid_window():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, 2))
    opt = SampledRowsOptimizer([p], "sgd", lr=0.1, momentum=0.9, weight_decay=0.01, rule="exact", sweep_every=5)
    for rows in ([1, 3], [0, 3], [2]):        # 3 steps into a window of 5: rows at different lags
        opt.zero_grad()
        _loss(gather_rows(p, torch.tensor(rows)), torch.randn(2)).backward()
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = SampledRowsOptimizer([q], "sgd", lr=0.1, momentum=0.9, weight_decay=0.01, rule="exact", sweep_every=5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.state[q]["since_base"].tolist() == [2, 1, 3, 2, 0, 0]
    for rows in ([0, 5], [4], [1, 2]):        # through the sweep at step 5
        x = torch.randn(2)
        for param, o in ((p, opt), (q, opt2)):
            o.zero_grad()
            _loss(gather_rows(param, torch.tensor(rows)), x).backward()
            o.step()
    assert torch.equal(p, q)
    assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[q]["momentum_buffer"])
    assert opt2.state[q]["lrs"] == opt.state[p]["lrs"] and len(opt.state[p]["lrs"]) == 1


def test_exact_rule_is_for_sgd_only():
    with pytest.raises(ValueError, match="exact"):
        SampledRowsOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], "adamw", lr=0.1, rule="exact")
