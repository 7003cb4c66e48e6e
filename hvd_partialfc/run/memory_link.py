"""Snapshot files between ranks over plain TCP: a rank's copy to its buddy, a recovering rank's fetch.

Why not the engine: a buddy copy is point-to-point and must not wait for the step (Horovod has no send/recv,
and a collective from a second thread would interleave with the step's); a fetch at recovery moves only the
files a rank needs (an all-gather would hand every rank every slice).

Each rank serves its node's snapshot folder (memory_store.NodeStore) on a port of the advertised address
(the heartbeat's). One request a connection: a header line of JSON, then the payload, then the answer.

* ``put`` (step, name, size, bytes): the server writes the file into the snapshot of ``step`` that is landing,
  then answers ``{"ok": true}``: the sender knows the copy is in the buddy's memory.
* ``get`` (step, name): the file's bytes from the node's snapshot of ``step``, committed or landing;
* ``note``: a small message for the rank's ``on_note`` (a landing told to rank 0, its commit told to a node).

Every request carries the run's token: a process of another run (a stale job on a shared node) is answered
with an error, never with a file. Forked children (DataLoader workers) close their copy of the listening
socket, so a dead rank's port closes with it.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import weakref
from typing import Tuple

from ..engine.heartbeat import advertised_address
from .memory_store import NodeStore

TIMEOUT_S = 300.0          # one file: 128 MB (a 31k-row slice with momentum, D 512) needs ~1 s at 1 Gb/s
_LIVE: "weakref.WeakSet[Link]" = weakref.WeakSet()


def _close_in_child() -> None:
    for link in list(_LIVE):
        try:
            link.server.close()
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class LinkError(RuntimeError):
    pass


def _recv_into(conn: socket.socket, n: int, f) -> None:
    got = 0
    while got < n:
        chunk = conn.recv(min(4 << 20, n - got))
        if not chunk:
            raise LinkError(f"connection closed after {got} of {n} bytes")
        f.write(chunk)
        got += len(chunk)


def _recv_line(conn: socket.socket, limit: int = 1 << 16) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        c = conn.recv(1)
        if not c:
            raise LinkError("connection closed before a header")
        buf += c
        if len(buf) > limit:
            raise LinkError("header too long")
    return json.loads(buf)


def _send_header(conn: socket.socket, header: dict) -> None:
    conn.sendall(json.dumps(header).encode() + b"\n")


class Link:
    """This rank's server (``serve``) and its requests to other ranks' servers (``put``, ``get``)."""

    def __init__(self, store: NodeStore, token: str):
        self.store, self.token = store, token
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.addr = advertised_address()
        try:
            self.server.bind((self.addr, 0))
        except OSError:
            self.server.bind(("0.0.0.0", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        self._closed = threading.Event()
        self.on_note = None        # called with a ``note``'s header (memory.py: landings, commits)
        _LIVE.add(self)
        threading.Thread(target=self._accept, daemon=True, name="memory-link").start()

    @property
    def address(self) -> Tuple[str, int]:
        return self.addr, self.port

    def close(self) -> None:
        self._closed.set()
        try:
            self.server.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="memory-link-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(TIMEOUT_S)
                h = _recv_line(conn)
                if h.get("token") != self.token:
                    _send_header(conn, {"ok": False, "error": "another run's request (token differs)"})
                    return
                if h["op"] == "put":     # streamed into the file: a copy never sits whole in this process
                    self.store.write(int(h["step"]), os.path.basename(h["name"]),
                                     lambda f: _recv_into(conn, int(h["size"]), f))
                    _send_header(conn, {"ok": True})
                elif h["op"] == "note":
                    _send_header(conn, {"ok": True})
                    if self.on_note is not None:
                        self.on_note(h)
                elif h["op"] == "get":
                    path = self.store.find(int(h["step"]), os.path.basename(h["name"]))
                    if path is None:
                        _send_header(conn, {"ok": False, "error": f"no {h['name']} of step {h['step']} here"})
                        return
                    with open(path, "rb") as f:
                        _send_header(conn, {"ok": True, "size": os.fstat(f.fileno()).st_size})
                        conn.sendfile(f)
                else:
                    _send_header(conn, {"ok": False, "error": f"unknown op {h.get('op')!r}"})
            except (OSError, LinkError, ValueError, KeyError) as e:
                try:
                    _send_header(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})
                except OSError:
                    pass

    def _request(self, peer: Tuple[str, int], header: dict, payload: str = "") -> Tuple[dict, socket.socket]:
        """One request; ``payload``: a file sent after the header (sendfile: no copy in this process)."""
        conn = socket.create_connection(tuple(peer), timeout=TIMEOUT_S)
        _send_header(conn, dict(header, token=self.token))
        if payload:
            with open(payload, "rb") as f:
                conn.sendfile(f)
        answer = _recv_line(conn)
        if not answer.get("ok"):
            conn.close()
            raise LinkError(f"{peer[0]}:{peer[1]}: {answer.get('error')}")
        return answer, conn

    def put(self, peer: Tuple[str, int], step: int, name: str, path: str) -> None:
        """File ``path`` into ``peer``'s node as ``name`` of the snapshot of ``step``; returns once it is written
        there."""
        _, conn = self._request(peer, {"op": "put", "step": step, "name": name, "size": os.path.getsize(path)}, path)
        conn.close()

    def note(self, peer: Tuple[str, int], **what) -> None:
        """A small message for ``peer``'s ``on_note`` (no payload)."""
        _, conn = self._request(peer, dict(what, op="note"))
        conn.close()

    def get(self, peer: Tuple[str, int], step: int, name: str, f) -> None:
        """File ``name`` of ``peer``'s node's snapshot of ``step``, written into the open binary file ``f``."""
        answer, conn = self._request(peer, {"op": "get", "step": step, "name": name})
        with conn:
            _recv_into(conn, int(answer["size"]), f)

