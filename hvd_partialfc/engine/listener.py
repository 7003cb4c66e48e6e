"""Accepting connections on a port that anyone on the network can reach: a bounded, timed handshake first.

Why: a listening socket of a training job is open to every process that can reach the host, including other
users of a shared node. The first listeners here gave each connection a thread and up to 300 s to send its
header, ended their accept loop for good on any OSError (EMFILE, when a flood used up the file descriptors),
and printed a traceback for a header such as ``[]``: a stranger with no secret could stop every buddy copy
of the memory snapshots, or stall the heartbeat ring's start, by opening connections and saying nothing.

How (``serve``): one thread multiplexes every connection still in its handshake (``selectors``). Each is
greeted (``greet``: the caller's challenge, a nonce), must send its hello (a line, or ``hello_len`` bytes)
within ``handshake_s`` seconds and ``max_bytes`` bytes, and is handed to ``ready`` only when ``check``
accepts it; anything else is closed without a word. At most ``max_pending`` handshakes are open at a time:
a new connection beyond that closes the oldest one, so a legitimate peer, which completes its handshake in
a millisecond, is never queued behind a flood of idle connections (they are dropped in arrival order). An
error of ``accept`` (no file descriptor left) closes the oldest handshake and goes on after a pause; only
``stopped()`` or the ``deadline`` end the loop. Not a collective; no Horovod.
"""
from __future__ import annotations

import selectors
import socket
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Tuple

HANDSHAKE_S = 5.0       # a peer of the job answers in milliseconds; a stranger's connection costs at most this
MAX_PENDING = 64        # handshakes open at once; a flood evicts its own oldest connections, never a peer's
POLL_S = 0.2            # how often ``stopped`` is asked while nothing happens


def serve(server: socket.socket, check: Callable[[Any, bytes], Any], ready: Callable[[socket.socket, Any, bytes], bool],
          stopped: Callable[[], bool], greet: Optional[Callable[[], Tuple[bytes, Any]]] = None,
          hello_len: Optional[int] = None, deadline: Optional[float] = None, handshake_s: float = HANDSHAKE_S,
          max_pending: int = MAX_PENDING, max_bytes: int = 4096) -> None:
    """Accept on ``server`` until ``stopped()`` or ``deadline`` (``time.monotonic``), or until ``ready`` returns
    True. ``greet()``: (bytes sent to each new connection, its state); ``check(state, hello)``: what the hello
    proves (None: a stranger, closed); ``ready(conn, accepted, rest)``: the connection, blocking again, the
    accepted object and the bytes that came after the hello (a payload's start)."""
    sel = selectors.DefaultSelector()
    pending: "OrderedDict[socket.socket, list]" = OrderedDict()     # conn -> [state, bytes so far, expiry]

    def drop(conn: socket.socket) -> None:
        pending.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ)
    try:
        while not stopped():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            for conn in [c for c, p in pending.items() if p[2] <= now]:
                drop(conn)
            wake = min([now + POLL_S] + [p[2] for p in pending.values()] + ([deadline] if deadline else []))
            try:
                events = sel.select(max(0.0, wake - now))
            except OSError:           # the server socket was closed under us (stopping)
                if stopped():
                    return
                time.sleep(POLL_S)
                continue
            for key, _ in events:
                if key.fileobj is server:
                    if not _accept(server, sel, pending, drop, greet, handshake_s, max_pending):
                        return
                    continue
                conn = key.fileobj
                if conn not in pending:       # evicted by an accept of this same round
                    continue
                if _handshake(conn, sel, pending, drop, check, ready, hello_len, max_bytes):
                    return
    finally:
        for conn in list(pending):
            drop(conn)
        sel.close()


def _accept(server, sel, pending, drop, greet, handshake_s: float, max_pending: int) -> bool:
    """Take every connection waiting on ``server``; False once the server is closed."""
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return True
        except OSError:
            if server.fileno() < 0:
                return False
            if pending:           # out of file descriptors (EMFILE) or buffers: free the oldest handshake
                drop(next(iter(pending)))
            time.sleep(0.05)
            return True
        conn.setblocking(False)
        if len(pending) >= max_pending:
            drop(next(iter(pending)))
        greeting, state = greet() if greet else (b"", None)
        try:
            if greeting and conn.send(greeting) != len(greeting):
                raise OSError("greeting not sent whole")
        except OSError:
            conn.close()
            continue
        pending[conn] = [state, b"", time.monotonic() + handshake_s]
        sel.register(conn, selectors.EVENT_READ)


def _handshake(conn, sel, pending, drop, check, ready, hello_len: Optional[int], max_bytes: int) -> bool:
    """One readable connection in its handshake: more of its hello; once whole, ``check``-ed and handed to
    ``ready`` blocking again, or closed as a stranger's. True when ``ready`` ends the loop."""
    hello = _read(conn, pending[conn], hello_len, max_bytes)
    if hello is None:
        return False
    if hello is False:
        drop(conn)
        return False
    state = pending[conn][0]
    rest = pending[conn][1][len(hello):]
    pending.pop(conn)
    sel.unregister(conn)
    try:
        accepted = check(state, hello)
    except Exception:  # noqa: BLE001 (a malformed hello is a stranger's)
        accepted = None
    if accepted is None:
        conn.close()
        return False
    conn.setblocking(True)
    return bool(ready(conn, accepted, rest))


def _read(conn: socket.socket, entry: list, hello_len: Optional[int], max_bytes: int):
    """More of ``conn``'s hello: the hello's bytes once whole, None while it is not, False for a connection to
    drop (closed, failed, or over ``max_bytes`` without its end)."""
    try:
        data = conn.recv(max_bytes + 1 - len(entry[1]) if hello_len is None else max(1, hello_len - len(entry[1])))
    except BlockingIOError:
        return None
    except OSError:
        return False
    if not data:
        return False
    entry[1] += data
    buf = entry[1]
    if hello_len is not None:
        return buf[:hello_len] if len(buf) >= hello_len else None
    end = buf.find(b"\n")
    if end >= 0:
        return buf[:end + 1]
    return False if len(buf) > max_bytes else None
