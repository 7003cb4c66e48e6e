"""The pieces of the chaos run (scripts/faults/chaos.py): its data, its watch over the run, its jobs, its checks.

* ``tiny_faces``: an encoded JPEG shard set (32x32 faces of class templates plus noise), so that a sample can
  be made undecodable;
* ``Watch``: tails the run's metrics.jsonl (rank 0 writes a record a step: step, world size, time) and the
  launchers' logs (every "resumed from", "cannot be decoded", "not written" line), in the driver's process;
* ``TorchrunJob`` (elastic torchrun, one agent a node, a fresh store every round) and ``WrapperJob``
  (launch/horovod_restarts.py on node 1, horovodrun over the listed nodes): start, signal, requeue, wait;
* ``checkpoint_ok`` / ``digests``: a checkpoint is complete, loads, its ranks agree; the parts of a run's last
  checkpoint that a bitwise comparison looks at.
"""
from __future__ import annotations

import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BIN = os.path.dirname(sys.executable)
RESUMED = re.compile(r"resumed from (.+?) at step (\d+) \(written by (\d+) ranks\)")


def tiny_faces(out: str, classes: int = 48, per_class: int = 8, num_shards: int = 4, seed: int = 0) -> str:
    """``classes`` x ``per_class`` 32x32x3 JPEGs (a random template a class, plus noise), ``num_shards``
    encoded shards in ``out``."""
    from PIL import Image
    from data_tools.shard_writer import write_shard_set
    from hvd_partialfc.data.partition import even_slices
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, (classes, 32, 32, 3))
    blobs, labels = [], []
    for c in range(classes):
        for _ in range(per_class):
            img = np.clip(templates[c] + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
            labels.append(c)
    write_shard_set(out, "encoded", blobs, np.asarray(labels), even_slices(classes, num_shards), classes,
                    sample_shape=[32, 32, 3])
    return out


def make_undecodable(shard_dir: str, rng) -> str:
    """Truncate one random sample of one random shard to 40 bytes: a copy of the shard file with it, moved over
    the file (os.replace), so a rank that has the old file open reads it unchanged and the next one to open it
    (a restart) finds the damaged sample. The sample, as the loader names it."""
    import h5py
    files = sorted(glob.glob(os.path.join(shard_dir, "shard-*.h5")))
    path = files[int(rng.integers(len(files)))]
    tmp = path + ".chaos"
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        dst.write(src.read())
    with h5py.File(tmp, "r+") as f:
        i = int(rng.integers(len(f["encoded"])))
        f["encoded"][i] = np.asarray(f["encoded"][i][:40], np.uint8)
    os.replace(tmp, path)
    return f"{os.path.basename(path)}: sample {i}"


class Watch:
    """What the run says: metrics.jsonl's records and the logs' lines, each with the time the driver saw it."""

    def __init__(self, run: str, log_dir: str):
        self.metrics, self.log_dir = os.path.join(run, "metrics.jsonl"), log_dir
        self.records: List[dict] = []
        self.lines: List[Tuple[float, str]] = []
        self._offsets: Dict[str, int] = {}

    def _read(self, path: str) -> List[str]:
        try:
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1                     # whole lines only
        self._offsets[path] = self._offsets.get(path, 0) + end
        return data[:end].decode(errors="replace").replace("\r", "\n").splitlines()

    def poll(self) -> None:
        for line in self._read(self.metrics):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "loss" in rec:
                self.records.append(rec)
        now = time.time()
        for path in sorted(glob.glob(os.path.join(self.log_dir, "*.log"))):
            self.lines += [(now, line) for line in self._read(path) if line.strip()]

    @property
    def step(self) -> int:
        return self.records[-1]["step"] if self.records else 0

    @property
    def world(self) -> int:
        return self.records[-1].get("world_size", 0) if self.records else 0

    def wait(self, condition: Callable[[], bool], timeout: float, what: str, alive: Callable[[], bool] = None):
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if condition():
                return
            if time.monotonic() > deadline:
                raise ChaosError(f"timed out after {timeout:.0f} s: {what}")
            if alive is not None and not alive():
                self.poll()
                if condition():
                    return
                raise ChaosError(f"the job ended while waiting: {what}")
            time.sleep(0.1)

    def resumes(self, since: float) -> List[Tuple[float, int, int]]:
        """(time seen, step, ranks that wrote it) of every "resumed from" line seen after ``since``."""
        out = []
        for t, line in self.lines:
            m = RESUMED.search(line)
            if m and t >= since:
                out.append((t, int(m.group(2)), int(m.group(3))))
        return out

    def resumed_from_memory(self, step: int, since: float) -> bool:
        """Whether the resume at ``step`` after ``since`` restored a memory snapshot (run/snapshots/memory_recover.py)."""
        return any(m and m.group(2) == str(step) and "memory snapshot" in m.group(1)
                   for m in (RESUMED.search(line) for t, line in self.lines if t >= since))

    def said(self, text: str, since: float = 0.0) -> List[str]:
        return [line for t, line in self.lines if t >= since and text in line]

    def went_on(self, step: int, since: float) -> Optional[dict]:
        """The first record of step ``step + 1`` written after ``since``: training went on from ``step``."""
        return next((r for r in self.records if r["step"] == step + 1 and r["time"] >= since - 1.0), None)


class ChaosError(RuntimeError):
    pass


def trainers(nodes, node: int) -> List[int]:
    """The training processes in ``node``: ``python ... -m hvd_partialfc.cli``, not a launcher holding that
    command line as its arguments (torchrun, horovodrun, the restart wrapper)."""
    out = []
    for pid in nodes.pids(node):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        launcher = any(w.endswith(("torchrun", "horovodrun", "horovod_restarts.py")) for w in words)
        if "hvd_partialfc.cli" in words and not launcher and "python" in os.path.basename(words[0]):
            out.append(pid)
    return out


def _popen(nodes, node: int, argv: Sequence[str], env: Dict[str, str], log: str) -> subprocess.Popen:
    return nodes.popen(node, argv, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


class TorchrunJob:
    """Elastic torchrun, one agent (one rank) a node, c10d rendezvous on node 1, each round a new store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's shared store a node that joins back hangs its
    rendezvous, docs/engines.md). ``requeue`` starts every agent again under a new rendezvous id, as a
    scheduler's requeue of the job does."""

    def __init__(self, nodes, train_argv: Sequence[str], port: int, log_dir: str, min_nodes: int,
                 memory: Optional[str] = None, env: Optional[Dict[int, Dict[str, str]]] = None):
        self.nodes, self.train_argv, self.port, self.log_dir = nodes, list(train_argv), port, log_dir
        self.min_nodes, self.queue, self.launches = min_nodes, 0, 0
        self.agents: Dict[int, subprocess.Popen] = {}
        self.memory = memory      # a folder for each node's memory-snapshot root (checkpoint.memory_every)
        self.extra_env = env or {}   # more variables for a node's agent (a planned fault)

    def fault_file(self, node: int) -> str:
        """The node's fault file (run/watch/faults.py ``HVD_PARTIALFC_FAULT_FILE``), read by its ranks at every step."""
        return os.path.join(self.log_dir, f"faults-node{node}")

    def make_slow(self, node: int, slow: bool) -> None:
        """The node's ranks twice as slow from their next step (``slow@0`` in its fault file), or no longer."""
        path = self.fault_file(node)
        if slow:
            with open(path + ".tmp", "w") as f:
                f.write("slow@0\n")
            os.replace(path + ".tmp", path)
        elif os.path.exists(path):
            os.remove(path)

    def memory_root(self, node: int) -> str:
        return os.path.join(self.memory, f"node{node}")

    def lose_memory(self, node: int) -> None:
        """The node's memory is gone with it (a machine lost): its snapshot root emptied."""
        if self.memory:
            shutil.rmtree(self.memory_root(node), ignore_errors=True)
            os.makedirs(self.memory_root(node))

    def env(self, node: int) -> Dict[str, str]:
        e = dict(self.nodes.launch_env(node), PYTHONPATH=ROOT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 HVD_PARTIALFC_FAULT_FILE=self.fault_file(node), HVD_PARTIALFC_SLOW_FACTOR="2")
        e.update(self.extra_env.get(node, {}))
        if self.memory:
            os.makedirs(self.memory_root(node), exist_ok=True)
            e["HVD_PARTIALFC_MEMORY_DIR"] = self.memory_root(node)
        return e

    def start(self, node: int) -> None:
        argv = self.nodes.torchrun_argv(
            node, self.train_argv, nproc=1, port=self.port,
            rdzv_id=f"chaos-{self.queue}", nnodes=f"{self.min_nodes}:{self.nodes.count}",
            extra=["--max-restarts", "1000", "--monitor-interval", "0.5"],
            rdzv_conf="last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3")
        self.launches += 1
        self.agents[node] = _popen(self.nodes, node, argv, self.env(node),
                                   os.path.join(self.log_dir, f"torchrun-node{node}-{self.launches:03d}.log"))

    def workers(self, node: int) -> List[int]:
        return trainers(self.nodes, node)

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.agents.values())

    def forget(self, node: int) -> None:
        """``node`` is gone (its agent killed with it): the job's end no longer waits for it."""
        self.agents.pop(node, None)

    def signal_all(self, sig: int) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                _signal_agent(p, sig)

    def requeue(self, up: Sequence[int]) -> None:
        self.queue += 1
        self.port += 1
        self.agents = {}
        for node in sorted(up):
            self.start(node)
            time.sleep(0.3)

    def wait(self, timeout: float) -> Dict[int, int]:
        deadline = time.monotonic() + timeout
        for p in self.agents.values():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ChaosError(f"the job did not end within {timeout:.0f} s") from None
        return {n: p.returncode for n, p in self.agents.items()}


def _signal_agent(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to the launcher inside its node (the Popen is ``ip netns exec``'s, which execs down to it)."""
    try:
        os.kill(p.pid, sig)
    except ProcessLookupError:
        pass


class WrapperJob:
    """launch/horovod_restarts.py on node 1 over every node (one rank each), Gloo; the discovery script lists
    the nodes. Its exit 75 (every rank stopped on a signal, checkpointed) is requeued by ``requeue``."""

    def __init__(self, nodes, train_argv: Sequence[str], log_dir: str, state_dir: str):
        self.nodes, self.train_argv, self.log_dir = nodes, list(train_argv), log_dir
        self.discovery = os.path.join(state_dir, "hosts.sh")
        with open(self.discovery, "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {nodes.hostname(n)}:1\n" for n in nodes.node_ids))
        os.chmod(self.discovery, 0o755)
        self.proc: Optional[subprocess.Popen] = None
        self.launches = 0

    def start(self) -> None:
        argv = [sys.executable, os.path.join(ROOT, "launch", "horovod_restarts.py"), "--max-restarts", "1000",
                "--discovery", self.discovery, "--horovodrun", os.path.join(BIN, "horovodrun"),
                f"--horovodrun-args=--gloo --network-interface {self.nodes.ifname} --disable-cache", "--",
                *self.train_argv]
        self.launches += 1
        self.proc = _popen(self.nodes, 1, argv, dict(self.nodes.launch_env(1), PYTHONPATH=ROOT),
                           os.path.join(self.log_dir, f"wrapper-{self.launches:03d}.log"))

    def workers(self, node: int) -> List[int]:
        return trainers(self.nodes, node)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def requeue(self, up: Sequence[int] = ()) -> None:
        self.start()

    def wait(self, timeout: float) -> Dict[int, int]:
        try:
            return {1: self.proc.wait(timeout=timeout)}
        except subprocess.TimeoutExpired:
            raise ChaosError(f"the job did not end within {timeout:.0f} s") from None


def checkpoint_ok(run: str) -> Tuple[bool, int, str]:
    """(valid, step, why): ``latest`` names a complete checkpoint whose files load (weights only) and whose
    ranks' backbones agree."""
    import torch
    from hvd_partialfc.run_files import read_meta, resolve_checkpoint
    try:
        path = resolve_checkpoint(run)
        meta = read_meta(path)
        for name in ["backbone.pt"] + list(meta["classifier_files"]):
            torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (what is wrong is the answer)
        return False, -1, f"{type(e).__name__}: {e}"
    if not meta.get("identical") or len(set(meta["digests"])) != 1:
        return False, meta["step"], "its ranks' backbones differ"
    return True, meta["step"], ""


def digests(run: str) -> Dict[str, str]:
    """sha256 of the last checkpoint's backbone (BatchNorm statistics included), its optimizer, and every rank's
    classifier rows and optimizer state: what a bitwise comparison of two runs looks at."""
    import torch
    from hvd_partialfc.run_files import read_meta, resolve_checkpoint
    path = resolve_checkpoint(run)
    meta = read_meta(path)
    load = lambda name: torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)  # noqa: E731
    bb = load("backbone.pt")
    out = {"step": str(meta["step"]), "backbone": _digest(bb["state_dict"]), "backbone_optimizer": _digest(bb["optimizer"])}
    for r, name in enumerate(meta["classifier_files"]):
        f = load(name)
        out[f"rank{r}.classifier"] = _digest({"weight": f["weight"], "optimizer": f["optimizer"]})
    return out


def _digest(obj) -> str:
    """sha256 of nested dicts / lists of tensors (dtype, shape, bytes) and plain values (repr), keys sorted."""
    import hashlib
    import torch
    h = hashlib.sha256()

    def feed(o):
        if torch.is_tensor(o):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(f"K{k!r}".encode())
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(b"[")
            for v in o:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())
    feed(obj)
    return h.hexdigest()


def fill_disk(mount: str, leave_bytes: int) -> str:
    """Fill the file system of ``mount`` until ``leave_bytes`` are free (a file ``.chaos-fill`` there)."""
    path = os.path.join(mount, ".chaos-fill")
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        left = max(0, free - leave_bytes)
        chunk = b"\0" * (1 << 20)
        try:
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass
    return path


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
