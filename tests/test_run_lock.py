"""One job a run folder (run/watch/run_lock.py): while a job trains, a second one in the same run folder waits
``checkpoint.lock_wait`` seconds, then refuses in one line naming the holder; doctor names it too; the lock
goes with its process (a SIGKILL here; every restart test shows it as well: test_elastic.py, test_chaos.py)."""
from __future__ import annotations

import os
import re
import time

from hvd_partialfc.run.watch.run_lock import in_use
from hvd_partialfc.tools.doctor import NOTE, check_run_folder
from test_memory_plan import _train_one


def test_a_second_job_in_the_run_folder_is_refused_naming_the_first(tmp_path, small_run_shards):
    run = tmp_path / "run"
    first = _train_one(run, small_run_shards, [], env={"HVD_PARTIALFC_FAULT": "stall@3",
                                                       "HVD_PARTIALFC_STALL_SECONDS": "60"}, wait=False)
    try:
        while not (run / "config.yaml").exists():  # the first job holds the lock (then trains, and stalls)
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.2)
        second = _train_one(run, small_run_shards, ["checkpoint.lock_wait=1"])
        [busy] = check_run_folder(str(run))         # doctor says so too
    finally:
        first.kill()
        first.wait()
    assert busy.status == NOTE and f"pid {first.pid}" in busy.what and in_use(str(run)) is None   # gone with it
    assert second.returncode == 2, second.stdout + second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"\[rank 0\] error: the run folder {re.escape(str(run))} is in use by another job \(host \S+, pid "
        rf"{first.pid}, since [0-9: -]+ UTC\): two jobs would write each other's checkpoints; wait for it to end "
        r"\(or stop it\), or train into another --out", line), second.stderr
    assert f"waiting up to 1 s for the run folder {run}" in second.stdout
    assert not os.path.exists(run / "checkpoints")       # the second wrote nothing; the first was stopped early
