#!/usr/bin/env python
"""Two or more "nodes" on one machine, each with its own network stack, for multi-node tests of torchrun,
horovodrun and mpirun jobs (tests/test_twonode.py) and the chaos run (scripts/faults/chaos.py).

    with TwoNodes(suffix="-t1") as nodes:                # namespaces hpfc-n1-t1, hpfc-n2-t1, switch hpfc-sw-t1
        p = nodes.popen(2, nodes.torchrun_argv(2, ["job.py"], port=29500), env=nodes.launch_env(2))
        nodes.cut(); nodes.restore(); nodes.kill_node(2)
    with Nodes(3, suffix="-t2") as nodes:                # node1 .. node3; cut(node=3) partitions node 3
        ...

    python -m scripts.faults.twonode [--suffix=S] [--nodes N] up   # set up, for poking by hand (repository root)
    python -m scripts.faults.twonode [--suffix=S] exec N -- CMD    # run CMD in node N of a set up by `up`
    python -m scripts.faults.twonode [--suffix=S] down             # tear it down

Choices, and why:

* Network namespaces on a switch, not containers or VMs: root plus iproute2 is all it needs, set-up takes
  ~0.2 s and teardown ~0.02 s (measured, loaded 2-core box), and the nodes share the file system and venv
  (the jobs' scripts and outputs, like a cluster's shared file system). The switch is a bridge in a
  namespace of its own; each node's veth pair is created straight into the node and the switch
  (``ip link add IF netns NODE type veth peer name pN netns SWITCH``), so every node's end carries the same
  name (``hpfc0``, like a cluster's uniform NIC name, which the *_IFNAME variables need) and nothing touches
  the root namespace: parallel sets (``suffix``) may even reuse the subnet. Each node has only ``lo`` and
  ``hpfc0``, so a layer that picks the wrong interface fails across nodes instead of silently working.
* Per-node hostnames need a UTS namespace; ``ip netns exec`` gives none (and ignores
  /etc/netns/NS/hostname), so every command runs as ``ip netns exec NS unshare --uts sh -c 'hostname
  nodeN && exec "$@"'``: each launch gets a fresh UTS namespace with the same name (nothing to keep alive;
  6 ms per start idle, 28 ms loaded). ``ip netns exec`` bind-mounts /etc/netns/NS/hosts over /etc/hosts, which maps
  node1/node2 to their addresses: Open MPI and horovodrun recognise the local node by name/address, and
  torchrun's workers resolve the names.
* Launch agent (scripts/faults/netns_rsh, beside this file): one script for mpirun's ``plm_rsh_agent`` and,
  as ``ssh`` (a wrapper in the state dir put first on PATH), for horovodrun. It finds a host's namespace in
  HPFC_NETNS_HOSTS (``ALIAS=NS:HOSTNAME`` entries), set in launch_env() and baked into the wrapper; it keeps
  the caller's environment (see the script).
* cut(node=N) sets node N's end of its link down (and the switch's with both=True): a partition with no
  RST/FIN, like a pulled cable: connected peers block in recv until their own timeouts (a gloo allreduce
  loop stalls and nothing exits within 10 s). kill_node() SIGKILLs every process in a namespace (``ip netns
  pids``), like a crash of the processes: the node's kernel lives on and closes their sockets, so peers get
  EOF/RST at once. A machine that dies silently is cut() then kill_node() (and no restore()).
* The state dir (the ``ssh`` wrapper every launch runs as root) is a private ``mkdtemp`` folder, the wrapper
  created 0700 without following links; the command line keeps its path under /etc/netns (root's) for
  ``exec`` and ``down``. It was a fixed /tmp path, which another user could have prepared.
* Teardown kills every process in both namespaces before deleting them (a deleted namespace lives on
  while any process holds it), removes /etc/netns/NS and the state dir; it is idempotent. A crashed run
  (SIGKILL, no __exit__) is cleaned up by the next set-up: a stale pair of the same names, and any pair
  named with owner_suffix() (``-p<PID>``, what tests use, so parallel runs never collide) whose PID is gone.
* Nodes have no default route: lookups of unknown names fail at once (`getent hosts example.com`: 29 ms,
  no resolver timeout); ports are per node, so parallel pairs may use the same ones.
* Launchers (flags checked against torch 2.13's run.py and horovod 0.28.1's runner): torchrun gets
  ``--rdzv-conf is_host=1|0`` (the c10d backend otherwise guesses by hostname) and ``--local-addr`` (it
  becomes MASTER_ADDR; the default is getfqdn()). horovodrun gets ``--network-interface hpfc0``, which
  skips its NIC probe (a task server per host over ssh: ~3 s more, measured), and ``--disable-cache``
  (no ~/.horovod entry keyed on host names that every pair shares). mpirun is run from node 1 with
  ``plm_rsh_agent`` = netns_rsh and btl/oob_tcp_if_include hpfc0; ``--bind-to none`` (shared cores).
* No namespaces (not root, no iproute2/unshare, ``ip netns add`` refused in a container): set-up raises
  Unavailable with the reason; ``unavailable_reason()`` returns it without side effects, ``tried_reason()`` by trying (for pytest.skip).
"""
from __future__ import annotations

import argparse
import functools
import glob
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RSH = os.path.join(HERE, "netns_rsh")
BIN = os.path.dirname(sys.executable)
IFACE_VARS = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class Unavailable(RuntimeError):
    """Network namespaces can't be used here; str(e) is the reason (a pytest.skip message)."""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p


def unavailable_reason() -> Optional[str]:
    """Why two nodes can't be set up here (None when the tools and privileges are there). Cheap, no
    side effects; TwoNodes() can still fail (e.g. a seccomp-filtered container), raising Unavailable."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, unshare --uts)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    return None


@functools.lru_cache(maxsize=None)
def tried_reason() -> Optional[str]:
    """Why network-namespace nodes can't run here, found by trying (None: they can): ``unavailable_reason()``,
    then a namespace made, a UTS namespace entered in it, and the namespace deleted. A root container that
    refuses ``ip netns add`` (no CAP_SYS_ADMIN, seccomp) answers here, so a test can run its one-host
    fallback instead of skipping both versions."""
    reason = unavailable_reason()
    if reason:
        return reason
    ns = "hpfc-probe" + owner_suffix()
    try:
        made = _sh("ip", "netns", "add", ns, check=False)
        if made.returncode != 0:
            return f"ip netns add refused: {made.stderr.strip() or made.returncode}"
        entered = _sh("ip", "netns", "exec", ns, "unshare", "--uts", "true", check=False)
        if entered.returncode != 0:
            return f"unshare --uts in a network namespace refused: {entered.stderr.strip() or entered.returncode}"
        return None
    finally:
        _sh("ip", "netns", "del", ns, check=False)


def study_options(ap: argparse.ArgumentParser) -> None:
    """The options every multi-node study shares: ``--json`` (its report), ``--work`` (keep the runs), ``--show``."""
    ap.add_argument("--json")
    ap.add_argument("--work", help="keep the runs and logs here (default: a temporary folder, removed)")
    ap.add_argument("--show", metavar="JSON", help="print the table of a report written before, and run nothing")


def study_preamble(a: argparse.Namespace, name: str, table) -> Optional[int]:
    """Before a study runs: ``--show`` prints ``table`` of that report (exit 0); nodes that cannot be set up
    here are one line (exit 2). None: go on."""
    if a.show:
        with open(a.show) as f:
            print(table(json.load(f)))
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"{name}: cannot run: {reason}", file=sys.stderr)
        return 2
    return None


def study_report(a: argparse.Namespace, report: Dict, table) -> None:
    """A study's end: its table printed, its report to ``--json``."""
    print(table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def owner_suffix() -> str:
    """``-p<PID>``: a suffix unique to this process, which sweep_stale() can tell is stale once it exits."""
    return f"-p{os.getpid()}"


def sweep_stale(prefix: str = "hpfc") -> List[str]:
    """Tear down the node sets left by crashed runs: namespaces ``PREFIX-nN-p<PID>`` and ``PREFIX-sw-p<PID>``
    whose PID is gone (their processes killed, /etc/netns folders and state dirs removed). The namespaces
    deleted."""
    gone = []
    for ns in _sh("ip", "netns", "list", check=False).stdout.split():
        m = re.fullmatch(re.escape(prefix) + r"-(?:n\d+|sw)-p(\d+)", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
            for d in glob.glob(os.path.join(tempfile.gettempdir(), f"hpfc-twonode-p{m.group(1)}-*")):
                shutil.rmtree(d, ignore_errors=True)
            gone.append(ns)
    return gone


class Nodes:
    """``count`` network-namespace nodes (node1 ... nodeN) on one switch. A context manager: set up on enter,
    torn down on exit (also on an exception); ``setup()``/``teardown()`` for other uses."""

    def __init__(self, count: int = 2, suffix: str = "", subnet: str = "10.77.0.0/24", ifname: str = "hpfc0",
                 prefix: str = "hpfc", hostnames: Optional[Sequence[str]] = None, state_dir: Optional[str] = None):
        if not 2 <= count <= 9:
            raise ValueError(f"2 to 9 nodes, not {count}")
        self.count, self.suffix, self.ifname = count, suffix, ifname
        self.net = ipaddress.ip_network(subnet if "/" in subnet else subnet.rstrip(".") + ".0/24")
        self.prefix, self.names = prefix, [f"{prefix}-n{i}{suffix}" for i in self.node_ids]
        self.switch = f"{prefix}-sw{suffix}"
        for n in self.names + [self.switch]:
            if len(n) > 64 or "/" in n or " " in n:
                raise ValueError(f"bad namespace name {n!r}")
        self.hostnames = list(hostnames or [f"node{i}" for i in self.node_ids])
        self._state_dir_arg = state_dir
        self.state_dir: Optional[str] = None
        self.up = False

    # -- identity ---------------------------------------------------------------------------------------
    @property
    def node_ids(self) -> List[int]:
        return list(range(1, self.count + 1))

    def ns(self, node: int) -> str:
        return self.names[self._i(node)]

    def hostname(self, node: int) -> str:
        return self.hostnames[self._i(node)]

    def addr(self, node: int) -> str:
        return str(self.net.network_address + self._i(node) + 1)

    def _i(self, node: int) -> int:
        if node not in self.node_ids:
            raise ValueError(f"node is one of {self.node_ids}, not {node!r}")
        return node - 1

    @property
    def hosts_map(self) -> str:
        """HPFC_NETNS_HOSTS for scripts/faults/netns_rsh: name and address of each node -> NAMESPACE:HOSTNAME."""
        return " ".join(f"{alias}={self.ns(n)}:{self.hostname(n)}"
                        for n in self.node_ids for alias in (self.hostname(n), self.addr(n)))

    @property
    def bin_dir(self) -> str:
        """Folder holding the ``ssh`` wrapper (scripts/faults/netns_rsh with the host map baked in)."""
        assert self.state_dir, "not set up"
        return os.path.join(self.state_dir, "bin")

    # -- set-up / teardown ------------------------------------------------------------------------------
    def setup(self) -> "Nodes":
        reason = unavailable_reason()
        if reason:
            raise Unavailable(reason)
        self.teardown(force=True)                          # a stale set of the same names (a crashed run)
        sweep_stale(self.prefix)                            # and of other runs' owner_suffix() names
        try:
            for n in [self.switch] + self.names:
                p = _sh("ip", "netns", "add", n, check=False)
                if p.returncode != 0:
                    raise Unavailable(f"`ip netns add {n}` failed: {p.stderr.strip()}")
            p = _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", check=False)
            if p.returncode != 0:
                raise Unavailable(f"`ip link add br0 type bridge` failed: {p.stderr.strip()}")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(n)} {self.hostname(n)}\n" for n in self.node_ids)
            for node in self.node_ids:
                ns, port = self.ns(node), f"p{node}"
                # the node's end is named ifname in the node (uniform NIC name), its switch end p<node>
                _sh("ip", "link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", port, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr(node)}/{self.net.prefixlen}", "dev", self.ifname)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", ns, "link", "set", self.ifname, "up")
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(hosts)
            self._wait_up()
            p = _sh("ip", "netns", "exec", self.ns(1), "unshare", "--uts", "true", check=False)
            if p.returncode != 0:
                raise Unavailable(f"`unshare --uts` failed: {p.stderr.strip()}")
            # a private folder (0700, an unguessable name): the ssh wrapper in it runs as root in every node
            self.state_dir = self._state_dir_arg or tempfile.mkdtemp(prefix=f"hpfc-twonode{self.suffix}-")
            os.makedirs(self.bin_dir, mode=0o700, exist_ok=True)
            ssh = os.path.join(self.bin_dir, "ssh")
            fd = os.open(ssh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
            with os.fdopen(fd, "w") as f:
                f.write(f"#!/bin/sh\nHPFC_NETNS_HOSTS='{self.hosts_map}'\nexport HPFC_NETNS_HOSTS\n"
                        f"exec '{RSH}' \"$@\"\n")
            self.up = True
            return self
        except BaseException:
            self.teardown()
            raise

    def teardown(self, force: bool = False) -> None:
        """Kill everything in every node, delete the namespaces (the switch's too), their /etc/netns folders
        and the state dir. Idempotent; errors are ignored (it runs on the way out of a failure)."""
        listed = _sh("ip", "netns", "list", check=False).stdout.split() if shutil.which("ip") else []
        for node in self.node_ids:
            ns = self.ns(node)
            if ns in listed:
                self.kill_node(node)
                _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self.switch in listed:
            _sh("ip", "netns", "del", self.switch, check=False)
        if self.state_dir and not self._state_dir_arg:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        self.state_dir, self.up = None, False

    def __enter__(self) -> "Nodes":
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()

    # -- running things in a node -----------------------------------------------------------------------
    def wrap(self, node: int, argv: Sequence[str]) -> List[str]:
        """``argv`` as run inside ``node``: its network namespace, hosts file and hostname."""
        return ["ip", "netns", "exec", self.ns(node), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(node), *map(str, argv)]

    def popen(self, node: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """subprocess.Popen of ``argv`` inside ``node`` (keywords as Popen's: env, cwd, stdout, ...). Its
        own session by default, so ``os.killpg(p.pid, ...)`` reaches the whole job."""
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(self.wrap(node, argv), **kw)

    def run(self, node: int, argv: Sequence[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run to completion (text output captured); on a timeout, kill its process group and raise."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = self.popen(node, argv, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p.pid)
            p.communicate()
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def pids(self, node: int) -> List[int]:
        p = _sh("ip", "netns", "pids", self.ns(node), check=False)
        return [int(x) for x in p.stdout.split()]

    def kill_node(self, node: int) -> int:
        """SIGKILL every process in ``node``'s network namespace (repeated until none is left, so a fork in
        flight is caught too); the number killed."""
        killed = 0
        for _ in range(20):
            pids = [p for p in self.pids(node) if p != os.getpid()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return killed

    # -- faults -----------------------------------------------------------------------------------------
    def cut(self, both: bool = False, node: Optional[int] = None) -> None:
        """Partition ``node`` (default: the last) from the others: its end of the link goes down (and the
        switch's end with ``both``). No RST, no FIN."""
        node = self.node_ids[-1] if node is None else node
        _sh("ip", "-n", self.ns(node), "link", "set", self.ifname, "down")
        if both:
            _sh("ip", "-n", self.switch, "link", "set", f"p{node}", "down")

    def restore(self) -> None:
        """Every link up again."""
        for node in self.node_ids:
            _sh("ip", "-n", self.ns(node), "link", "set", self.ifname, "up")
            _sh("ip", "-n", self.switch, "link", "set", f"p{node}", "up")
        self._wait_up()

    def _wait_up(self, timeout: float = 5.0) -> None:
        """Until every node's end reports operstate UP (a veth reports DOWN for a few ms after `link set up`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(" UP " in _sh("ip", "-n", self.ns(n), "-br", "link", "show", self.ifname).stdout
                   for n in self.node_ids):
                return
            time.sleep(0.02)
        raise RuntimeError(f"{self.ifname} not up after {timeout} s")

    # -- environments and launcher command lines --------------------------------------------------------
    def env_for(self, node: int) -> Dict[str, str]:
        """Interface variables of every layer (torch gloo, horovod gloo, tensorpipe, NCCL): all hpfc0."""
        self._i(node)
        return {k: self.ifname for k in IFACE_VARS}

    def launch_env(self, node: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default os.environ) + env_for(node) + the host map, PATH = [ssh wrapper, this python's
        bin, ...], Open MPI allowed as root, output unbuffered."""
        e = dict(os.environ if base is None else base)
        e.update(self.env_for(node))
        e["HPFC_NETNS_HOSTS"] = self.hosts_map
        e["PATH"] = os.pathsep.join([self.bin_dir, BIN, e.get("PATH", "/usr/bin:/bin")])
        e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
        return e

    def torchrun_argv(self, node: int, script_argv: Sequence[str], nproc: int = 2, port: int = 29400,
                      rdzv_id: str = "hpfc-twonode", extra: Sequence[str] = (), rdzv_conf: str = "",
                      nnodes: Optional[str] = None) -> List[str]:
        """torchrun for ``node`` of a c10d rendezvous hosted on node 1 (is_host set explicitly: the hostname
        heuristic would do, but an explicit flag also makes the other nodes never try to host); ``nnodes``
        defaults to every node (an ``--nnodes`` in ``extra`` comes later and wins)."""
        return [os.path.join(BIN, "torchrun"), "--nnodes", nnodes or str(self.count), "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addr(1)}:{port}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", f"is_host={int(node == 1)}" + (f",{rdzv_conf}" if rdzv_conf else ""),
                "--local-addr", self.addr(node), *extra, *map(str, script_argv)]

    def mpirun_argv(self, argv: Sequence[str], slots: int = 2,
                    export: Sequence[str] = ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "HPFC_NETNS_HOSTS",
                                             *IFACE_VARS),
                    env: Optional[Dict[str, str]] = None, extra: Sequence[str] = ()) -> List[str]:
        """Open MPI's mpirun over every node (run it inside node 1, with launch_env(1)); ``-x`` for each
        name in ``export`` (only those set in ``env``, when given: mpirun warns about unset ones)."""
        x = [a for k in export if env is None or k in env for a in ("-x", k)]
        return ["mpirun", "--allow-run-as-root", "-np", str(self.count * slots),
                "--host", ",".join(f"{self.hostname(n)}:{slots}" for n in self.node_ids),
                "--mca", "plm_rsh_agent", RSH, "--mca", "btl_tcp_if_include", self.ifname,
                "--mca", "oob_tcp_if_include", self.ifname, "--bind-to", "none", *x, *extra, *map(str, argv)]

    def horovodrun_argv(self, argv: Sequence[str], slots: int = 2, backend: str = "gloo",
                        extra: Sequence[str] = ()) -> List[str]:
        """horovodrun over every node (run it inside node 1, with launch_env(1): its ``ssh`` is the
        wrapper). --network-interface skips horovodrun's interface probe (a task server per host)."""
        cmd = [os.path.join(BIN, "horovodrun"), "-np", str(self.count * slots), "-H",
               ",".join(f"{self.hostname(n)}:{slots}" for n in self.node_ids), f"--{backend}",
               "--network-interface", self.ifname, "--disable-cache"]
        if backend == "mpi":
            cmd += ["--mpi-args", f"--mca oob_tcp_if_include {self.ifname}"]
        return [*cmd, *extra, *map(str, argv)]


class TwoNodes(Nodes):
    """Two nodes (the harness's first shape; tests and docs use it by this name)."""

    def __init__(self, suffix: str = "", **kw):
        super().__init__(2, suffix=suffix, **kw)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


STATE_FILE = "hpfc-state-dir"   # in /etc/netns/<node 1's namespace>/ (root's): where `up` put its state dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down", "exec", "check"])
    ap.add_argument("node", nargs="?", type=int, help="exec: the node's number")
    ap.add_argument("--nodes", type=int, default=2, help="up: how many nodes (2 to 9)")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--subnet", default="10.77.0.0/24")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.action == "check":
        print(unavailable_reason() or "ok")
        return 0
    # The state dir (the ssh wrapper, run as root in every node) is a private mkdtemp folder; its path is
    # kept under /etc/netns, which only root writes, for `exec` and `down` to find.
    record = f"/etc/netns/{Nodes(2, suffix=a.suffix).ns(1)}/{STATE_FILE}"
    if a.action == "up":
        nodes = Nodes(a.nodes, suffix=a.suffix, subnet=a.subnet)
        try:
            nodes.setup()
        except Unavailable as e:
            print(f"unavailable: {e}", file=sys.stderr)
            return 2
        with open(record, "w") as f:
            f.write(f"{nodes.count} {nodes.state_dir}\n")
        print("  ".join(f"{nodes.ns(n)} {nodes.addr(n)}" for n in nodes.node_ids) + f"  ssh wrapper: {nodes.bin_dir}/ssh")
        return 0
    try:
        count, state_dir = open(record).read().split(maxsplit=1)
    except OSError:
        print(f"no node set is up with suffix {a.suffix!r} (run `up` first)", file=sys.stderr)
        return 2
    nodes = Nodes(int(count), suffix=a.suffix, subnet=a.subnet, state_dir=state_dir.strip())
    if a.action == "down":
        nodes.teardown(force=True)
        shutil.rmtree(state_dir.strip(), ignore_errors=True)
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.node not in nodes.node_ids or not cmd:
        ap.error(f"exec N -- CMD... (N one of {nodes.node_ids})")
    nodes.state_dir = state_dir.strip()
    return subprocess.call(nodes.wrap(a.node, cmd), env=nodes.launch_env(a.node))


if __name__ == "__main__":
    sys.exit(main())
