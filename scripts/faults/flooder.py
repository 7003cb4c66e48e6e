"""A stranger's connection flood on a TCP port, as another user of the node would run it (standard library only,
so that ``runuser -u nobody -- python3 scripts/faults/flooder.py ...`` runs it with the system's Python).

    python3 scripts/faults/flooder.py HOST:PORT [HOST:PORT ...] --seconds 10 [--hold 600] [--inflight 64]

For ``--seconds``, one thread opens connections to every address as fast as the port takes them (``--inflight``
connects under way at a time, non-blocking), keeps the newest ``--hold`` of them open, every other one saying
garbage (a ``[]`` line, zeros, an HTTP request, 5,000 bytes without a line's end) and the rest nothing, and closes
the oldest to open more: the listening queue stays full and the server's handshake slots stay taken for as long as
the flood lasts. ``--start-file PATH``: wait until PATH exists (the flood begins when the measured thing does),
read addresses from it if none are given (one ``HOST:PORT`` a line); ``--watch``: read it again every 50 ms,
for ports that open while the flood goes on (its seconds count from the first). Prints ``flooding`` when it begins, and one
JSON line at the end: the connections opened, those the server closed first (evicted or refused), connect errors.
The program may come on standard input (``python3 - ARGS < flooder.py``): the other user need not read this tree.
"""
from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import selectors
import shutil
import socket
import stat
import subprocess
import sys
import time
from typing import Optional

JUNK = [b"[]\n", b"\x00" * 64, b"GET / HTTP/1.0\r\n\r\n", b"x" * 5000]


def _address(text: str):
    host, _, port = text.strip().rpartition(":")
    return host, int(port)


def flood(addresses, seconds: float, hold: int = 600, inflight: int = 64, watch: Optional[str] = None) -> dict:
    """``watch``: a file of addresses read again every 50 ms (ports found while the flood goes on); the
    ``seconds`` count from the first address."""
    sel = selectors.DefaultSelector()
    addresses, seen = list(addresses), 0.0
    held: "collections.deque[socket.socket]" = collections.deque()
    stats = {"opened": 0, "closed_by_server": 0, "connect_errors": 0}
    connecting, i = 0, 0
    end = time.monotonic() + seconds

    def close(s):
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        s.close()

    while time.monotonic() < end:
        if watch and time.monotonic() - seen > 0.05:
            seen = time.monotonic()
            with open(watch) as f:
                found = [_address(line) for line in f if line.strip()]
            if found and not addresses:
                end = time.monotonic() + seconds
            addresses = found or addresses
            if not addresses:
                end = time.monotonic() + seconds
        while connecting < inflight and addresses:
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError:         # out of file descriptors: the oldest held goes
                if held:
                    close(held.popleft())
                break
            s.setblocking(False)
            err = s.connect_ex(addresses[i % len(addresses)])
            i += 1
            if err not in (0, errno.EINPROGRESS):
                stats["connect_errors"] += 1
                s.close()
                time.sleep(0.001)
                break
            sel.register(s, selectors.EVENT_WRITE, "connect")
            connecting += 1
        for key, _ in sel.select(0.05):
            s = key.fileobj
            if s.fileno() < 0:      # closed above, in this same round
                continue
            if key.data == "connect":
                connecting -= 1
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    stats["connect_errors"] += 1
                    close(s)
                    continue
                stats["opened"] += 1
                if stats["opened"] % 2:
                    try:
                        s.send(JUNK[(stats["opened"] // 2) % len(JUNK)])
                    except OSError:
                        pass
                sel.modify(s, selectors.EVENT_READ, "held")
                held.append(s)
                if len(held) > hold:
                    close(held.popleft())
            else:                   # the server spoke (a greeting) or closed it: read, and count a close
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    stats["closed_by_server"] += 1
                    held.remove(s)
                    close(s)
    for s in list(held):
        close(s)
    return stats


def _python_for_all() -> Optional[str]:
    """A Python that any user may run (every folder on its real path searchable by others), or None."""
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        path = os.path.realpath(cand) if cand else ""
        parts, d = [], path
        while d and d != "/":
            parts.append(d)
            d = os.path.dirname(d)
        try:
            if path and all(os.stat(x).st_mode & stat.S_IXOTH for x in parts):
                return path
        except OSError:
            continue
    return None


def can_flood_as(user: str = "nobody") -> bool:
    """Whether this process can run the flood as ``user`` (root, ``runuser``, a Python that user may run)."""
    return os.geteuid() == 0 and bool(shutil.which("runuser")) and _python_for_all() is not None


def start_as(user: str, addresses, seconds: float, **opts) -> subprocess.Popen:
    """The flood run as ``user`` (``runuser``, root only), begun: returns once it says ``flooding``. ``opts``:
    ``hold``, ``inflight``, ``start_file``, ``watch`` as on the command line (a True: the bare flag). ``finish`` reads its figures."""
    args = [f"{h}:{p}" for h, p in addresses] + ["--seconds", str(seconds)]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    with open(os.path.abspath(__file__)) as program:
        p = subprocess.Popen(["runuser", "-u", user, "--", _python_for_all(), "-", *args], stdin=program,
                             stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "flooding":
        p.kill()
        raise RuntimeError(f"the flood as {user} did not start")
    return p


def finish(p: subprocess.Popen, timeout: float = 60) -> dict:
    """The figures of a flood from ``start_as``, once it ended."""
    return json.loads(p.communicate(timeout=timeout)[0].strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("addresses", nargs="*")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--hold", type=int, default=600)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--start-file", default=None)
    ap.add_argument("--watch", action="store_true", help="read --start-file again every 50 ms")
    a = ap.parse_args(argv)
    addresses = [_address(x) for x in a.addresses]
    if a.start_file:
        while not os.path.exists(a.start_file):
            time.sleep(0.02)
        if not addresses:
            with open(a.start_file) as f:
                addresses = [_address(line) for line in f if line.strip()]
    print("flooding", flush=True)
    t0 = time.monotonic()
    stats = flood(addresses, a.seconds, a.hold, a.inflight, a.start_file if a.watch else None)
    stats["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
