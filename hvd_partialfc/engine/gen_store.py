"""The store process of the torch engine's generations (engine/generation.py): a process that trains nothing and
outlives the ranks, holding the keys through which the survivors of a lost rank agree who is left and form the
next group, and a death watch that writes a member's ``dead/ID`` key the moment its process ends.

Why a process of its own: the store must outlive any training process. Hosted by rank 0 (torchrun's way), rank
0's death took the store with it and both survivors failed at their next store call
(scripts/studies/elastic_torch/FINDINGS.md, "2b"). Its loss ends the in-process recovery: the ranks then exit
for a relaunch (generation.py).

Why a death watch: each member keeps one TCP connection to this process and says ``bye`` on it before a normal
end; a connection that closes without it is a process that died (the kernel closes a killed process's sockets
at once), so the others need not wait for a lease or a deadline: 25-75 ms from a kill to an agreed list in the
study, against 1 s with leases.

    python -m hvd_partialfc.engine.gen_store [--host 127.0.0.1] [--port 0]

prints ``store HOST:PORT`` once it listens (launch/torch_inprocess.py reads it), and ends with its parent.
"""
from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from datetime import timedelta

ENV = "HVD_PARTIALFC_GEN_STORE"   # HOST:PORT of this process's store, in each rank's environment
WATCH_KEY = "watch/port"      # where the death watch listens (the members read it from the store)
BYE = b"bye"


def dead_key(member: int) -> str:
    """The key the death watch writes when ``member``'s process ends without a goodbye."""
    return f"dead/{member}"


def _watch(conn: socket.socket, store) -> None:
    """One member's connection: its id first (a line), then nothing until it ends; no ``bye`` at the end: dead."""
    data = b""
    conn.settimeout(30)
    try:
        while b"\n" not in data:
            chunk = conn.recv(64)
            if not chunk:
                return
            data += chunk
        member, _, tail = data.partition(b"\n")
        conn.settimeout(None)
        while True:
            try:
                chunk = conn.recv(64)
            except OSError:
                chunk = b""
            if not chunk:
                break
            tail = (tail + chunk)[-8:]
        if BYE not in tail:
            store.set(dead_key(int(member)), f"{time.time():.3f}")
    except (OSError, ValueError):
        pass
    finally:
        conn.close()


def serve(host: str, port: int, announce=lambda address: print(f"store {address}", flush=True)) -> None:
    """The store (torch's TCPStore, served here) and the death watch; returns when the parent process is gone.
    ``announce(HOST:PORT)`` once both listen (a test serves them in a thread of its own process)."""
    import torch.distributed as dist
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    server = socket.create_server((host, 0))
    server.settimeout(1.0)
    store.set(WATCH_KEY, str(server.getsockname()[1]))
    parent = os.getppid()
    announce(f"{host}:{store.port}")
    while os.getppid() == parent:        # the launcher gone (killed): no store left behind
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        threading.Thread(target=_watch, args=(conn, store), daemon=True).start()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="the address the ranks reach this process at")
    p.add_argument("--port", type=int, default=0, help="the store's port (0: any free one, printed)")
    args = p.parse_args(argv)
    serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
