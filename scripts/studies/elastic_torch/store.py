"""The study's store process: a TCPStore server that no training process hosts, and a death watch.

    python -m scripts.studies.elastic_torch.store --port-file store.json [--watch]

Why a process of its own: a store hosted by a training process dies with it, and the survivors then have
nothing to re-form through (kill_reform.py --store rank0 --kill w0 shows it). This one does no training, so it
is the least likely process to die; it is still a single point of failure.

The death watch (``--watch``): each member keeps one TCP connection open to it, sending once the key that
announces its death (``dead/{uid}``, under the member's prefix). When a member dies the kernel closes its socket
at once, and this process writes that key into the store: the
survivors know who is gone in milliseconds instead of a lease timeout. A member ending normally says ``bye``
first. Writes ``{"port": ..., "watch": ...}`` to the port file when ready; runs until killed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time

from .common import Log, store_client


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--watch", action="store_true")
    args = ap.parse_args()
    log = Log(os.path.join(os.path.dirname(os.path.abspath(args.port_file)), "store.jsonl"), who="store")
    server = store_client("127.0.0.1", 0, master=True)          # port 0: the kernel picks one
    info = {"port": server.port}
    if args.watch:
        client, lock = store_client("127.0.0.1", server.port), threading.Lock()
        lsock = socket.socket()
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(64)
        info["watch"] = lsock.getsockname()[1]

        def watch(conn: socket.socket) -> None:
            data = b""
            while b"\n" not in data:
                chunk = conn.recv(64)
                if not chunk:
                    return
                data += chunk
            key, rest = data.split(b"\n", 1)
            key = key.decode()
            while b"bye" not in rest:
                try:
                    chunk = conn.recv(64)
                except OSError:
                    chunk = b""
                if not chunk:
                    with lock:
                        client.set(key, str(time.time()))
                    log("dead", key=key)
                    return
                rest += chunk

        def accept() -> None:
            while True:
                conn, _ = lsock.accept()
                threading.Thread(target=watch, args=(conn,), daemon=True).start()
        threading.Thread(target=accept, daemon=True).start()
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, args.port_file)
    log("ready", **info)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
