"""A CPU quota put on running processes from outside, as a container's limit or a noisy neighbour's share would
take a node's CPU: a cgroup of its own under the cpu controller (v2's ``cpu.max``, else v1's
``cpu.cfs_quota_us``), the processes moved into it. For the straggler watch's CPU-starved rank
(tests/test_stragglers_run.py, scripts/studies/stragglers.py). Needs root and a writable cgroup file system;
``Quota`` raises ``Unavailable`` (with why) elsewhere."""
from __future__ import annotations

import os
import time
from typing import List, Optional

PERIOD_US = 100_000
V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
V1_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")


class Unavailable(RuntimeError):
    pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _v2_root() -> Optional[str]:
    for root in V2_ROOTS:
        try:
            if "cpu" not in open(os.path.join(root, "cgroup.controllers")).read().split():
                continue
            if "cpu" not in open(os.path.join(root, "cgroup.subtree_control")).read().split():
                _write(os.path.join(root, "cgroup.subtree_control"), "+cpu")
            return root
        except OSError:
            continue
    return None


class Quota:
    """``share`` of one CPU (0.25: a quarter) for the processes ``add`` moves in; ``close`` removes the group
    once they have left it (exited, or moved back by ``close``)."""

    def __init__(self, share: float, name: str):
        quota = max(1000, int(share * PERIOD_US))
        self.v2 = _v2_root()
        roots = [self.v2] if self.v2 else [r for r in V1_ROOTS if os.path.isdir(r)]
        errors: List[str] = []
        for root in roots:
            path = os.path.join(root, name)
            try:
                os.makedirs(path, exist_ok=True)
                if self.v2:
                    _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
                else:
                    _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
                    _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
                self.path, self.root = path, root
                return
            except OSError as e:
                errors.append(f"{path}: {e.strerror}")
        raise Unavailable("no writable cgroup cpu controller (" + ("; ".join(errors) or "none mounted") + ")")

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def close(self) -> None:
        """Moves any process left back to the root group, then removes the group (a few tries: an exiting
        process leaves it a moment later)."""
        for _ in range(50):
            try:
                for pid in open(os.path.join(self.path, "cgroup.procs")).read().split():
                    try:
                        _write(os.path.join(self.root, "cgroup.procs"), pid)
                    except OSError:
                        pass
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
