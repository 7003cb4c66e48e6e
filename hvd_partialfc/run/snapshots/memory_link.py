"""Snapshot files between ranks over plain TCP: a rank's copy to its buddy, a recovering rank's fetch.

Why not the engine: a buddy copy is point-to-point and must not wait for the step (Horovod has no send/recv,
and a collective from a second thread would interleave with the step's); a fetch at recovery moves only the
files a rank needs (an all-gather would hand every rank every slice).

Each rank serves its node's snapshot folder (memory_store.NodeStore) on a port of the advertised address
(the heartbeat's). Anyone who can reach the host can connect to it, another user of a shared node included,
so every request proves that it comes from a rank of this start of the job, and what it asks is checked:

* **Handshake** (engine/listener.py): the server greets each connection with a fresh random nonce; the
  request's header (a line of JSON: the operation, the sender's rank, its arguments) carries an HMAC-SHA256
  of the nonce and the header under the start's ``secret``. Rank 0 draws the secret at every start and the
  ranks get it through the collectives only: it is never on disk, so a process that holds the run's token
  (``RUN/run_id``), a stale job of the same run or another user has no key, and a recorded request is useless
  under another nonce. A connection that does not prove itself within a few seconds is closed without an
  answer; a flood of them evicts its own oldest, never a rank's (listener.py).
* **Authorization** (``authorize``, memory.py): a put only from the rank whose buddy this rank is, into this
  start's segment, for a snapshot step that can be due, under that rank's own file name, at most the size of
  its slice; a commit note only from rank 0; a get from any rank of the job.
* **The answers and the bytes**: each answer carries an HMAC of the nonce, its place in the connection and its
  body under the same secret, and a requester trusts no "yes" without it: a process that took the port of a
  rank that died (the requester retries the address) can refuse but never serve. A file's SHA-256 travels in
  what is signed, the put's header or the get's answer, and the receiver hashes the bytes as they arrive: a
  put whose bytes differ leaves no file, a get's is an error (the next holder is asked). 128 MB hash in 0.1 s
  on one core (1.3 GB/s measured), once by the sender and once as they arrive.

Operations, one a connection (the header, the answer, and a put's payload and final answer):

* ``put`` (segment, step, name, size): once accepted, the bytes, written into the landing snapshot of
  ``step``, then answered ``{"ok": true}``: the sender knows the copy is in the buddy's memory;
* ``get`` (segment, step, name): the file's bytes from the node's snapshot, committed or landing (a segment of
  exactly 8 hex digits, a plain name: a header can never name a path outside the snapshot's folder);
* ``note``: a small message for the rank's ``on_note`` (a landing told to rank 0, its commit told to a node).

Forked children (DataLoader workers) close their copy of the listening socket, so a dead rank's port closes
with it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Callable, Optional, Tuple

from ...engine.heartbeat import advertised_address
from ...engine.listener import HANDSHAKE_S, serve
from ...forking import close_sockets_in_child
from .memory_store import SEGMENT, NodeStore

TIMEOUT_S = 300.0          # one file: 128 MB (a 31k-row slice with momentum, D 512) needs ~1 s at 1 Gb/s
ATTEMPTS = 5               # a request whose connection closed before its answer (a flood evicted it first)
_LIVE: "weakref.WeakSet[Link]" = weakref.WeakSet()
close_sockets_in_child(_LIVE, lambda link: (link.server,))     # a child's copy of the port; the parent's stays


class LinkError(RuntimeError):
    pass


class _Impostor(LinkError):
    """An answer without this start's signature that says more than no: not tried again."""


def new_secret() -> str:
    """A start's key for the link (rank 0 draws it; the collectives carry it to the other ranks)."""
    return secrets.token_hex(32)


def _mac(secret: str, nonce: bytes, body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(bytes.fromhex(secret), nonce + canonical, hashlib.sha256).hexdigest()


def answer_mac(secret: str, nonce: bytes, i: int, body: dict) -> str:
    """The MAC of the ``i``-th answer on the connection greeted with ``nonce`` (a request's MAC can never
    pass for an answer's, nor the first answer of a put for its last)."""
    return _mac(secret, b"answer %d:" % i + nonce, body)


def _sha256(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(4 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return _sha256(f)


def _is_digest(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _plain_name(name) -> bool:
    return isinstance(name, str) and 0 < len(name) < 256 and "/" not in name and "\0" not in name \
        and not name.startswith(".")


def malformed(h: dict) -> Optional[str]:
    """What is wrong with an authenticated header's shape, else None (a bug's request, not a stranger's)."""
    def count(k):
        return isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0
    op = h.get("op")
    if op not in ("put", "get", "note") or not count("rank"):
        return f"unknown request {op!r}"
    if op in ("put", "get") and not (count("step") and isinstance(h.get("segment"), str)
                                     and SEGMENT.fullmatch(h["segment"]) and _plain_name(h.get("name"))):
        return f"a {op} needs a segment (8 hex digits), a step and a plain file name"
    if op == "put" and not (count("size") and _is_digest(h.get("sha256"))):
        return "a put needs its size and its SHA-256"
    if op == "note" and not (h.get("what") in ("landed", "commit") and count("step")):
        return f"unknown note {h.get('what')!r}"
    return None


def _recv_into(conn: socket.socket, n: int, f, digest: str, head: bytes = b"") -> None:
    """``n`` bytes into ``f``, hashed as they arrive: an error unless their SHA-256 is ``digest``."""
    if len(head) > n:
        raise LinkError(f"{len(head)} bytes sent for a file of {n}")
    f.write(head)
    h = hashlib.sha256(head)
    got = len(head)
    while got < n:
        chunk = conn.recv(min(4 << 20, n - got))
        if not chunk:
            raise LinkError(f"connection closed after {got} of {n} bytes")
        f.write(chunk)
        h.update(chunk)
        got += len(chunk)
    if not hmac.compare_digest(h.hexdigest(), digest):
        raise LinkError(f"the {n} bytes received are not the ones signed for (SHA-256 differs)")


def _recv_line(conn: socket.socket, limit: int = 4096) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        c = conn.recv(1)
        if not c:
            raise LinkError("connection closed before an answer")
        buf += c
        if len(buf) > limit:
            raise LinkError("answer too long")
    return buf


def _send_json(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


class Link:
    """This rank's server and its requests to other ranks' servers (``put``, ``get``, ``note``).
    ``authorize(header)``: why this rank refuses an authenticated request, or None (memory.py)."""

    def __init__(self, store: NodeStore, secret: str, rank: int,
                 authorize: Optional[Callable[[dict], Optional[str]]] = None):
        self.store, self.secret, self.rank = store, secret, rank
        self.authorize = authorize or (lambda h: None)
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.addr = advertised_address()
        try:
            self.server.bind((self.addr, 0))
        except OSError:
            self.server.bind(("0.0.0.0", 0))
        self.server.listen(128)
        self.port = self.server.getsockname()[1]
        self._closed = threading.Event()
        self.on_note = None        # called with a ``note``'s header (memory.py: landings, commits)
        _LIVE.add(self)
        threading.Thread(target=serve, args=(self.server, self._check, self._ready, self._closed.is_set),
                         kwargs={"greet": self._greet}, daemon=True, name="memory-link").start()

    @property
    def address(self) -> Tuple[str, int]:
        return self.addr, self.port

    def close(self) -> None:
        self._closed.set()
        try:
            self.server.close()
        except OSError:
            pass

    # --- the server --------------------------------------------------------------------------------------

    @staticmethod
    def _greet() -> Tuple[bytes, bytes]:
        nonce = secrets.token_bytes(16)
        return nonce.hex().encode() + b"\n", nonce

    def _check(self, nonce: bytes, hello: bytes) -> Optional[dict]:
        """The request's header (and the nonce, which signs the answers) if its MAC is this start's for this
        nonce; a refusal to say for a request of the right shape under another key (a stale job of the run,
        which then stops trying); None, closed without a word, for anything else."""
        msg = json.loads(hello)
        body, mac = msg.get("body"), msg.get("mac")
        if not isinstance(body, dict) or not isinstance(mac, str):
            return None
        if not hmac.compare_digest(_mac(self.secret, nonce, body), mac):
            return {"refused": "not a request of this start of the job (another key)", "nonce": nonce}
        return {"body": body, "nonce": nonce}

    def _ready(self, conn: socket.socket, h: dict, rest: bytes) -> bool:
        threading.Thread(target=self._serve, args=(conn, h, rest), daemon=True, name="memory-link-conn").start()
        return False

    def _serve(self, conn: socket.socket, accepted: dict, rest: bytes) -> None:
        sent = []

        def answer(body: dict) -> None:         # signed: the requester trusts no answer without it
            _send_json(conn, {"body": body, "mac": answer_mac(self.secret, accepted["nonce"], len(sent), body)})
            sent.append(body)
        with conn:
            try:
                conn.settimeout(TIMEOUT_S)
                h = accepted.get("body", {})
                why = accepted.get("refused") or malformed(h) or self.authorize(h)
                if why:
                    answer({"ok": False, "error": f"refused: {why}"})
                    return
                if h["op"] == "put":     # streamed into the file: a copy never sits whole in this process
                    answer({"ok": True})      # the sender waits for this before its payload
                    self.store.write(h["step"], h["name"],
                                     lambda f: _recv_into(conn, h["size"], f, h["sha256"], rest))
                    answer({"ok": True})
                elif h["op"] == "note":      # handled, then answered: a commit's sender knows it is done
                    if self.on_note is not None:
                        self.on_note(h)
                    answer({"ok": True})
                else:
                    f = self.store.open_file((h["segment"], h["step"]), h["name"])
                    if f is None:
                        answer({"ok": False, "error": f"no {h['name']} of step {h['step']} here"})
                        return
                    with f:
                        size, digest = os.fstat(f.fileno()).st_size, _sha256(f)
                        f.seek(0)
                        answer({"ok": True, "size": size, "sha256": digest})
                        conn.sendfile(f)
            except Exception as e:  # noqa: BLE001 (a rank's request that failed here: said to it, never raised)
                try:
                    answer({"ok": False, "error": f"{type(e).__name__}: {e}"})
                except OSError:
                    pass

    # --- requests ----------------------------------------------------------------------------------------

    def _answer(self, conn: socket.socket, nonce: bytes, i: int) -> dict:
        """The ``i``-th answer on ``conn``: trusted when signed under this start's key; unsigned, only a refusal
        (what a stale job hears from the current one, which holds another key), never a "yes"."""
        msg = json.loads(_recv_line(conn))
        body = msg.get("body") if isinstance(msg, dict) else None
        if not isinstance(body, dict):
            raise _Impostor("not an answer of this link (another process on the rank's port?)")
        mac = msg.get("mac")
        if isinstance(mac, str) and hmac.compare_digest(answer_mac(self.secret, nonce, i, body), mac):
            return body
        if body.get("ok") is False and isinstance(body.get("error"), str):
            return body
        raise _Impostor("an answer not signed by this start of the job (another process on the rank's port?)")

    def _request(self, peer: Tuple[str, int], header: dict, payload: str = "") -> Tuple[dict, socket.socket]:
        """One request, signed; ``payload``: a file sent after the header (sendfile: no copy in this process).
        A connection closed before the answer is tried again (a flood evicted it); a refusal is not, nor an
        answer that is not this start's."""
        body, last = dict(header, rank=self.rank), None
        for attempt in range(ATTEMPTS):
            conn = None
            try:
                conn = socket.create_connection(tuple(peer), timeout=HANDSHAKE_S)
                nonce = bytes.fromhex(_recv_line(conn, 64).decode().strip())
                _send_json(conn, {"body": body, "mac": _mac(self.secret, nonce, body)})
                conn.settimeout(TIMEOUT_S)
                answer = self._answer(conn, nonce, 0)
                if payload and answer.get("ok"):       # a put: the payload once the buddy agreed to take it
                    with open(payload, "rb") as f:
                        conn.sendfile(f)
                    answer = self._answer(conn, nonce, 1)
            except _Impostor as e:
                conn.close()
                raise LinkError(f"{peer[0]}:{peer[1]}: {e}") from None
            except (OSError, LinkError, ValueError) as e:
                last = e
                if conn is not None:
                    conn.close()
                time.sleep(0.1 * 2 ** attempt)
                continue
            if not answer.get("ok"):
                conn.close()
                raise LinkError(f"{peer[0]}:{peer[1]}: {answer.get('error')}")
            return answer, conn
        raise LinkError(f"{peer[0]}:{peer[1]}: no answer in {ATTEMPTS} tries ({last})")

    def put(self, peer: Tuple[str, int], step: int, name: str, path: str) -> None:
        """File ``path`` into ``peer``'s node as ``name`` of this segment's snapshot of ``step``; returns once it
        is written there."""
        _, conn = self._request(peer, {"op": "put", "segment": self.store.segment, "step": step, "name": name,
                                       "size": os.path.getsize(path), "sha256": file_sha256(path)}, path)
        conn.close()

    def note(self, peer: Tuple[str, int], **what) -> None:
        """A small message for ``peer``'s ``on_note`` (no payload)."""
        _, conn = self._request(peer, dict(what, op="note"))
        conn.close()

    def get(self, peer: Tuple[str, int], key: Tuple[str, int], name: str, f) -> None:
        """File ``name`` of ``peer``'s node's snapshot ``key`` (segment, step), written into the open file ``f``."""
        answer, conn = self._request(peer, {"op": "get", "segment": key[0], "step": key[1], "name": name})
        with conn:
            size, digest = answer.get("size"), answer.get("sha256")
            if not isinstance(size, int) or size < 0 or not _is_digest(digest):
                raise LinkError(f"{peer[0]}:{peer[1]}: a get's answer without its size and SHA-256")
            _recv_into(conn, size, f, digest)
