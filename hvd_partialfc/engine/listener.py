"""Accepting connections on a port that anyone on the network can reach: a bounded, timed handshake first.

Why: a listening socket of a training job is open to every process that can reach the host, including other
users of a shared node. The first listeners here gave each connection a thread and up to 300 s to send its
header, ended their accept loop for good on any OSError (EMFILE, when a flood used up the file descriptors),
and printed a traceback for a header such as ``[]``. The next one multiplexed the handshakes but took every
queued connection before it read any hello, and past 64 closed the oldest whoever had opened it: a stranger who
kept the queue full closed the ranks' own connections before their hellos were read (signed requests fell from
805 to 22 a second, some failed all their tries) and kept the server thread busy all the while.

How (``serve``): one thread multiplexes every connection still in its handshake (``selectors``). Each is
greeted (``greet``: the caller's challenge, a nonce), must send its hello (a line, or ``hello_len`` bytes)
within ``handshake_s`` seconds and ``max_bytes`` bytes, and is handed to ``ready`` only when ``check``
accepts it; anything else is closed without a word (a reset). Each round reads every hello that arrived
before it takes at most ``ACCEPT_BURST`` new connections from the queue, so a flood cannot keep the loop from
the hellos, and the loop sleeps in ``select`` whenever nothing is there (no polling faster than ``POLL_S``).

Who may hold a handshake slot: connections are counted by their source, the peer's address and, for a peer on
this host, the user who owns its socket (engine/peer_owner.py: a stranger on the node and a rank share the
address). One source holds at most ``per_source`` handshakes, all sources ``max_pending``: a new connection
beyond its source's share closes that source's own oldest, beyond the total the oldest of the source that holds
the most. A flood thus closes only its own connections, never those of a rank on another host or of another
user, and a connection that proved itself (``check``) has left the handshakes and is never closed for one that
has not. An error of ``accept`` (no file descriptor left) closes the oldest handshake of the largest source and
goes on; only ``stopped()`` or the ``deadline`` end the loop. Not a collective; no Horovod.
"""
from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Tuple

from .peer_owner import PeerOwners

HANDSHAKE_S = 5.0       # a peer of the job answers in milliseconds; a stranger's connection costs at most this
MAX_PENDING = 64        # handshakes open at once, all sources together
PER_SOURCE = 16         # handshakes open at once from one address (and user, on this host)
ACCEPT_BURST = 16       # connections taken from the queue between two readings of the hellos
POLL_S = 0.2            # how often ``stopped`` is asked while nothing happens
_RESET = struct.pack("ii", 1, 0)    # SO_LINGER on, 0 s: a closed stranger's connection leaves no TIME_WAIT


class _Handshakes:
    """The connections in their handshake: in arrival order (their expiries are too), and by source."""

    def __init__(self, sel: selectors.BaseSelector):
        self.sel = sel
        self.conns: "OrderedDict[socket.socket, list]" = OrderedDict()  # conn -> [state, bytes, expiry, source]
        self.by_source: Dict[Any, "OrderedDict[socket.socket, None]"] = {}

    def add(self, conn: socket.socket, source, state, expiry: float) -> None:
        self.conns[conn] = [state, b"", expiry, source]
        self.by_source.setdefault(source, OrderedDict())[conn] = None
        self.sel.register(conn, selectors.EVENT_READ)

    def take(self, conn: socket.socket) -> list:
        """``conn`` out of the handshakes (its hello read, or to close); its entry."""
        entry = self.conns.pop(conn)
        mine = self.by_source[entry[3]]
        del mine[conn]
        if not mine:
            del self.by_source[entry[3]]
        self.sel.unregister(conn)
        return entry

    def drop(self, conn: socket.socket) -> None:
        self.take(conn)
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            pass
        conn.close()

    def expire(self, now: float) -> None:
        while self.conns:
            conn, entry = next(iter(self.conns.items()))
            if entry[2] > now:
                return
            self.drop(conn)

    def make_room(self, source, per_source: int, max_pending: int) -> None:
        """Room for one more of ``source``: its own oldest closed at its share, else the largest source's
        oldest at the total."""
        mine = self.by_source.get(source)
        if mine is not None and len(mine) >= per_source:
            self.drop(next(iter(mine)))
        elif len(self.conns) >= max_pending:
            self.drop_one()

    def drop_one(self) -> None:
        if self.by_source:
            self.drop(next(iter(max(self.by_source.values(), key=len))))


def serve(server: socket.socket, check: Callable[[Any, bytes], Any], ready: Callable[[socket.socket, Any, bytes], bool],
          stopped: Callable[[], bool], greet: Optional[Callable[[], Tuple[bytes, Any]]] = None,
          hello_len: Optional[int] = None, deadline: Optional[float] = None, handshake_s: float = HANDSHAKE_S,
          max_pending: int = MAX_PENDING, per_source: int = PER_SOURCE, max_bytes: int = 4096) -> None:
    """Accept on ``server`` until ``stopped()`` or ``deadline`` (``time.monotonic``), or until ``ready`` returns
    True. ``greet()``: (bytes sent to each new connection, its state); ``check(state, hello)``: what the hello
    proves (None: a stranger, closed); ``ready(conn, accepted, rest)``: the connection, blocking again, the
    accepted object and the bytes that came after the hello (a payload's start)."""
    sel = selectors.DefaultSelector()
    shakes = _Handshakes(sel)
    owners = PeerOwners()
    server.setblocking(False)
    sel.register(server, selectors.EVENT_READ)
    try:
        while not stopped():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            shakes.expire(now)
            oldest = next(iter(shakes.conns.values()), None)
            wake = min([now + POLL_S] + ([oldest[2]] if oldest else []) + ([deadline] if deadline else []))
            try:
                events = sel.select(max(0.0, wake - now))
            except OSError:           # the server socket was closed under us (stopping)
                if stopped():
                    return
                time.sleep(POLL_S)
                continue
            incoming = False
            for key, _ in events:     # the hellos first
                if key.fileobj is server:
                    incoming = True
                elif key.fileobj in shakes.conns and _handshake(key.fileobj, shakes, check, ready, hello_len,
                                                                max_bytes):
                    return
            if incoming and not _accept(server, shakes, owners, greet, handshake_s, max_pending, per_source):
                return
    finally:
        for conn in list(shakes.conns):
            shakes.drop(conn)
        sel.close()
        owners.close()


def _accept(server, shakes: _Handshakes, owners: PeerOwners, greet, handshake_s: float, max_pending: int,
            per_source: int) -> bool:
    """At most ``ACCEPT_BURST`` connections from ``server``'s queue; False once the server is closed."""
    for _ in range(ACCEPT_BURST):
        try:
            conn, peer = server.accept()
        except BlockingIOError:
            return True
        except OSError:
            if server.fileno() < 0:
                return False
            if shakes.conns:      # out of file descriptors (EMFILE) or buffers: free the largest source's oldest
                shakes.drop_one()
            else:
                time.sleep(0.05)
            return True
        conn.setblocking(False)
        source = (peer[0], owners.uid(conn))
        shakes.make_room(source, per_source, max_pending)
        greeting, state = greet() if greet else (b"", None)
        try:
            if greeting and conn.send(greeting) != len(greeting):
                raise OSError("greeting not sent whole")
        except OSError:
            conn.close()
            continue
        shakes.add(conn, source, state, time.monotonic() + handshake_s)
    return True


def _handshake(conn, shakes: _Handshakes, check, ready, hello_len: Optional[int], max_bytes: int) -> bool:
    """One readable connection in its handshake: more of its hello; once whole, ``check``-ed and handed to
    ``ready`` blocking again, or closed as a stranger's. True when ``ready`` ends the loop."""
    hello = _read(conn, shakes.conns[conn], hello_len, max_bytes)
    if hello is None:
        return False
    if hello is False:
        shakes.drop(conn)
        return False
    state, buf, _, _ = shakes.take(conn)
    rest = buf[len(hello):]
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
