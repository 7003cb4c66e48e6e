"""The sockets a communicator opened, found by their descriptors, and cut in place: how an engine leaves a collective
that a lost peer left stuck (engine/horovod.py and engine/generation.py ``abort``).

Why: neither Horovod's Gloo context nor torch's Gloo group can be stopped from outside while a collective waits in
it (no abort for Gloo; ``destroy_process_group`` does not stop a running collective). Shutting their sockets down
makes every receive and send on them fail at once, in this rank and in the peers at the other end. Not collectives.
"""
from __future__ import annotations

import os
import socket
from typing import Dict


def open_sockets() -> Dict[int, str]:
    """This process's socket descriptors and their identities (``socket:[inode]``)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def opened_since(before: Dict[int, str]) -> Dict[int, str]:
    """The sockets open now that ``before`` (an ``open_sockets()``) did not have."""
    return {fd: link for fd, link in open_sockets().items() if before.get(fd) != link}


def cut(sockets: Dict[int, str]) -> None:
    """Shut down (not close: their owner still holds the descriptors) each connection that is still the one noted.
    A listening socket is left alone: it carries no collective, and Gloo's listener thread aborts the process
    (``gloo::EnforceNotMet``, "accept: Invalid argument") when its socket is shut down under it."""
    for fd, link in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue                      # closed since, the number reused: not the owner's any more
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
