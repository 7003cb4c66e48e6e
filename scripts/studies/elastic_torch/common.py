"""Shared parts of the elastic_torch study (scripts/studies/elastic_torch/FINDINGS.md): JSON-line logs, starting
the study's processes, a store client, the liveness signals (a lease counter, a death-watch socket) and the
membership protocol that decides who forms the next generation of the group.

Membership (``agree``): every survivor of generation g-1 writes ``gen{g}/join/{uid}``, then waits until each
member of g-1 has either joined, or is *known dead*: a ``dead/{uid}`` key (written by the store process's death
watch the moment the member's socket closes: a killed process), or a lease counter that stopped moving for
``lease_timeout`` seconds (a hung process, a lost node: no reset ever arrives), or the agreement's deadline
passed. The first survivor to see nobody pending commits the list with ``compare_set`` (first writer wins), and
everyone takes the committed list; a member that finds itself not in it is fenced (it must leave). The
survivors keep their order, so the new ranks are the old ranks with the dead ones removed.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
PKG = "scripts.studies.elastic_torch"


class Log:
    """Append one JSON line per event: wall time (one machine: comparable across processes), pid, event."""

    def __init__(self, path: str, **tags):
        self.path, self.tags = path, tags

    def __call__(self, event: str, **kw) -> None:
        rec = {"t": time.time(), "pid": os.getpid(), "event": event, **self.tags, **kw}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def read_logs(folder: str) -> List[Dict]:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda r: r["t"])


def spawn(module: str, args: List[str], out: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """One of this folder's modules, run with ``python -m`` from the repository root, output to ``out``."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", f"{PKG}.{module}", *args], cwd=ROOT, env=e,
                            stdout=open(out, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


def start_store(folder: str, watch: bool = True):
    """The separate store process (store.py); returns (Popen, port, watch_port)."""
    port_file = os.path.join(folder, "store.json")
    p = spawn("store", ["--port-file", port_file] + (["--watch"] if watch else []), os.path.join(folder, "store.out"))
    wait_for(lambda: os.path.exists(port_file), 60, "the store process")
    info = json.load(open(port_file))
    return p, info["port"], info.get("watch")


def store_client(host: str, port: int, timeout_s: float = 30.0, master: bool = False):
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def start_lease(host: str, port: int, key: str, interval: float) -> threading.Event:
    """A thread with its own store connection that adds 1 to ``key`` (``lease/{uid}``) every ``interval`` seconds,
    until the returned event is set (then it joins: a thread left in a store call at the interpreter's exit is
    one suspect of the aborts at exit seen in FINDINGS.md)."""
    client, stop = store_client(host, port), threading.Event()

    def beat():
        while not stop.is_set():
            try:
                client.add(key, 1)
            except Exception:
                return
            stop.wait(interval)
    th = threading.Thread(target=beat, daemon=True, name="lease")
    th.start()
    stop.join = lambda: (stop.set(), th.join(5))      # type: ignore[attr-defined]
    return stop


def open_watch(host: str, watch_port: int, key: str) -> socket.socket:
    """A connection to the store process's death watch: when this process dies the kernel closes it, and the
    store process writes ``key`` (``dead/{uid}``)."""
    s = socket.create_connection((host, watch_port), timeout=10)
    s.sendall(key.encode() + b"\n")
    return s


class Liveness:
    """Whether a member is known dead: its ``dead/`` key (the death watch), or a lease counter that has not moved
    for ``lease_timeout`` seconds as seen from here (no clocks compared across machines)."""

    def __init__(self, store, lease_timeout: float):
        self.store, self.lease_timeout, self.seen = store, lease_timeout, {}

    def dead(self, m: str) -> Optional[str]:
        if self.store.check([f"dead/{m}"]):
            return "death watch"
        v = self.store.add(f"lease/{m}", 0)
        if m not in self.seen or self.seen[m][0] != v:
            self.seen[m] = (v, time.monotonic())
        elif time.monotonic() - self.seen[m][1] > self.lease_timeout:
            return "lease"
        return None


def agree(store, gen: int, uid: str, old: List[str], lease_timeout: float, deadline_s: float,
          poll: float = 0.005, live: Optional[Liveness] = None) -> Dict:
    """The members of generation ``gen`` (see the module's docstring). Returns {"members", "why"}: ``why`` says,
    for each member of ``old`` left out, how it was known dead. ``live``: the member's Liveness, whose lease
    observations carry over (else the leases are watched from now)."""
    key = f"gen{gen}/members"
    store.set(f"gen{gen}/join/{uid}", "1")
    live = live or Liveness(store, lease_timeout)
    why: Dict[str, str] = {}
    end = time.monotonic() + deadline_s
    while not store.check([key]):
        pending = []
        for m in old:
            if m == uid or store.check([f"gen{gen}/join/{m}"]):
                continue
            reason = live.dead(m)
            if reason:
                why[m] = reason
                continue
            if time.monotonic() > end:
                why[m] = "deadline"
                continue
            pending.append(m)
        if not pending:
            joined = [m for m in old if store.check([f"gen{gen}/join/{m}"])]
            store.compare_set(key, "", json.dumps(joined))
            break
        time.sleep(poll)
    return {"members": json.loads(store.get(key).decode()), "why": why}


def resources() -> Dict:
    """This process's RSS (MiB), threads, open fds and TCP sockets."""
    import psutil
    p = psutil.Process()
    return {"rss_mib": round(p.memory_info().rss / 2 ** 20, 1), "threads": p.num_threads(), "fds": p.num_fds(),
            "tcp": len(p.net_connections(kind="tcp"))}
