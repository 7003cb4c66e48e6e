"""Questions 5 and 6: what 10 re-forms leave behind in one process (RSS, threads, fds, TCP sockets), and whether
a module with parameters and autograd hooks keeps working when the default group changes under it.

    python -m scripts.studies.elastic_torch.resources --reforms 10

Two workers and the store process. Each worker builds one ``nn.Linear`` (same seed) whose parameters carry a
post-accumulate-grad hook that all-reduces the gradient in *whatever the default group is at that moment*, and
one SGD optimizer; both are built once, before any group. Then, 1 + ``--reforms`` times: init a Gloo group under
a fresh prefix, train 5 steps on rank-dependent data, check that the parameters are equal on both ranks (the
hooks averaged through the new group), make and use a ``new_group``, ``destroy_process_group``. Generation 0's
group object is kept and used once in generation 1 (a stale handle), then dropped; no other reference to a group
is kept. Worker 0 logs its resources before the first group, with each group live, and after each destroy
(after a ``gc.collect``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from datetime import timedelta

from .common import Log, read_logs, resources, spawn, start_store, store_client, wait_for


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    log = Log(args.log, rank=args.rank)
    store = store_client("127.0.0.1", args.port)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def average(p) -> None:                 # the default group at the time of the call
        dist.all_reduce(p.grad)
        p.grad.mul_(0.5)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    log("before", res=resources())
    old = None
    for g in range(args.reforms + 1):
        t = time.time()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{g}/pg/", store), rank=args.rank, world_size=2,
                                timeout=timedelta(seconds=20))
        init_s = time.time() - t
        gen = torch.Generator().manual_seed(100 * g + args.rank)
        for _ in range(5):
            x = torch.randn(16, 64, generator=gen)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        same = bool(torch.equal(both[0], both[1]))
        sub = dist.new_group([0, 1])
        y = torch.ones(3)
        dist.all_reduce(y, group=sub)
        stale = None
        if old is not None:                 # generation 0's group object, used in generation 1, then dropped
            try:
                dist.all_reduce(torch.ones(1), group=old)
                stale = "worked"
            except Exception as e:
                stale = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            old = None
        if g == 0:
            old = dist.group.WORLD
        del sub
        live = resources()
        t = time.time()
        dist.destroy_process_group()
        destroy_s = time.time() - t
        gc.collect()
        log("reformed", gen=g, init_s=init_s, destroy_s=destroy_s, params_equal=same, new_group_sum=y.tolist(),
            old_group=stale, res_live=live, res=resources())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reforms", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    folder = tempfile.mkdtemp(prefix="resources-")
    store_proc, port, _ = start_store(folder, watch=False)
    procs = [spawn("resources", ["--worker", "--rank", str(r), "--port", str(port), "--reforms", str(args.reforms),
                                 "--log", os.path.join(folder, f"r{r}.jsonl")], os.path.join(folder, f"r{r}.out"))
             for r in range(2)]
    try:
        wait_for(lambda: all(p.poll() is not None for p in procs), 110, "the workers")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        store_proc.kill()
    rows = [r for r in read_logs(folder) if r.get("rank") == 0]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("t", "pid")}), flush=True)
    print("exit codes:", [p.returncode for p in procs])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
