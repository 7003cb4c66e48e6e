"""Question 4: what torchrun's agents do to the surviving workers when one worker dies or an agent joins, i.e.
whether in-process recovery (member.py's) can live under torchrun at all.

    python -m scripts.studies.elastic_torch.torchrun_agents one-agent --max-restarts 0   # nproc 3 on one agent
    python -m scripts.studies.elastic_torch.torchrun_agents one-agent --max-restarts 1
    python -m scripts.studies.elastic_torch.torchrun_agents agents --max-restarts 0      # 3 agents x 1 worker, c10d
    python -m scripts.studies.elastic_torch.torchrun_agents agents --max-restarts 1
    python -m scripts.studies.elastic_torch.torchrun_agents agents-join                  # a 4th agent arrives

The workers are member.py (they re-form in-process through the study's own store process, named by
``STUDY_STORE``; torchrun's group and store are not used). Each worker logs its pid, its agent (ppid) and any
SIGTERM it receives. The scenarios kill one worker (``agents``: one whose agent does not host the rendezvous
store) or start one more agent, and report, for every worker: did it re-form in the same process, was it sent
SIGTERM by its agent, and how each agent ended. Bounded: everything left is killed after ``--observe`` seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .common import ROOT, read_logs, start_store, store_client, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(args, folder, name, nnodes, nproc, rdzv, watch, port, extra_env=None):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(args.max_restarts),
           "--monitor-interval", "0.5"]
    cmd += rdzv + ["-m", "scripts.studies.elastic_torch.member"]      # its options through the environment:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", STUDY_STORE=f"127.0.0.1:{port}",  # torchrun
               STUDY_WATCH=str(watch), STUDY_LOG=os.path.join(folder, "%u.jsonl"),       # takes --log as its own
               LOGLEVEL="INFO",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(extra_env or {}))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(os.path.join(folder, f"{name}.out"), "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def cleanup(agents, store_proc, folder) -> None:
    """Kill what is left: the agents, their workers (each in a session of its own), the store process."""
    for p in agents.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for pid in {r["pid"] for r in read_logs(folder) if r.get("uid")}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    store_proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["one-agent", "agents", "agents-join"])
    ap.add_argument("--max-restarts", type=int, default=0)
    ap.add_argument("--observe", type=float, default=15, help="seconds to watch after the event")
    ap.add_argument("--victim", choices=["other", "host"], default="other",
                    help="agents: kill the worker of an agent that does not host the rendezvous store, or the host's")
    ap.add_argument("--keep", help="a folder to keep the logs in")
    args = ap.parse_args()
    folder = args.keep or tempfile.mkdtemp(prefix="torchrun_agents-")
    os.makedirs(folder, exist_ok=True)
    store_proc, port, watch = start_store(folder)
    agents = {}
    rport = _free_port()
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rport}", "--rdzv-id", "study",
            "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    if args.scenario == "one-agent":
        agents["A0"] = agent(args, folder, "A0", "1", 3, ["--standalone"], watch, port)
        n = 3
    else:
        nnodes = "2:4" if args.scenario == "agents-join" else "2:3"
        agents["A0"] = agent(args, folder, "A0", nnodes, 1, rdzv, watch, port)   # first: hosts the rdzv store
        time.sleep(1.0)
        for a in ("A1", "A2"):
            agents[a] = agent(args, folder, a, nnodes, 1, rdzv, watch, port)
        n = 3

    def first_oks(gen=0):
        return {r["uid"]: r for r in read_logs(folder) if r["event"] == "first_ok" and r["gen"] == gen}
    try:
        wait_for(lambda: len(first_oks()) == n, 90, "the workers' first group")
    except TimeoutError:
        cleanup(agents, store_proc, folder)
        raise
    before = first_oks()
    agent_of = {u: next(a for a, p in agents.items() if p.pid == r["ppid"]) if args.scenario != "one-agent" else "A0"
                for u, r in ((u, next(x for x in read_logs(folder) if x.get("uid") == u and x["event"] == "start"))
                             for u in before)}
    time.sleep(1.0)
    t_event = time.time()
    if args.scenario == "agents-join":
        event = "agent A3 started"
        agents["A3"] = agent(args, folder, "A3", "2:4", 1, rdzv, watch, port)
    else:
        if args.scenario == "agents":
            victim = sorted(u for u in before if (agent_of[u] == "A0") == (args.victim == "host"))[-1]
        else:
            victim = "w2"
        event = f"SIGKILL {victim} (pid {before[victim]['pid']}, under {agent_of[victim]})"
        os.kill(before[victim]["pid"], signal.SIGKILL)
    time.sleep(args.observe)
    try:
        store_client("127.0.0.1", port).set("stop", "1")
    except Exception:
        pass
    time.sleep(3)
    ended = {a: p.poll() for a, p in agents.items()}
    cleanup(agents, store_proc, folder)
    logs = read_logs(folder)
    report = {"scenario": args.scenario, "max_restarts": args.max_restarts, "event": event,
              "agents_exit_after_observe": ended, "workers": {}}
    for u, r0 in before.items():
        mine = [r for r in logs if r.get("uid") == u]
        first = lambda ev: next((r for r in mine if r["event"] == ev and r["t"] > t_event), None)
        sig = [r for r in mine if r["event"] == "sigterm" and r["pid"] == r0["pid"]]
        reformed = [r for r in mine if r["event"] == "first_ok" and r["gen"] > 0 and r["pid"] == r0["pid"]]
        later = sorted({r["pid"] for r in mine if r["pid"] != r0["pid"]})
        report["workers"][u] = {
            "agent": agent_of[u], "pid": r0["pid"],
            "error_after_s": (lambda e: e and round(e["t"] - t_event, 3))(first("error")),
            "reformed_same_pid_after_s": reformed and round(reformed[0]["t"] - t_event, 3),
            "reformed_size": reformed and reformed[0]["size"],
            "sigterm_after_s": sig and round(sig[0]["t"] - t_event, 3),
            "ended_normally": any(r["event"] == "end" and r["pid"] == r0["pid"] for r in mine),
            "new_pids_for_this_rank": later}
    tails = {}
    for a in agents:
        lines = open(os.path.join(folder, f"{a}.out"), errors="replace").read().splitlines()
        tails[a] = [l for l in lines if any(k in l for k in ("restart", "Stopping", "closing signal", "failed",
                                                             "Detected", "Closed", "Error", "Waiting", "closed"))][-6:]
    report["agent_log_lines"] = tails
    print(json.dumps(report, indent=1))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
