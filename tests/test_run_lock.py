"""One job a run folder (run/watch/run_lock.py): while a job trains, a second one in the same run folder waits
``checkpoint.lock_wait`` seconds, then refuses in one line naming the holder; doctor names it too; the lock
goes with its process (a SIGKILL here; every restart test shows it as well: test_elastic.py, test_chaos.py).
In a run folder its group shares, every member takes the lock in turn and each is told the truth."""
from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import tempfile
import time

import pytest

from hvd_partialfc.run.watch.run_lock import CannotTell, hold, in_use
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


def _as(uid, gid, groups, work, keep=False):
    """``work()``'s result (JSON) from a forked child that runs as ``uid`` (``gid``, supplementary ``groups``,
    umask 022): no interpreter to start, so the user needs no access to this one. ``keep``: the child stays
    (holding what it took) until the returned ``end()``. (result, the child's pid, end)."""
    r, w = os.pipe()
    stay_r, stay_w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child: no pytest on the way out (os._exit)
        code = 0
        try:
            os.close(r)
            os.close(stay_w)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o022)
            out = json.dumps(work())
        except BaseException as e:
            out, code = json.dumps(f"child error: {e!r}"), 1
        os.write(w, out.encode())
        os.close(w)
        if keep:
            os.read(stay_r, 1)                        # until the parent closes its end
        os._exit(code)
    os.close(w)
    os.close(stay_r)
    with os.fdopen(r) as f:
        result = json.loads(f.read())

    def end():
        os.close(stay_w)
        os.waitpid(pid, 0)
    if not keep:
        end()
    return result, pid, end


def _tell(run):
    """``in_use``'s answer, "cannot tell" for ``CannotTell``."""
    try:
        return in_use(run)
    except CannotTell as e:
        return f"cannot tell: {e}"


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as two users of one group needs root")
def test_each_member_of_a_group_shared_run_folder_takes_the_lock_in_turn_and_is_told_the_truth():
    """root and nobody share a group (a free gid: nobody's own group stays its primary one, the shared one a
    supplementary group, as for a member on a cluster); the run folder is the group's (2770). Before, the lock
    file was made 0644: nobody was refused for ever ("Permission denied") and told "not in use" while root held
    it. A stranger (nobody without the group) cannot see into the folder: "cannot tell", not "not in use". A
    lock file an earlier version left (root's, 0644) refuses the member in words until root's next start."""
    nobody = pwd.getpwnam("nobody")
    taken = {g.gr_gid for g in grp.getgrall()}
    group = next(g for g in range(61000, 62000) if g not in taken)
    base = tempfile.mkdtemp(prefix="hvdpfc-shared-")
    try:
        os.chmod(base, 0o755)
        run = os.path.join(base, "run")
        os.mkdir(run)
        os.chown(run, 0, group)
        os.chmod(run, 0o2770)
        member = (nobody.pw_uid, nobody.pw_gid, [group])
        root = (0, 0, [group])

        def take():
            return [hold(run, 0, say=lambda line: None), _tell(run)]

        def try_and_look():
            return [hold(run, 0, say=lambda line: None), _tell(run),
                    [(c.status, c.what) for c in check_run_folder(run)]]

        (took, told), root_pid, end = _as(*root, take, keep=True)
        assert took is None and told == "this process"
        st = os.stat(os.path.join(run, "lock"))
        assert st.st_gid == group and st.st_mode & 0o060 == 0o060, oct(st.st_mode)
        (refused, told, [(status, what)]), _, _ = _as(*member, try_and_look)
        assert refused is not None and refused.startswith(
            f"the run folder {run} is in use by another job (host "), refused
        assert f", pid {root_pid}, since " in refused and f", pid {root_pid}, since " in told, told
        assert status == NOTE and "in use by a job training now" in what and f"pid {root_pid}" in what, what
        (stranger, _, _) = _as(nobody.pw_uid, nobody.pw_gid, [], lambda: _tell(run))
        assert stranger == f"cannot tell: {os.path.join(run, 'lock')}: Permission denied", stranger
        end()                                         # root's job ends: its lock goes with it

        (took, told), member_pid, end = _as(*member, take, keep=True)
        assert took is None and told == "this process"
        assert f", pid {member_pid}, since " in in_use(run)                      # root, from here
        (refused, told, _), _, _ = _as(*root, try_and_look)
        assert refused is not None and "in use by another job (host " in refused and f", pid {member_pid}, " in refused
        end()
        assert in_use(run) is None and _as(*member, lambda: _tell(run))[0] is None

        lock = os.path.join(run, "lock")               # as an earlier version left it: root's, 0644
        os.chmod(lock, 0o644)
        refused = _as(*member, lambda: hold(run, 0, say=lambda line: None))[0]
        assert refused == (f"the run folder's lock {lock} is root's, mode 0644, and not writable by this user, so "
                           "this job cannot take it; no job holds it now. Its owner's next start here makes it "
                           f"writable by the folder's group (or: chmod g+w {lock}), or remove it while no job runs")
        _as(*root, take)                              # its owner's next start
        assert _as(*member, lambda: hold(run, 0, say=lambda line: None))[0] is None
    finally:
        shutil.rmtree(base, ignore_errors=True)
