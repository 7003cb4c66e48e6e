"""A heartbeat between ranks, so a cut link or a lost node ends the job in seconds, naming the lost peer.

Why: after a link is cut no connection reset arrives. A rank waiting in a collective then waits for the
transport's own timeout: Gloo's default is 30 minutes, Open MPI's TCP about 15 (on the two-node harness,
launch/twonode.py, a Gloo all-reduce loop cut mid-run made no progress and raised nothing in the 10 s
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
that ends normally, or by an agreed error, says goodbye first (``stop``), and is not mourned.

The address a rank advertises is the one its peers can reach: the IPv4 address of ``GLOO_SOCKET_IFNAME``
(or ``HOROVOD_GLOO_IFACE``) when set, else the local address of the route to the rendezvous host
(``MASTER_ADDR``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``), else the host name's; ``HVD_PARTIALFC_HEARTBEAT_ADDR``
overrides all. Cost: one byte a rank every timeout / 10 seconds (2 s by default).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import threading
import time
from typing import Optional, Tuple

EXIT_LOST_PEER = 1
_BEAT, _BYE = b"B", b"E"


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


class Heartbeat:
    """The ring heartbeat of one rank (see the module's docstring). ``start`` is a collective."""

    def __init__(self, rank: int, size: int, timeout_s: float):
        self.rank, self.size, self.timeout = rank, size, float(timeout_s)
        self.interval = max(0.05, self.timeout / 10)
        self._out: Optional[socket.socket] = None
        self._stopped = threading.Event()
        self.peers = []

    @classmethod
    def start(cls, comm, timeout_s: float) -> Optional["Heartbeat"]:
        """Join the ring over ``comm`` (its addresses are all-gathered); None at one rank or when off."""
        if comm.size == 1 or timeout_s <= 0:
            return None
        hb = cls(comm.rank, comm.size, timeout_s)
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        me = (socket.gethostname(), advertised_address(), server.getsockname()[1])
        hb.peers = comm.allgather_object(me, name="heartbeat.addresses")
        accepted = []
        acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
        acceptor.start()
        hb._out = hb._connect(hb.peers[(hb.rank + 1) % hb.size])
        acceptor.join(timeout=60)
        server.close()
        if not accepted:
            hb._lost((hb.rank - 1) % hb.size, "it never connected")
        threading.Thread(target=hb._send, daemon=True, name="heartbeat-send").start()
        threading.Thread(target=hb._watch, args=(accepted[0],), daemon=True, name="heartbeat-watch").start()
        return hb

    def _connect(self, peer: Tuple[str, str, int]) -> socket.socket:
        deadline = time.monotonic() + 60
        while True:
            try:
                s = socket.create_connection(peer[1:], timeout=5)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            except OSError as e:
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
        host, addr, _ = self.peers[peer] if self.peers else ("?", "?", 0)
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
