"""Two ranks of the torch engine (tests/test_torch_engine.py starts them with torchrun's variables; torchrun runs
them as well).

    torchrun --standalone --nproc-per-node 2 torch_engine_job.py wait TIMEOUT SLEEP [SLEEP ...]
        with train.collective_timeout=TIMEOUT, for each SLEEP: rank 1 sleeps SLEEP s before an all-reduce that
        rank 0 waits in; rank 0 prints how each ended ("ok after S s" or "failed after S s: ...")
    torchrun --standalone --nproc-per-node 2 torch_engine_job.py branch OUT
        a model with a branch that rank 1 skips, its gradients averaged by the engine's buckets (three, 4 KB
        each); each rank writes the averaged gradients and the ones computed offline to OUT/rank-R.pt
    torchrun --standalone --nproc-per-node 2 torch_engine_job.py branch-then-wait OUT TIMEOUT SLEEP [SLEEP ...]
        both in one launch (the test's: one start-up of two ranks): the engine started once with TIMEOUT,
        ``branch`` first (its collectives meet at once), then ``wait``, which ends the job at its failure
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.cli_support import freeze_at_exit  # noqa: E402
from hvd_partialfc.engine import torchdist  # noqa: E402
from hvd_partialfc.engine.base import backbone_params  # noqa: E402


def wait(comm, sleeps):
    comm.allreduce_scalar(1.0, "sum", name="warm")
    for sleep in sleeps:
        if comm.rank == 1:
            time.sleep(sleep)
        t0 = time.time()
        try:
            comm.allreduce_scalar(1.0, "sum", name=f"after {sleep}")
            said = f"ok after {time.time() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 (what ended it is the figure)
            said = f"failed after {time.time() - t0:.1f} s: {type(e).__name__}"
        if comm.rank == 0:      # one rank, one write: torchrun runs its children unbuffered, and two ranks'
            os.write(1, f"[rank 0] {said}\n".encode())   # print()s interleaved mid-line in CI
        if said.startswith("failed"):
            break
    sys.stdout.flush()
    os._exit(0)


class Net(nn.Module):
    """Three layers of 32 x 32 (4 KB each), one bucket each; rank 1 never uses ``skipped``."""

    def __init__(self):
        super().__init__()
        self.first, self.skipped, self.last = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False), \
            nn.Linear(32, 32, bias=False)

    def forward(self, x, use_branch):
        h = self.first(x)
        if use_branch:
            h = h + self.skipped(h)
        return self.last(h)


def branch(comm, out):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(comm.rank))
    use = comm.rank == 0
    # offline: this rank's own gradients (a plain backward), every rank's gathered, summed, x 1/N (Horovod's average)
    net(x, use).pow(2).sum().backward()
    mine = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in net.named_parameters()}
    every = [None] * comm.size
    dist.all_gather_object(every, mine)
    offline = {n: sum(e[n] for e in every) * (1.0 / comm.size) for n in mine}
    net.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    avg = torchdist.BucketAverager(comm, opt, backbone_params(opt, net), False, 1, bucket_mb=4096 / 2 ** 20)
    assert len(avg.buckets) == 3, [len(b) for b in avg.buckets]
    net(x, use).pow(2).sum().backward()
    avg.synchronize()
    torch.save({"averaged": {n: p.grad.clone() for n, p in net.named_parameters()}, "offline": offline,
                "buckets": len(avg.buckets)}, os.path.join(out, f"rank-{comm.rank}.pt"))


mode = sys.argv[1]
freeze_at_exit()          # the exit skips the shutdown's collections over torch's objects (cli_support.py)
if mode == "wait":
    wait(torchdist.init("cpu", timeout_s=float(sys.argv[2])), map(float, sys.argv[3:]))
elif mode == "branch":
    comm = torchdist.init("cpu")
    branch(comm, sys.argv[2])
    comm.shutdown()
else:   # branch-then-wait
    comm = torchdist.init("cpu", timeout_s=float(sys.argv[3]))
    branch(comm, sys.argv[2])
    wait(comm, map(float, sys.argv[4:]))
