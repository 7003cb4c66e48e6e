"""Question 3 (and 5 under failures): a newcomer joins a running group without stopping it; then cycles of
"kill the newest member, the others re-form smaller; start a new one, everyone re-forms larger".

    python -m scripts.studies.elastic_torch.join --members 2 --cycles 0       # one join: 2 -> 3
    python -m scripts.studies.elastic_torch.join --members 2 --cycles 10      # then 10 x (kill -> 2, join -> 3)

The newcomer (member.py --join) imports torch and connects to the store while the group goes on all-reducing;
it then adds itself to ``joiners/`` in the store. The group's rank 0 reads the count every iteration and puts it
in the all_reduce, so every member sees it in the same iteration and re-forms right after it (the agreed
iteration); the newcomer learns its generation from the store. Reported: the newcomer's start-up (torch's import,
the store connection), and each member's pause: its last all_reduce at the old size to its first at the new size.
With cycles, w0's RSS, threads, fds and TCP sockets at each re-form (question 5 with real failures).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time

from .common import read_logs, spawn, start_store, store_client, wait_for


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--cycles", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.01)
    ap.add_argument("--json")
    ap.add_argument("--keep", help="a folder to keep the logs in")
    args = ap.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="join-")
    os.makedirs(folder, exist_ok=True)
    store_proc, port, watch = start_store(folder)
    uids = [f"w{r}" for r in range(args.members)]
    common = ["--store", f"127.0.0.1:{port}", "--watch-port", str(watch), "--sleep", str(args.sleep)]
    procs = {u: spawn("member", common + ["--uid", u, "--members", ",".join(uids),
                                          "--log", os.path.join(folder, f"{u}.jsonl")],
                      os.path.join(folder, f"{u}.out")) for u in uids}

    def formed(gen_min: int, size: int):
        """The members that logged first_ok in a generation >= gen_min at ``size``: {uid: record}."""
        return {r["uid"]: r for r in read_logs(folder) if r["event"] == "first_ok" and r["gen"] >= gen_min
                and r["size"] == size}
    wait_for(lambda: len(formed(0, args.members)) == args.members, 90, "generation 0")
    gen, events = 0, []
    live = list(uids)

    def add(name: str) -> dict:
        nonlocal gen
        time.sleep(1.0)
        t_spawn = time.time()
        procs[name] = spawn("member", common + ["--uid", name, "--join", "--log", os.path.join(folder, f"{name}.jsonl")],
                            os.path.join(folder, f"{name}.out"))
        live.append(name)
        wait_for(lambda: set(formed(gen + 1, len(live))) >= set(live), 60, f"{name} joined")
        logs = read_logs(folder)
        new = formed(gen + 1, len(live))
        gen = max(r["gen"] for r in new.values())
        start = next(r for r in logs if r.get("uid") == name and r["event"] == "start")
        req = next(r for r in logs if r.get("uid") == name and r["event"] == "join_request")
        pauses = {}
        for u in live[:-1]:
            sw = [r for r in logs if r.get("uid") == u and r["event"] == "switch" and r["gen"] == gen]
            pauses[u] = round(new[u]["t"] - sw[-1]["last_ok"], 3) if sw else None
        return {"what": f"join {name}", "size": len(live), "gen": gen,
                "newcomer_import_s": round(start["import_s"], 2), "newcomer_connect_s": round(start["connect_s"], 3),
                "spawn_to_request_s": round(req["t"] - t_spawn, 2), "request_to_formed_s": round(new[name]["t"] - req["t"], 3),
                "pause_s": pauses, "w0": new["w0"]["res"], "pids_same": all(new[u]["pid"] == procs[u].pid for u in live)}

    def kill(name: str) -> dict:
        nonlocal gen
        time.sleep(1.0)
        t_kill = time.time()
        os.kill(procs[name].pid, signal.SIGKILL)
        live.remove(name)
        wait_for(lambda: set(formed(gen + 1, len(live))) >= set(live), 60, f"re-formed without {name}")
        new = formed(gen + 1, len(live))
        gen = max(r["gen"] for r in new.values())
        return {"what": f"kill {name}", "size": len(live), "gen": gen,
                "first_ok_after_s": {u: round(new[u]["t"] - t_kill, 3) for u in live}, "w0": new["w0"]["res"],
                "pids_same": all(new[u]["pid"] == procs[u].pid for u in live)}

    try:
        events.append({"what": "start", "size": len(live), "gen": 0, "w0": formed(0, args.members)["w0"]["res"]})
        events.append(add("j0"))
        print(json.dumps(events[-1]), flush=True)
        for c in range(args.cycles):
            events.append(kill(live[-1]))
            print(json.dumps(events[-1]), flush=True)
            events.append(add(f"j{c + 1}"))
            print(json.dumps(events[-1]), flush=True)
        time.sleep(0.5)
        store_client("127.0.0.1", port).set("stop", "1")
        wait_for(lambda: all(procs[u].poll() is not None for u in live), 30, "the members' exit")
        end = [r for r in read_logs(folder) if r["event"] == "end" and r.get("uid") == "w0"]
        if end:
            events.append({"what": "end", "w0": end[-1]["res"]})
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        store_proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(events, f, indent=1)


if __name__ == "__main__":
    main()
