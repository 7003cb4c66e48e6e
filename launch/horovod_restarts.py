#!/usr/bin/env python3
"""Restart a ``horovodrun`` training job from its checkpoints when a rank or a host is lost, on the hosts
that are left: the Horovod counterpart of ``torchrun --max-restarts``, for elastic runs (docs/engines.md).

    launch/horovod_restarts.py --max-restarts 3 --discovery ./hosts.sh [--max-np 64] \\
        [--horovodrun-args="--gloo --network-interface eth0"] -- hvd-partialfc train --config run.yaml

``--discovery`` names a script that prints the usable hosts, one ``host:slots`` a line (the format of
Horovod elastic's ``--host-discovery-script``); without it every attempt runs ``--np`` ranks on this host.
Each attempt runs ``horovodrun -np N -H h1:s1,h2:s2 ... CMD --set checkpoint.resume=auto`` with N the
slots found (at most ``--max-np``: a run needs N <= its shard count), and ``HVD_PARTIALFC_RESTART_COUNT``
set to the attempt. How an attempt ended decides what follows (``outcome``):

* 0: done, exit 0;
* **75**, preempted (a stop signal: every rank checkpointed): the wrapper exits 75, for the scheduler to
  requeue the job (the same command resumes);
* **2**, a user's error (a config, shard set or checkpoint every rank refuses, a full disk): exit 2, no
  restart (the same error would come back; before, a bad config ran ``--max-restarts`` + 1 times);
* anything else (a rank killed, a lost host, a crash): the next attempt, until ``--max-restarts``.

horovodrun turns any rank's non-zero exit into its own 1, so the ranks say how they ended: each attempt
gets a fresh folder (``HVD_PARTIALFC_EXIT_DIR``, in the working directory when it is writable, else the
temporary one) where every rank that sees it writes its exit status as it ends (``cli_support.record_exit``).
A stop and a user's error are agreed by every rank, so one rank's file suffices: ranks on the wrapper's
host always see the folder, all of them do on a shared file system. Before, a SIGTERM to a rank (both ranks
exited 75) was restarted: "attempt 0 exited 1; restarting from the last checkpoint".

Horovod's elastic mode keeps the survivors' processes instead (``launch/horovodrun_elastic.sh``: they re-form the
group and resume the run's newest state in place; docs/reliability.md, "Going on in the same processes"). This
wrapper is for a plain horovodrun, and for what ends every worker even under the elastic mode (a rendezvous that
timed out, no old host left): it starts the job again from its last checkpoint.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

EXIT_PREEMPTED = 75
EXIT_USER_ERROR = 2
EXIT_DIR_ENV = "HVD_PARTIALFC_EXIT_DIR"     # read by hvd_partialfc/cli_support.py, record_exit


def discover(script: str) -> List[Tuple[str, int]]:
    """``host:slots`` lines printed by ``script`` (a host without ``:slots`` has one slot)."""
    out = subprocess.run([script], capture_output=True, text=True, check=True).stdout
    hosts = []
    for line in filter(None, (x.strip() for x in out.splitlines())):
        host, _, slots = line.partition(":")
        hosts.append((host, int(slots or 1)))
    return hosts


def outcome(rc: int, codes: Dict[int, int]) -> Optional[int]:
    """The wrapper's exit after an attempt that horovodrun ended with ``rc`` and whose ranks wrote ``codes``
    (rank -> status), or None to restart: 0 when done; 2 when any rank says 2 (a user's error: agreed, every
    rank refuses); 75 when any rank says 75: a rank exits 75 only after the stop's checkpoint, which every
    rank wrote (agreed), and horovodrun may end the others before they write their file; else None."""
    if rc == 0:
        return 0
    if EXIT_USER_ERROR in codes.values():
        return EXIT_USER_ERROR
    if rc == EXIT_PREEMPTED or EXIT_PREEMPTED in codes.values():
        return EXIT_PREEMPTED
    return None


def _exit_folder() -> str:
    """A fresh folder for the ranks' exit statuses: in the working directory when writable (often a file
    system every host shares), else the temporary one (this host's ranks)."""
    try:
        return tempfile.mkdtemp(prefix=".hpfc-exit-", dir=os.getcwd())
    except OSError:
        return tempfile.mkdtemp(prefix="hpfc-exit-")


def _read_codes(folder: str) -> Dict[int, int]:
    codes = {}
    for path in glob.glob(os.path.join(folder, "rank-*")):
        try:
            codes[int(os.path.basename(path)[5:])] = int(open(path).read().strip())
        except (OSError, ValueError):
            pass
    return codes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--discovery", help="script printing host:slots lines (default: --np on localhost)")
    p.add_argument("--np", type=int, default=1, help="ranks on localhost when there is no --discovery")
    p.add_argument("--max-np", type=int, default=0, help="at most this many ranks (0: every slot)")
    p.add_argument("--horovodrun", default="horovodrun")
    p.add_argument("--horovodrun-args", default="", help="more horovodrun arguments, one string")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the training command")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no training command (after --)")
    rc = 1
    for attempt in range(a.max_restarts + 1):
        hosts = discover(a.discovery) if a.discovery else [("localhost", a.np)]
        np_ = sum(s for _, s in hosts)
        if a.max_np:
            np_ = min(np_, a.max_np)
        if np_ < 1:
            print(f"[horovod_restarts] attempt {attempt}: no hosts left", file=sys.stderr, flush=True)
            return rc
        spec = ",".join(f"{h}:{s}" for h, s in hosts)
        argv_ = [a.horovodrun, "-np", str(np_), "-H", spec, *shlex.split(a.horovodrun_args), *cmd,
                 "--set", "checkpoint.resume=auto"]
        print(f"[horovod_restarts] attempt {attempt}: {np_} ranks on {spec}", file=sys.stderr, flush=True)
        t0 = time.time()
        folder = _exit_folder()
        try:
            rc = subprocess.call(argv_, env=dict(os.environ, HVD_PARTIALFC_RESTART_COUNT=str(attempt),
                                                 **{EXIT_DIR_ENV: folder}))
            codes = _read_codes(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        said = f" (ranks: {', '.join(f'{r}: {c}' for r, c in sorted(codes.items()))})" if codes else ""
        end = outcome(rc, codes)
        if end is not None:
            if end:
                why = "preempted: every rank checkpointed; requeue the job to resume" if end == EXIT_PREEMPTED \
                    else "a user's error every rank refuses: not restarted"
                print(f"[horovod_restarts] attempt {attempt} exited {rc}{said}; {why}; exit {end}",
                      file=sys.stderr, flush=True)
            return end
        print(f"[horovod_restarts] attempt {attempt} exited {rc}{said} after {time.time() - t0:.1f} s; "
              f"{'restarting from the last checkpoint' if attempt < a.max_restarts else 'no restarts left'}",
              file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
