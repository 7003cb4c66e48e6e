"""The sampled-rows classifier step (rowsparse.py): the documented per-row rule, against torch's optimizers."""
import copy

import pytest
import torch

from hvd_partialfc.rowsparse import SampledRowsOptimizer, gather_rows

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
