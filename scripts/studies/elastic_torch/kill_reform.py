"""Questions 1 and 2: N members (plain launch, no torchrun) loop on a Gloo all_reduce; one is SIGKILLed; the
survivors notice, destroy the group, agree who is left and re-form at N-1 in the same processes.

    python -m scripts.studies.elastic_torch.kill_reform --repeats 3                        # store process + death watch
    python -m scripts.studies.elastic_torch.kill_reform --repeats 3 --membership lease     # lease only (no watch)
    python -m scripts.studies.elastic_torch.kill_reform --store rank0 --membership lease   # w0 hosts the store
    python -m scripts.studies.elastic_torch.kill_reform --store rank0 --membership lease --kill w0   # ... and dies
    python -m scripts.studies.elastic_torch.kill_reform --signal STOP            # a hung peer: Gloo's timeout
    python -m scripts.studies.elastic_torch.kill_reform --signal STOP --poll     # ... left when its lease stops
    python -m scripts.studies.elastic_torch.kill_reform --signal STOP --poll --graveyard   # ... without waiting

Per survivor it reports, from the kill: the first exception (type, message, delay), how long
``destroy_process_group`` took, when the members were agreed, and the first successful all_reduce of the new
group; and whether its PID is the same before and after. ``--json`` writes every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import tempfile
import time

from .common import read_logs, spawn, start_store, store_client, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(args, folder: str) -> dict:
    uids = [f"w{r}" for r in range(args.members)]
    store_proc, watch = None, 0
    if args.store == "separate":
        store_proc, port, watch = start_store(folder, watch=args.membership == "watch")
    else:
        port = _free_port()
    procs = {}
    for u in uids:
        extra = ["--host-store"] if (args.store == "rank0" and u == "w0") else []
        if watch:
            extra += ["--watch-port", str(watch)]
        extra += ["--poll"] if args.poll else []
        extra += ["--graveyard"] if args.graveyard else []
        procs[u] = spawn("member", ["--store", f"127.0.0.1:{port}", "--uid", u, "--members", ",".join(uids),
                                    "--log", os.path.join(folder, f"{u}.jsonl"), "--sleep", str(args.sleep),
                                    "--timeout", str(args.timeout), "--lease-timeout", str(args.lease_timeout),
                                    *extra], os.path.join(folder, f"{u}.out"))

    def logged(event, who, **match):
        return [r for r in read_logs(folder) if r["event"] == event and r.get("uid") in who
                and all(r.get(k) == v for k, v in match.items())]
    wait_for(lambda: len(logged("first_ok", uids, gen=0)) == len(uids), 90, "generation 0")
    client = store_client("127.0.0.1", port)
    time.sleep(args.kill_after)
    t_kill = time.time()
    os.kill(procs[args.kill].pid, getattr(signal, f"SIG{args.signal}"))
    survivors = [u for u in uids if u != args.kill]
    result = {"kill": args.kill, "signal": args.signal, "poll": args.poll, "graveyard": args.graveyard,
              "store": args.store,
              "membership": args.membership, "members": args.members}
    try:
        wait_for(lambda: len(logged("first_ok", survivors, gen=1)) == len(survivors)
                 or all(procs[u].poll() is not None for u in survivors), args.wait, "generation 1")
        if len(logged("first_ok", survivors, gen=1)) < len(survivors):
            raise RuntimeError("the survivors exited without re-forming")
        time.sleep(0.5)
        client.set("stop", "1")
        wait_for(lambda: all(procs[u].poll() is not None for u in survivors), 30, "the survivors' exit")
        result["outcome"] = "re-formed"
    except Exception as e:                      # the store's host died, or something hung: say so
        result["outcome"] = f"not re-formed: {e}"
        time.sleep(2)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    if store_proc:
        store_proc.kill()
    logs = read_logs(folder)
    per = {}
    for u in survivors:
        mine = [r for r in logs if r.get("uid") == u]
        first = lambda ev, **m: next((r for r in mine if r["event"] == ev and all(r.get(k) == v for k, v in m.items())), None)
        err, des, agr, ok1, ok0 = (first("error"), first("destroyed"), first("agreed"), first("first_ok", gen=1),
                                   first("first_ok", gen=0))
        per[u] = {
            "exit": procs[u].returncode,
            "error": err and f"{err['type']}: {err['msg']}",
            "error_after_s": err and round(err["t"] - t_kill, 3),
            "destroy_s": des and round(des["destroy_s"], 3),
            "agreed_after_s": agr and round(agr["t"] - t_kill, 3),
            "dead_known_by": agr and agr["why"],
            "init_s": ok1 and round(ok1["init_s"], 3),
            "first_ok_after_s": ok1 and round(ok1["t"] - t_kill, 3),
            "new_rank": ok1 and f"{ok1['rank']}/{ok1['size']}",
            "pid_same": bool(ok0 and ok1 and ok0["pid"] == ok1["pid"] == procs[u].pid),
            "pid": procs[u].pid,
        }
        if result["outcome"] != "re-formed":          # why: the last lines the survivor printed (a traceback)
            out = open(os.path.join(folder, f"{u}.out"), errors="replace").read().splitlines()
            per[u]["out_tail"] = [line for line in out if line.strip()][-3:]
    result["survivors"] = per
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--kill", default="", help="the member to SIGKILL (default: the last)")
    ap.add_argument("--signal", choices=["KILL", "STOP"], default="KILL",
                    help="STOP: a hung peer (its sockets stay open, no reset: like a cut link)")
    ap.add_argument("--poll", action="store_true", help="members wait for collectives by polling (member.py)")
    ap.add_argument("--graveyard", action="store_true", help="members keep failed groups referenced (member.py)")
    ap.add_argument("--store", choices=["separate", "rank0"], default="separate")
    ap.add_argument("--membership", choices=["watch", "lease"], default="watch")
    ap.add_argument("--lease-timeout", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=20, help="the Gloo group's timeout")
    ap.add_argument("--sleep", type=float, default=0.01)
    ap.add_argument("--kill-after", type=float, default=1.0)
    ap.add_argument("--wait", type=float, default=45, help="how long to wait for the re-formed group")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--keep", help="a folder to keep the logs in (default: a temporary one)")
    args = ap.parse_args()
    args.kill = args.kill or f"w{args.members - 1}"
    if args.store == "rank0" and args.membership == "watch":
        ap.error("the death watch lives in the store process: use --membership lease with --store rank0")
    results = []
    for i in range(args.repeats):
        if args.keep:
            folder = os.path.join(args.keep, f"run{i}")
            os.makedirs(folder, exist_ok=True)
            r = one(args, folder)
        else:
            with tempfile.TemporaryDirectory(prefix="kill_reform-") as folder:
                r = one(args, folder)
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
