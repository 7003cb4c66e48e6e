"""model.sync_batchnorm: every rank's BatchNorm uses the statistics of all ranks' batches together, and the
gradients (through those statistics, across ranks) are those of one process on the concatenated batch.
The ranks here are simcomm's virtual ranks; tests/test_simulate.py runs the option under real horovodrun."""
import pytest
import torch
from torch import nn

from conftest import in_threads
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.engine.syncbn import SyncBatchNorm, convert_sync_batchnorm

N, B, C = 3, 5, 4


def _data():
    g = torch.Generator().manual_seed(0)
    # per-rank batches with different means and scales: per-rank statistics differ from the pooled ones
    xs = [torch.randn(B, C, 3, 3, generator=g) * (1 + r) + 2.0 * r for r in range(N)]
    cs = [torch.randn(B, C, 3, 3, generator=g) for _ in range(N)]
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    return xs, cs, w, b


def _bn(w, b, affine=True):
    bn = nn.BatchNorm2d(C, momentum=0.3, affine=affine)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(w), bn.bias.copy_(b)
    return bn


@pytest.mark.parametrize("affine", [True, False])
def test_sync_batchnorm_is_one_process_on_the_global_batch(affine):
    xs, cs, w, b = _data()

    def make(w, b):
        return _bn(w, b, affine)
    # reference: one process, the concatenated batch, the mean over ranks of each rank's mean loss
    ref = make(w, b)
    x = torch.cat(xs).requires_grad_()
    y = ref(x)
    (sum((y[r * B:(r + 1) * B] * cs[r]).mean() for r in range(N)) / N).backward()

    def rank(comm):
        net = convert_sync_batchnorm(nn.Sequential(make(w, b)), comm)
        assert isinstance(net[0], SyncBatchNorm) and list(net[0].state_dict()) == list(ref.state_dict())
        xr = xs[comm.rank].clone().requires_grad_()
        yr = net(xr)
        (yr * cs[comm.rank]).mean().backward()
        grads = (net[0].weight.grad, net[0].bias.grad) if affine else (None, None)
        return (yr.detach(), xr.grad) + grads + (net[0].running_mean, net[0].running_var)

    out = in_threads(N, rank)
    assert not any(isinstance(o, Exception) for o in out), out
    for r, (yr, gx, gw, gb, rm, rv) in enumerate(out):
        torch.testing.assert_close(yr, y[r * B:(r + 1) * B].detach(), atol=1e-5, rtol=1e-5)
        # the input's gradient reaches every rank's statistics: rank r's, / N (the average the optimizer
        # takes), is the reference's rows of r
        torch.testing.assert_close(gx / N, x.grad[r * B:(r + 1) * B], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rm, ref.running_mean, atol=1e-6, rtol=1e-5)   # equal on every rank
        torch.testing.assert_close(rv, ref.running_var, atol=1e-6, rtol=1e-5)
    # the parameters' gradients, averaged over ranks (the DistributedOptimizer), are the reference's
    if affine:
        torch.testing.assert_close(sum(o[2] for o in out) / N, ref.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sum(o[3] for o in out) / N, ref.bias.grad, atol=1e-6, rtol=1e-5)
    # what the test can tell apart: plain per-rank BatchNorm normalises rank 2's batch quite differently
    assert (make(w, b)(xs[2]) - y[2 * B:].detach()).abs().max() > 0.5
    # evaluation: plain BatchNorm with the running statistics, no collective (no comm needed)
    sync = SyncBatchNorm(C, ref.eps, 0.3, affine, comm=None, name="x")
    sync.load_state_dict(ref.state_dict())
    ref.eval(), sync.eval()
    torch.testing.assert_close(sync(xs[0]), ref(xs[0]))


def test_sync_batchnorm_config():
    assert load_config(None, ["data.shards=/x"]).model.sync_batchnorm is False
    with pytest.raises(ConfigError, match="checkpoint_activations"):
        load_config(None, ["data.shards=/x", "model.sync_batchnorm=true", "model.checkpoint_activations=true"])
