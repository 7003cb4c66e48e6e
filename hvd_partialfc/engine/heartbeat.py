"""A heartbeat between ranks, so a cut link or a lost node ends the job in seconds, naming the lost peer.

Why: after a link is cut no connection reset arrives. A rank waiting in a collective then waits for the
transport's own timeout: Gloo's default is 30 minutes, Open MPI's TCP about 15 (on the two-node harness,
scripts/faults/twonode.py, a Gloo all-reduce loop cut mid-run made no progress and raised nothing in the 10 s
watched). A collective timeout under a minute is no cure: it would kill healthy runs while rank 0
evaluates or writes a large checkpoint and the others wait.

How: the ranks form a ring. Each rank keeps one TCP connection to the next rank, on which a background
thread sends a byte every ``timeout / 10`` seconds, and one from the previous rank, which another thread
watches. The threads beat whatever the main thread does (a long evaluation, a checkpoint write, a step),
so a busy rank is never taken for a lost one. A rank that hears nothing for ``timeout`` seconds, or whose
neighbour's connection closes without a goodbye (a killed process: the kernel closes it at once), prints

    [rank 2] error: lost peer rank 1 (node1, 10.77.0.1): no heartbeat for 20.0 s; ending this rank

and exits at once (exit code 1, ``EXIT_LOST_PEER``). Its own connection then closes, so its next neighbour
ends too, and so round the ring: every rank ends within one timeout of the cut on each side of it. A rank
that ends normally, stops on a signal or ends by an error every rank raised (``base.agreed``) says goodbye
first and is not mourned; after an error of its own it closes its connection without one (``end``), so its
neighbour ends at once instead of waiting for it in a collective (before, any exception said goodbye).

No forked child keeps the sockets: a DataLoader worker forked after the ring was up held a copy of them,
so a killed rank's connection stayed open until its workers noticed their parent's death (seconds), and
round the ring those seconds added up; every child closes its copies right after the fork
(``forking.close_sockets_in_child``). The listening socket binds the advertised address only, and takes only the
neighbour that presents the job's token (drawn by rank 0, shared with the addresses) and its rank: a stray
connection (a port scan, another job) is closed and the wait goes on; a flood of idle connections costs the
ring nothing (engine/listener.py: each has 5 s to say its hello, and a flood closes only its own). The
listener answers the neighbour's hello with one byte, and the connecting rank waits for it: a connection
closed before its hello was read (a flood of another user's, a listener that gave up) is opened again, where
before the rank took it for its link and ended at its first beat, failing the start.

The address a rank advertises is the one its peers can reach: the IPv4 address of ``GLOO_SOCKET_IFNAME``
(or ``HOROVOD_GLOO_IFACE``) when set, else the local address of the route to the rendezvous host
(``MASTER_ADDR``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``), else the host name's; ``HVD_PARTIALFC_HEARTBEAT_ADDR``
overrides all. Cost: one byte a rank every timeout / 10 seconds (2 s by default).
"""
from __future__ import annotations

import fcntl
import os
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Callable, List, NamedTuple, Optional

from ..forking import close_sockets_in_child
from .listener import serve

EXIT_LOST_PEER = 1
_BEAT, _BYE = b"B", b"E"
_TAKEN = b"T"                               # the listener took the neighbour's connection (its only word)
_TAKEN_S = 10.0                             # how long a connecting rank waits for it before it connects again
_HELLO = b"hvd_partialfc-heartbeat"
_HELLO_LEN = len(_HELLO) + 32 + 8          # the tag, the job's token (32 hex digits), the rank (8 digits)
_LIVE: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()
close_sockets_in_child(_LIVE, lambda hb: hb.sockets())     # a child's copies; the parent's stay open


def _iface_address(name: str) -> Optional[str]:
    """IPv4 address of the network interface ``name`` (Linux ``SIOCGIFADDR``), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def _route_address(host: str) -> Optional[str]:
    """This host's address on the route to ``host`` (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def advertised_address() -> str:
    env = os.environ
    if env.get("HVD_PARTIALFC_HEARTBEAT_ADDR"):
        return env["HVD_PARTIALFC_HEARTBEAT_ADDR"]
    for var in ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"):
        if env.get(var):
            addr = _iface_address(env[var].split(",")[0])
            if addr:
                return addr
    for var in ("MASTER_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR"):
        if env.get(var):
            addr = _route_address(env[var])
            if addr:
                return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class RingPeer(NamedTuple):
    """A rank of the ring as every other knows it: its host name, where it listens, and the job's token (rank 0's;
    the others send an empty one)."""

    host: str
    address: str
    port: int
    token: str


class Heartbeat:
    """The ring heartbeat of one rank (see the module's docstring). ``start`` is a collective."""

    def __init__(self, rank: int, size: int, timeout_s: float):
        self.rank, self.size, self.timeout = rank, size, float(timeout_s)
        self.interval = max(0.05, self.timeout / 10)
        self._out: Optional[socket.socket] = None
        self._in: Optional[socket.socket] = None
        self._server: Optional[socket.socket] = None
        self._stopped = threading.Event()
        self.peers: List[RingPeer] = []
        self.token = ""
        # set once the ring is up (``start``'s ``on_lost``): called instead of exiting when a peer is lost
        self.on_lost: Optional[Callable[[], None]] = None
        self.lost: Optional[str] = None          # which peer, and why, once one was lost (with on_lost)
        self._lock = threading.Lock()
        _LIVE.add(self)

    def sockets(self) -> List[socket.socket]:
        """This rank's heartbeat sockets (the listening one while the ring forms, then both connections)."""
        return [s for s in (self._server, self._out, self._in) if s is not None]

    @classmethod
    def start(cls, comm, timeout_s: float, on_lost: Optional[Callable[[], None]] = None) -> Optional["Heartbeat"]:
        """Join the ring over ``comm`` (its addresses are all-gathered); None at one rank or when off.
        ``on_lost``: once the ring is up, a lost peer calls it (once) and the rank goes on (the group re-forms
        in this process: cli_train.py), instead of exiting; ``lost`` then says which peer and why."""
        if comm.size == 1 or timeout_s <= 0:
            return None
        hb = cls(comm.rank, comm.size, timeout_s)
        addr = advertised_address()
        hb._server = server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((addr, 0))          # the address the peers are told, not every interface
        except OSError:                     # not this host's (a NAT's, a name's): every interface, the token decides
            server.bind(("0.0.0.0", 0))
        server.listen(128)                 # a stranger's burst queues beside the neighbour, not in its place
        token = secrets.token_hex(16) if comm.rank == 0 else ""
        hb.peers = [RingPeer(*p) for p in comm.allgather_object(
            (socket.gethostname(), addr, server.getsockname()[1], token), name="heartbeat.addresses")]
        hb.token = hb.peers[0].token
        accepted = []
        acceptor = threading.Thread(target=lambda: accepted.append(hb._accept(server, time.monotonic() + 60)),
                                    daemon=True)
        acceptor.start()
        hb._out = hb._connect(hb.peers[(hb.rank + 1) % hb.size])
        # beat as soon as the next rank is connected: it may watch already while this rank waits for its own
        # previous one (behind a stray connection, say)
        threading.Thread(target=hb._send, daemon=True, name="heartbeat-send").start()
        acceptor.join(timeout=65)
        hb._server = None
        server.close()
        if not accepted or accepted[0] is None:
            hb._lost((hb.rank - 1) % hb.size, "it never connected")
        hb._in = accepted[0]
        hb.on_lost = on_lost
        threading.Thread(target=hb._watch, args=(accepted[0],), daemon=True, name="heartbeat-watch").start()
        return hb

    def _hello(self, rank: int) -> bytes:
        return _HELLO + self.token.encode() + b"%08d" % rank

    def _accept(self, server: socket.socket, deadline: float) -> Optional[socket.socket]:
        """The previous rank's connection: the first one that presents the job's token and that rank; any other
        is closed (a stray connection, a port scan or a flood of idle ones is never taken for the neighbour,
        nor waited on: listener.py). None at the deadline."""
        want, got = self._hello((self.rank - 1) % self.size), []

        def ready(conn, accepted, rest):
            try:
                conn.sendall(_TAKEN)
            except OSError:               # gone before it heard: it connects again
                conn.close()
                return False
            got.append(conn)
            return True
        serve(server, check=lambda state, hello: True if hello == want else None, ready=ready,
              stopped=lambda: False, hello_len=_HELLO_LEN, deadline=deadline)
        return got[0] if got else None

    def _connect(self, peer: RingPeer) -> socket.socket:
        deadline = time.monotonic() + 60
        while True:
            s = None
            try:
                s = socket.create_connection((peer.address, peer.port), timeout=5)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(self._hello(self.rank))
                s.settimeout(_TAKEN_S)
                if s.recv(1) != _TAKEN:      # closed unheard (a flood's, a listener that gave up): again
                    raise ConnectionResetError("closed before the next rank took it")
                s.settimeout(5)
                return s
            except OSError as e:
                if s is not None:
                    s.close()
                if time.monotonic() > deadline:
                    self._lost((self.rank + 1) % self.size, f"cannot connect: {e}")
                time.sleep(0.2)

    def _send(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self._out.sendall(_BEAT)
            except OSError as e:
                if not self._stopped.is_set():
                    self._lost((self.rank + 1) % self.size, f"its connection failed ({e})")
                return

    def _watch(self, conn: socket.socket) -> None:
        prev = (self.rank - 1) % self.size
        conn.settimeout(self.timeout)
        while True:
            try:
                data = conn.recv(64)
            except socket.timeout:
                data, why = None, f"no heartbeat for {self.timeout:g} s"
            except OSError as e:
                data, why = None, f"its connection failed ({e})"
            else:
                why = "its process ended without a goodbye (killed?)"
            if data and _BYE in data:
                return                            # the previous rank ended normally
            if not data:
                if not self._stopped.is_set():
                    self._lost(prev, why)
                return

    def _lost(self, peer: int, why: str) -> None:
        host, addr = (self.peers[peer].host, self.peers[peer].address) if self.peers else ("?", "?")
        if self.on_lost is not None:      # the group re-forms in this process (cli_train.py): leave it, do not exit
            with self._lock:
                first, self.lost = self.lost is None, self.lost or f"lost peer rank {peer} ({host}, {addr}): {why}"
            if first:
                sys.stderr.write(f"[rank {self.rank}] {self.lost}; leaving the group to re-form it in this "
                                 "process\n")
                sys.stderr.flush()
                self.on_lost()
            return
        sys.stderr.write(f"[rank {self.rank}] error: lost peer rank {peer} ({host}, {addr}): {why}; "
                         "ending this rank (train.heartbeat_timeout)\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_LOST_PEER)

    def stop(self) -> None:
        """Say goodbye to the next rank and stop (this rank ends normally or by an agreed error)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self._out.sendall(_BYE)
            self._out.close()
        except OSError:
            pass

    def abandon(self) -> None:
        """Stop without a goodbye: the next rank sees the connection close and ends, naming this rank (an error
        of this rank alone: the others must not wait for it in their next collective)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for conn in (self._out, self._in if self.on_lost is not None else None):   # re-forming: both go
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except (OSError, AttributeError):
                pass

    def end(self, error: Optional[BaseException] = None) -> None:
        """How this rank leaves the ring: a goodbye after a normal end or an error every rank raised
        (``base.agreed``), none after its own error (``abandon``)."""
        from .base import agreed
        if error is None or agreed(error):
            self.stop()
        else:
            self.abandon()
