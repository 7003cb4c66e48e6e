"""tests/test_engines.py's work under ONE launch of either launcher (``horovodrun`` or ``torchrun``): the
engine is started once (``train.engine=auto`` picks it from the launcher), then each item runs in its own
folder ``OUT/<name>``:

* ``{"train": NAME, "args": [...], "expect_error": bool}``: ``hvd-partialfc train ARGS`` (``cli.main``). It
  writes ``OUT/NAME/rank-<r>.log`` (what it printed) and ``rank-<r>.result.json`` (exit code, wall time);
  ``"after": PATH`` on any item: it waits until PATH exists (written by a launch running beside this one);
* ``{"scenario": "mismatch"}``: rank 1 calls a collective under another name than rank 0's; with
  ``HVD_PARTIALFC_CHECK_COLLECTIVES=1`` every rank must raise RankFailure naming both (torch engine only:
  Horovod matches by name and would wait). Writes ``rank-<r>.log``;
* ``{"scenario": "primitives"}``: each primitive against what it must compute, on inputs that differ by
  rank (a broadcast from ranks that start different; an all-gather of unequal row counts; sums, maxima,
  averages of several dtypes; the vote; on the CPU, a wait for a late rank that sleeps). Writes
  ``rank-<r>.log``. ``primitives-cuda``: the same on the current GPU's tensors (tests/test_gpu_smoke.py).

    python engines_launch.py SPEC.json      # SPEC: {"out": ..., "items": [...]}

An item that ends other than expected ends the process at once (non-zero), so later items leave nothing;
one that ends as expected leaves ``OUT/NAME/done-rank-<r>``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc import cli  # noqa: E402
from hvd_partialfc.cli_support import freeze_at_exit  # noqa: E402
from hvd_partialfc.engine.base import RankFailure  # noqa: E402
from hvd_partialfc.engine.select import start_engine  # noqa: E402


def _train(args, out, rank):
    t0 = time.monotonic()
    with open(os.path.join(out, f"rank-{rank}.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            code = cli.main(["train", *(a.replace("{rank}", str(rank)) for a in args)])
        except BaseException:  # noqa: BLE001 (what the console script would print on its way out)
            traceback.print_exc()
            code = 1
    with open(os.path.join(out, f"rank-{rank}.result.json"), "w") as f:
        json.dump({"code": code, "seconds": time.monotonic() - t0}, f)
    return code


def _mismatch(comm, out):
    """Rank 1 takes another code path: its collective's name differs from rank 0's."""
    with open(os.path.join(out, f"rank-{comm.rank}.log"), "w") as log:
        try:
            comm.allreduce_scalar(1.0, "sum", name="path.a" if comm.rank == 0 else "path.b")
            log.write("no error\n")
            return False
        except RankFailure as e:
            log.write(f"RankFailure: {e}\n")
            return True


def _primitives(comm, out, device="cpu"):
    """Every primitive of the engine against an independent computation (raises AssertionError), on tensors
    of ``device`` ("cuda": the current GPU, which the engine's start made current); results stay there."""
    import torch
    r, n = comm.rank, comm.size
    dev = torch.device(device)
    on = lambda x: x.to(dev)  # noqa: E731
    torch.manual_seed(100 + r)                     # every rank starts different
    m = on(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))
    m[1].running_mean.fill_(float(r))
    torch.manual_seed(100)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))   # rank 0's start
    comm.broadcast_module(m, name="prim")
    assert torch.equal(m[0].weight.cpu(), ref[0].weight) and torch.equal(m[1].running_mean.cpu(), torch.zeros(3))
    assert m[0].weight.device.type == dev.type
    assert len(set(comm.backbone_digests(m, name="prim"))) == 1
    rows = on(torch.arange(float(r + 1) * 3).reshape(r + 1, 3) + 10 * r)     # r + 1 rows on rank r
    want = torch.cat([torch.arange(float(k + 1) * 3).reshape(k + 1, 3) + 10 * k for k in range(n)])
    got = comm.allgather_tensor(rows, "prim.rows")
    assert got.device == rows.device and torch.equal(got.cpu(), want)
    x = on(torch.tensor([1.0, -2.0, 3.5]) * (r + 1))
    got = comm.allreduce_tensor(x, "sum", "prim.sum")
    assert got.device == x.device and torch.equal(got.cpu(), torch.tensor([1.0, -2.0, 3.5]) * sum(range(1, n + 1)))
    got = comm.allreduce_tensor(x, "max", "prim.max")
    assert torch.equal(got.cpu(), torch.tensor([1.0, -2.0, 3.5]) * torch.tensor([n, 1, n]))
    avg = comm.grouped_average([x, x.double(), on(torch.full((2,), float(r)))], "prim.avg")
    assert torch.equal(avg[0].cpu(), torch.tensor([1.0, -2.0, 3.5]) * sum(range(1, n + 1)) * (1.0 / n))
    assert avg[1].dtype == torch.float64 and torch.equal(avg[2].cpu(), torch.full((2,), sum(range(n)) / n))
    assert all(a.device == x.device for a in avg)
    assert comm.allreduce_scalar(r + 1, "min", "prim.min") == 1.0
    assert comm.allreduce_scalar(r + 1, "average", "prim.average") == sum(range(1, n + 1)) / n
    assert comm.vote_async([float(r), 0.0], "prim.vote").result() == [float(n - 1), 0.0]
    assert comm.allgather_object({"r": r}, "prim.obj") == [{"r": k} for k in range(n)]
    if device == "cpu":
        _waits_sleep(comm)
    with open(os.path.join(out, f"rank-{r}.log"), "w") as log:
        log.write("primitives ok\n")
    return True


def _waits_sleep(comm, late=0.6):
    """On a CPU host a rank that waits for a late one sleeps: rank 0's thread uses under 0.25 CPU-s over five
    waits of ``late`` s each (a scalar, a tensor, the vote, an object, a module's broadcast) for the last rank,
    which comes late to each. Horovod's own wait spins on sched_yield (about as many CPU-s as it waits, less its
    share of a busy machine's cores)."""
    import torch
    last = comm.rank == comm.size - 1
    used = time.thread_time()
    calls = (lambda: comm.allreduce_scalar(1.0, "sum", "wait.scalar"),
             lambda: comm.allreduce_tensor(torch.ones(3), "sum", "wait.tensor"),
             lambda: comm.vote_async([0.0], "wait.vote").result(),
             lambda: comm.allgather_object(comm.rank, "wait.object"),
             lambda: comm.broadcast_module(torch.nn.Linear(2, 2), "wait.module"))
    for call in calls:
        if last:
            time.sleep(late)
        call()
    used = time.thread_time() - used
    assert last or used < 0.05 * len(calls), \
        f"rank {comm.rank} used {used:.2f} CPU-s waiting {len(calls) * late:.1f} s for the last rank"


def _wait_for(path, timeout=300):
    """An item's ``after``: a path (a checkpoint folder, published whole by a rename) that another launch
    running beside this one writes; the item starts once it is there."""
    deadline = time.monotonic() + timeout
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear in {timeout} s")
        time.sleep(0.1)


def _scenario(name, comm, out):
    if name == "primitives":
        _primitives(comm, out)
    elif name == "primitives-cuda":
        _primitives(comm, out, "cuda")
    elif not _mismatch(comm, out):
        raise RuntimeError("the collective names differed and nothing was raised")


def run_items(spec, scenario) -> None:
    """Start the launcher's engine once, then each item of ``spec`` in order: ``{"train": ...}`` through
    ``cli.main``, ``{"scenario": NAME}`` as ``scenario(NAME, comm, OUT/NAME)`` (also tests/mr/checkpoints_launch.py)."""
    comm = start_engine("auto", os.environ)
    shutdown = type(comm).shutdown
    type(comm).shutdown = lambda self: None          # the next item uses the same engine
    for item in spec["items"]:
        name = item.get("scenario") or item["train"]
        out = os.path.join(spec["out"], name)
        os.makedirs(out, exist_ok=True)
        try:
            _wait_for(item.get("after"))
            if "scenario" in item:
                scenario(name, comm, out)
            elif (_train(item["args"], out, comm.rank) != 0) != bool(item.get("expect_error")):
                raise RuntimeError(f"train exited other than expected (see {out}/rank-{comm.rank}.log)")
        except Exception as e:  # noqa: BLE001
            print(f"[rank {comm.rank}] {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        open(os.path.join(out, f"done-rank-{comm.rank}"), "w").close()
    # the engine ends here, not in the interpreter's exit: a torch process group left to the exit's
    # teardown aborted rank 0 once in four suites ("terminate called without an active exception", SIGABRT
    # after every item had passed)
    shutdown(comm)
    freeze_at_exit()          # the exit skips the shutdown's collections (a train item's cli.main did it already)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run_items(json.load(f), _scenario)
