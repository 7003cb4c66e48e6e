"""The ring heartbeat (engine/heartbeat.py): a rank that goes silent without closing its connection (frozen
here by SIGSTOP: no beat and no FIN, what a cut link or a lost node looks like to its peers) ends the rank
waiting on it within the timeout, naming it; a rank whose main thread is busy for three timeouts (a long
evaluation) is not taken for lost. The cut link itself: tests/test_twonode.py."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import MR, launch_env

pytestmark = pytest.mark.multirank


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode, timeout):
    port, procs = _free_port(), []
    for r in range(2):
        env = dict(launch_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HVD_PARTIALFC_CHECK_COLLECTIVES="1")
        procs.append(subprocess.Popen([sys.executable, os.path.join(MR, "heartbeat_job.py"), mode, str(timeout)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_a_silent_peer_ends_the_waiting_rank_naming_it():
    timeout = 2.0
    procs = _start("freeze", timeout)
    try:
        out0, _ = procs[0].communicate(timeout=60)
        ended = time.time()
        up = float(out0.split("ring up at ")[1].split()[0])
        assert procs[0].returncode == 1
        assert "[rank 0] error: lost peer rank 1" in out0 and f"no heartbeat for {timeout:g} s" in out0
        # it waited for the timeout (the peer is silent, not gone), and not much longer
        assert timeout <= ended - up < timeout + 10, ended - up
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.communicate()


def test_a_busy_rank_is_not_taken_for_a_lost_one():
    procs = _start("busy", 1.0)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(f"[rank {r}] done" in o and "lost peer" not in o for r, o in enumerate(outs))
