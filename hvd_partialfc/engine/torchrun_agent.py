"""This rank's torchrun agent, read from outside it (``/proc``): stopping it (an evicted node leaves the job,
run/watch/stragglers.py) and whether it hosts the rendezvous's store (the node that must never be evicted).

Why from outside: torchrun tells its workers neither its rendezvous endpoint nor which agent serves it
(``MASTER_ADDR`` names the workers' own store, not the rendezvous's). The agent's command line names the
endpoint's port (``--rdzv-endpoint HOST:PORT``, torchrun's ``PET_*`` variables otherwise); the agent that serves
the store is the one process on the node holding a listening socket on that port. That is exact where a host
name is not: several agents may share a host, and ``is_host`` in ``--rdzv-conf`` overrides the name's match.
Not a collective; Linux only (elsewhere: no agent is found, nothing is signalled, no node hosts the store).
"""
from __future__ import annotations

import os
import signal
from typing import List, Mapping, Optional, Set

C10D_PORT = 29400     # torch's c10d rendezvous backend: an endpoint without a port
STATIC_PORT = 29500   # torchrun's --master-port default, the static backend's endpoint


def agent_argv(environ: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The command line of this process's parent when it is a torchrun agent, else None."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return argv if any("torchrun" in a or "torch.distributed.run" in a for a in argv) else None


def stop_agent() -> bool:
    """SIGTERM to this process's torchrun agent (none: nothing is signalled); whether one was."""
    if agent_argv() is None:
        return False
    os.kill(os.getppid(), signal.SIGTERM)
    return True


def _option(argv: List[str], name: str, environ: Mapping[str, str]) -> Optional[str]:
    """torchrun's option ``--name`` (``-`` or ``_`` between words, ``=VALUE`` or the next argument), else its
    ``PET_NAME`` variable (torchrun reads its options from those too). The first such argument is taken: a
    training script's own arguments come after torchrun's, and ours have none of these names."""
    spellings = {"--" + name, "--" + name.replace("-", "_")}
    for i, a in enumerate(argv):
        key, eq, value = a.partition("=")
        if key in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return environ.get("PET_" + name.upper().replace("-", "_"))


def rendezvous_port(argv: List[str], environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The port of the agent's rendezvous store, from its command line (``argv``); None for a backend whose store
    no agent serves (etcd) or a port chosen at start (``localhost:0``, ``--standalone``: one node)."""
    backend = _option(argv, "rdzv-backend", environ) or "static"
    if backend == "static":
        endpoint = _option(argv, "rdzv-endpoint", environ) or f":{_option(argv, 'master-port', environ) or STATIC_PORT}"
    elif backend == "c10d":
        endpoint = _option(argv, "rdzv-endpoint", environ) or ""
    else:
        return None
    endpoint = endpoint.strip()
    tail = endpoint.rsplit(":", 1)[1] if ":" in endpoint and not endpoint.endswith("]") else ""
    port = int(tail) if tail.isdigit() else (C10D_PORT if backend == "c10d" else STATIC_PORT)
    return port or None


def listening_ports(pid: int) -> Set[int]:
    """The TCP ports process ``pid`` listens on (IPv4 and IPv6): its sockets' inodes (``/proc/PID/fd``) among
    the listening rows of its network namespace's tables. Unreadable: none."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if len(col) > 9 and col[3] == "0A" and col[9] in inodes:   # 0A: TCP_LISTEN
                ports.add(int(col[1].rsplit(":", 1)[1], 16))
    return ports


def hosts_rendezvous(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's torchrun agent serves the job's rendezvous store (the module's docstring)."""
    argv = agent_argv(environ)
    port = rendezvous_port(argv, environ) if argv else None
    return port is not None and port in listening_ports(os.getppid())
