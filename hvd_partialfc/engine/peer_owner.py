"""Which user owns the other end of a TCP connection that comes from this host (Linux ``sock_diag``).

Why: on a shared node a stranger's connections and a rank's come from the same address (the node's, or
127.0.0.1), so an address alone cannot keep one user's flood from taking the handshake slots of another's
connections (engine/listener.py). The kernel knows the owner of every socket of the node; one netlink request
a connection (the exact socket, no listing) asks it, as ``ss -e`` does, and needs no privilege.

Elsewhere (a peer on another host, another network namespace, a kernel without ``sock_diag``) the answer is
None and the listener goes by the address alone.
"""
from __future__ import annotations

import socket
import struct
from typing import Optional

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG_HEADER = struct.Struct("=IHHII")             # length, type, flags, sequence, port id
_STATE_AT = _NLMSG_HEADER.size + 1                 # inet_diag_msg: family, state, timer, retransmits, the id,
_UID_AT = _NLMSG_HEADER.size + 4 + 48 + 12          # expires, rqueue, wqueue, uid, inode
_ESTABLISHED = 1


class PeerOwners:
    """One netlink socket, asked once a connection (``uid``). ``close`` when done."""

    def __init__(self):
        self.seq = 0
        try:
            self.sock: Optional[socket.socket] = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                                               _NETLINK_SOCK_DIAG)
            self.sock.setblocking(False)         # the kernel answers within the request: nothing to wait for
        except (OSError, AttributeError):        # not Linux, or no sock_diag
            self.sock = None

    def uid(self, conn: socket.socket) -> Optional[int]:
        """The user id that owns the peer's end of ``conn``, when that end is on this host; else None."""
        if self.sock is None or conn.family != socket.AF_INET:
            return None
        try:
            (peer, peer_port), (mine, my_port) = conn.getpeername(), conn.getsockname()
        except OSError:
            return None
        if peer != mine and not peer.startswith("127."):
            return None                          # another host: its owner is not for this kernel to say
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        # inet_diag_req_v2: family, protocol, no extensions, every state; the peer's socket seen from its end
        # (source: the peer, destination: this end), any interface, no cookie
        req = (struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
               + struct.pack("!HH", peer_port, my_port) + socket.inet_aton(peer) + bytes(12)
               + socket.inet_aton(mine) + bytes(12) + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF))
        try:
            self.sock.sendto(_NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(req), _SOCK_DIAG_BY_FAMILY,
                                                _NLM_F_REQUEST, self.seq, 0) + req, (0, 0))
            while True:
                data = self.sock.recv(4096)       # BlockingIOError (an OSError): no answer came
                _, kind, _, seq, _ = _NLMSG_HEADER.unpack_from(data)
                if seq != self.seq:               # the late answer to an earlier question
                    continue
                if kind != _SOCK_DIAG_BY_FAMILY or len(data) < _UID_AT + 8:
                    return None                   # an error: not found here
                uid, inode = struct.unpack_from("=II", data, _UID_AT)
                # a socket its process closed already (an orphan) reads as root's: no owner to say
                return uid if data[_STATE_AT] == _ESTABLISHED and inode else None
        except (OSError, struct.error):
            return None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
