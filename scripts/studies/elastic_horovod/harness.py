"""Start an elastic ``horovodrun --gloo`` on this machine, change its discovery file, read its workers' JSON events.

Hosts are names of this machine, one slot each (``127.0.0.1``, ``localhost``, ``vm``, ...): horovodrun runs a
host locally when the name resolves to one of the machine's addresses, and a failed worker blacklists its whole
host, so one slot per name makes "a host" = "a worker". Used by ``study.py``.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
# Names that resolve to 127.0.0.1 here (/etc/hosts, or inet_aton's short forms): five one-slot "hosts".
HOSTS = ["127.0.0.1", "localhost", "vm", "runsc", "127.1"]


class Job:
    """One elastic horovodrun; ``events`` holds the workers' JSON lines (with ``recv``, when read)."""

    def __init__(self, hosts, min_np, max_np, np, worker="worker.py", env=None, extra_args=(), log=None):
        self.dir = tempfile.mkdtemp(prefix="elastic_hvd_")
        self.hostfile = os.path.join(self.dir, "hosts")
        self.set_hosts(hosts)
        disc = os.path.join(self.dir, "discover.sh")
        with open(disc, "w") as f:
            f.write(f"#!/bin/sh\ncat {self.hostfile}\n")
        os.chmod(disc, 0o755)
        cmd = [HOROVODRUN, "--gloo", "--network-interface", "lo", "-np", str(np), "--min-np", str(min_np),
               "--max-np", str(max_np), "--host-discovery-script", disc, *extra_args,
               sys.executable, os.path.join(HERE, worker)]
        full_env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME="10", **(env or {}))
        self.events, self.lines = [], []
        self.log = log or os.path.join(self.dir, "job.log")
        self.t_start = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        with open(self.log, "w") as logf:
            for line in self.proc.stdout:
                now = time.time()
                logf.write(f"{now:.3f} {line}")
                logf.flush()
                self.lines.append(line.rstrip("\n"))
                i = line.find("{\"ev\"")
                if i >= 0:
                    try:
                        ev = json.loads(line[i:])
                    except ValueError:
                        continue
                    ev["recv"] = now
                    self.events.append(ev)

    def set_hosts(self, hosts):
        """Write the discovery file atomically (``host:slots`` lines); returns the time it was written."""
        tmp = self.hostfile + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(f"{h}\n" for h in hosts))
        os.replace(tmp, self.hostfile)
        return time.time()

    def find(self, ev, after=0.0, **match):
        return [e for e in self.events if e["ev"] == ev and e["t"] >= after
                and all(e.get(k) == v for k, v in match.items())]

    def wait(self, pred, timeout, what):
        end = time.time() + timeout
        while time.time() < end:
            r = pred()
            if r:
                return r
            if self.proc.poll() is not None and not pred():
                raise RuntimeError(f"horovodrun exited ({self.proc.returncode}) waiting for {what}")
            time.sleep(0.05)
        raise TimeoutError(f"{timeout:.0f} s waiting for {what}; log: {self.log}")

    def wait_size(self, size, n, after, timeout=60):
        """The first allreduce of ``n`` workers at ``size`` after ``after``: their events."""
        return self.wait(lambda: (lambda r: r if len(r) >= n else None)(
            self.find("first_allreduce", after=after, size=size)), timeout, f"{n} workers at size {size}")

    def steady(self, size, timeout=90):
        """Every worker has synced at ``size``: the ``members`` events (rank order)."""
        evs = self.wait(lambda: (lambda r: r if len(r) >= size else None)(
            self.find("members", size=size)), timeout, f"{size} members")
        return sorted(evs[-size:], key=lambda e: e["rank"])

    def finish(self, timeout=60):
        """Wait for horovodrun's end; past ``timeout`` end its process group (ours). Returns its exit code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return "killed after timeout"
        finally:
            self.kill_workers()
            self._reader.join(5)

    def kill_workers(self):
        """SIGKILL any worker of this job still alive (the pids its events named; workers run in their own
        sessions, so ending horovodrun's group does not reach them)."""
        for pid in {e["pid"] for e in self.events}:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if HERE.encode() not in f.read():
                        continue
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass
