"""One member of the study's elastic group: loops on a Gloo all_reduce and re-forms the group in the same process
when a member dies (a smaller group) or a newcomer asks to join (a larger one).

    python -m scripts.studies.elastic_torch.member --store 127.0.0.1:PORT --uid w0 --members w0,w1,w2 --log w0.jsonl
    python -m scripts.studies.elastic_torch.member --store 127.0.0.1:PORT --uid j0 --join --log j0.jsonl

Started by the drivers (kill_reform.py, join.py, torchrun_agents.py), not by hand. Generation g's group is
``init_process_group("gloo", store=PrefixStore("gen{g}/pg/", store))``: a fresh key prefix per generation, so no
key of an earlier generation (the dead member's address among them) is ever read again.

Each iteration all-reduces a 4096-float tensor of ones (the sum must be the group's size); the current rank 0 also
puts two flags in its last slots: "stop" (the driver set the store's ``stop`` key: everyone leaves at the same
iteration)
and the number of join requests in the store. When that number grows, every member re-forms at once at the next
generation with the newcomers appended (rank 0 publishes the list and tells each newcomer its generation).

On an exception (a dead peer) the member logs it, calls ``destroy_process_group``, agrees the next generation's
members with the survivors (common.agree) and re-forms. After forming, the members all-reduce (MAX) their
iteration counters, which is the new group's first collective ("first_ok").

With ``--poll`` each all_reduce is started asynchronously and polled; once it has taken 0.1 s the member asks
the store whether a peer is known dead (common.Liveness) and, if so, leaves the collective with ``PeerDead``
instead of waiting for Gloo's timeout (a hung peer, or a cut link, closes no socket). ``destroy_process_group``
then still waits for the stuck collective (the group's destructor joins its threads) unless ``--graveyard`` keeps
a reference to the failed group.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .common import Liveness, Log, agree, open_watch, resources, start_lease, store_client

N = 4096
graveyard = []          # failed groups kept referenced (--graveyard); a real engine would drop them after the timeout


class PeerDead(RuntimeError):
    """A member of the group is known dead while this rank waits for a collective (``--poll``)."""


def wait_polling(work, live: Liveness, peers, check_after: float = 0.1, every: float = 0.05) -> None:
    """Wait for ``work`` without blocking in Gloo: poll it, and once it has taken ``check_after`` seconds, ask the
    store every ``every`` seconds whether a peer is known dead (a hung or stopped peer closes no socket, so Gloo
    itself would wait for its timeout)."""
    t0 = time.monotonic()
    next_check = t0 + check_after
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_check:
            for m in peers:
                reason = live.dead(m)
                if reason:
                    raise PeerDead(f"peer {m} known dead ({reason}) after {now - t0:.2f} s in a collective")
            next_check = now + every
        time.sleep(0.002)
    work.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", help="host:port of the store (default: $STUDY_STORE)")
    ap.add_argument("--watch-port", type=int, default=int(os.environ.get("STUDY_WATCH", 0)),
                    help="the store process's death watch (0: none; default: $STUDY_WATCH)")
    ap.add_argument("--host-store", action="store_true", help="this member hosts the store (the rank-0 variant)")
    ap.add_argument("--uid", help="default: w$RANK (under torchrun)")
    ap.add_argument("--members", help="generation 0's members, comma-separated (default: w0..w$WORLD_SIZE-1)")
    ap.add_argument("--join", action="store_true", help="a newcomer: ask to join the running group")
    ap.add_argument("--sleep", type=float, default=0.01, help="seconds of 'work' per iteration")
    ap.add_argument("--timeout", type=float, default=20, help="the Gloo group's timeout")
    ap.add_argument("--lease", type=float, default=0.1, help="lease interval (s)")
    ap.add_argument("--lease-timeout", type=float, default=1.0)
    ap.add_argument("--agree-deadline", type=float, default=10.0)
    ap.add_argument("--poll", action="store_true",
                    help="wait for each all_reduce by polling, leaving it when a peer is known dead")
    ap.add_argument("--graveyard", action="store_true",
                    help="keep a failed group referenced so that destroy_process_group does not wait for it")
    ap.add_argument("--gc", action="store_true", help="gc.collect() after destroying a failed group")
    ap.add_argument("--log", default=os.environ.get("STUDY_LOG"), help="%u: the uid (default: $STUDY_LOG)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    uid = args.uid or f"w{os.environ['RANK']}"
    log = Log(args.log.replace("%u", uid), uid=uid)
    signal.signal(signal.SIGTERM, lambda s, f: (log("sigterm"), os._exit(143)))
    host, port = (args.store or os.environ["STUDY_STORE"]).rsplit(":", 1)
    port = int(port)
    t0 = time.time()
    base = store_client(host, port, master=args.host_store)
    # Under torchrun every rendezvous round gets its own keys: MASTER_PORT is new each round (with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and the same for all of the round's workers.
    # PrefixStore(p) names a key p + "/" + key: the raw keys (the lease, the death watch's) say so themselves.
    ns = f"round{os.environ['MASTER_PORT']}" if "TORCHELASTIC_RUN_ID" in os.environ else ""
    store = dist.PrefixStore(ns, base) if ns else base
    ns = ns and ns + "/"
    lease = start_lease(host, port, f"{ns}lease/{uid}", args.lease)
    watch = open_watch(host, args.watch_port, f"{ns}dead/{uid}") if args.watch_port else None
    import psutil
    log("start", ppid=os.getppid(), connect_s=time.time() - t0, import_s=START - psutil.Process().create_time())
    admitted, live = 0, Liveness(store, args.lease_timeout)
    if args.join:
        i = store.add("joiners/count", 1) - 1
        store.set(f"joiners/{i}", uid)
        log("join_request", index=i)
        gen = int(store.get(f"joiners/{i}/gen").decode())     # blocks until rank 0 admits us (store timeout)
        members = json.loads(store.get(f"gen{gen}/members").decode())
        admitted = int(store.get(f"gen{gen}/admitted").decode())
    else:
        gen = 0
        n = int(os.environ.get("WORLD_SIZE", 0))
        members = args.members.split(",") if args.members else [f"w{r}" for r in range(n)]
    it, last_ok, timeout = 0, None, timedelta(seconds=args.timeout)
    while True:
        failed = False
        try:
            rank, size = members.index(uid), len(members)
            t = time.time()
            dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}/pg/", store), rank=rank,
                                    world_size=size, timeout=timeout)
            init_s = time.time() - t
            c = torch.tensor([it], dtype=torch.int64)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            it, t_ok = int(c), time.time()
            log("first_ok", t=t_ok, gen=gen, rank=rank, size=size, members=members, it=it, init_s=init_s,
                res=resources())
            x = torch.empty(N)
            while True:
                x.fill_(1.0)
                x[-2:] = 0
                if rank == 0:
                    x[-2] = float(base.check(["stop"]))
                    x[-1] = float(store.add("joiners/count", 0))
                if args.poll:
                    wait_polling(dist.all_reduce(x, async_op=True), live, [m for m in members if m != uid])
                else:
                    dist.all_reduce(x)
                if x[0].item() != size:
                    raise RuntimeError(f"wrong sum {x[0].item()} at size {size}")
                last_ok, it = time.time(), it + 1
                if x[-2].item() > 0:
                    log("end", gen=gen, it=it, res=resources())
                    if watch:
                        watch.sendall(b"bye")
                    dist.destroy_process_group()
                    gc.collect()                 # free failed groups' Work objects before the interpreter's exit
                    lease.join()
                    return
                count = int(x[-1].item())
                if count > admitted:                         # newcomers: re-form at size + k now
                    new = [store.get(f"joiners/{k}").decode() for k in range(admitted, count)]
                    members, admitted, gen = members + new, count, gen + 1
                    if rank == 0:
                        store.set(f"gen{gen}/members", json.dumps(members))
                        store.set(f"gen{gen}/admitted", str(admitted))
                        for k in range(count - len(new), count):
                            store.set(f"joiners/{k}/gen", str(gen))
                    log("switch", reason="join", last_ok=last_ok, it=it, new=new, gen=gen)
                    dist.destroy_process_group()
                    break
                time.sleep(args.sleep)
        except Exception as e:                               # a dead peer (or a failed init)
            failed, t_err = True, time.time()
            log("error", t=t_err, gen=gen, type=type(e).__name__, msg=(str(e).splitlines() or [""])[0][:300],
                last_ok=last_ok, it=it)
        if not failed:
            continue                                         # newcomers: re-form at the next generation
        # Outside the except clause: the exception is gone, and with its traceback the frames that held the failed
        # collective's Work (and through it the group). Destroying the group now closes its sockets, so a survivor
        # blocked on *this* process (not on the dead one) gets its error at once. Inside the clause the group
        # outlived destroy_process_group: such a survivor waited until this one had agreed (10 s, join.py).
        t = time.time()
        why = None
        if dist.is_initialized():
            if args.graveyard:               # keep the failed group alive: its destructor would wait for the
                graveyard.append(dist.group.WORLD)   # collective stuck on a hung peer (Gloo's timeout)
            try:
                dist.destroy_process_group()
            except Exception as d:
                why = f"{type(d).__name__}: {d}"[:300]
        if args.gc:
            gc.collect()
        log("destroyed", gen=gen, destroy_s=time.time() - t, since_error=time.time() - t_err, destroy_error=why)
        gen += 1
        res = agree(store, gen, uid, members, args.lease_timeout, args.agree_deadline, live=live)
        log("agreed", gen=gen, members=res["members"], why=res["why"])
        if uid not in res["members"]:
            log("fenced", gen=gen)
            sys.exit(3)
        members = res["members"]

START = time.time()          # after the imports (torch's above)
if __name__ == "__main__":
    main()
