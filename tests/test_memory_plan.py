"""The pure parts of memory snapshots (run/memory*.py): who is whose buddy, which snapshot a recovery may take,
which old files a new rank reads, a folder two nodes share; and a start refused when they do not fit (one
process). The multi-rank runs: test_memory_snapshots.py."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, SMALL_RUN, launch_env
from hvd_partialfc.run.snapshots.memory_plan import Plan
from hvd_partialfc.run.snapshots.memory_recover import Held, Holding, choose, holders, needed_files
from hvd_partialfc.run.snapshots.memory_store import NodeStore
from hvd_partialfc.run.snapshots.node_memory import read_segments, write_segments
from hvd_partialfc.run.snapshots.snapshot_root import room_error
from hvd_partialfc.run_files import classifier_file


def test_every_buddy_is_on_another_node_and_every_node_holds_its_own_and_a_neighbours_files():
    keys = ["a", "a", "b", "b", "c", "c", "c"]          # nodes of 2, 2 and 3 ranks
    plan = Plan(keys)
    assert plan.nodes == [[0, 1], [2, 3], [4, 5, 6]] and [plan.writer(r) for r in range(7)] == [0, 0, 2, 2, 4, 4, 4]
    for r in range(7):
        assert keys[plan.buddy(r)] != keys[r]
    assert [plan.buddy(r) for r in range(7)] == [2, 3, 4, 5, 0, 1, 0]
    assert plan.hosted(0) == [0, 1, 4, 5, 6] and plan.hosted(1) == [0, 1, 2, 3] and plan.hosted(2) == [2, 3, 4, 5, 6]
    assert Plan(["a", "a", "a"]).buddy(1) is None           # one node: a copy would die with it


def _listing(step, committed, files, world=3, segment="0000000a"):
    meta = {"world_size": world, "slices": [[0, 8], [8, 16], [16, 24]][:world], "replicated": False}
    return {(segment, step): Held(committed, files, meta if "meta.json" in files else None)}


def _files(*ranks, world=3, extra=("backbone.pt", "meta.json")):
    return [classifier_file(r, world) for r in ranks] + list(extra)


def test_recovery_takes_the_newest_committed_step_that_every_slice_survives():
    # rank r's copies: its node and the next; node b lost: rank 1's own copy gone, its buddy's on c survives
    a = {**_listing(20, True, _files(0, 2)), **_listing(24, False, _files(0, 2))}
    c = {**_listing(20, True, _files(1, 2)), **_listing(24, False, _files(2))}
    everyone = [Holding("a", "", 0, a), Holding("c", "", 0, c)]
    seg = ["0000000a"]
    assert choose(everyone, 15, seg) == (("0000000a", 20), None)  # 24 never committed: half-sent, never used
    assert choose(everyone, 22, seg) == (None, None)               # the disk is newer
    # nodes b and c lost: rank 1's slice is nowhere
    snap, line = choose([Holding("a", "", 0, a)], 15, seg)
    assert snap is None and line.startswith("memory snapshot of step 20 cannot be restored: rank 1's slice")
    # a newer committed step with a hole, an older one whole: the older one, and the line names the newer
    a24 = {**a, **_listing(24, True, _files(0, 2))}
    snap, line = choose([Holding("a", "", 0, a24), Holding("c", "", 0, c)], 15, seg)
    assert snap == ("0000000a", 20) and line.startswith("memory snapshot of step 24 cannot be restored: rank 1's slice")
    # committed on one node only (its rename came first): the landing copy elsewhere is complete too
    c_partial = {**_listing(20, False, _files(1, 2))}
    assert choose([Holding("a", "", 0, a), Holding("c", "", 0, c_partial)], 0, seg) == (("0000000a", 20), None)


def test_a_node_that_rejoins_with_an_old_start_s_snapshots_is_never_restored_from_or_combined():
    """Nodes a and b restarted as segment 0000000b and committed step 30 (each holds both slices, 2 nodes);
    node c, lost before that start, comes back holding segment 0000000a's step 40, complete on its own, and
    its step 30 files. The restart takes b's 30, from a and b only: never c's newer 40 (an abandoned start's
    state), never c's files of 30 (another start's, though of the same step and names)."""
    new = {**_listing(30, True, _files(0, 1, world=2), world=2, segment="0000000b")}
    old = {**_listing(40, True, _files(0, 1, world=2), world=2), **_listing(30, True, _files(0, 1, world=2), world=2)}
    everyone = [Holding("a", "", 0, new), Holding("b", "", 0, new), Holding("c", "", 0, old)]
    assert choose(everyone, 0, ["0000000b"]) == (("0000000b", 30), None)
    assert holders(everyone, ("0000000b", 30), classifier_file(1, 2)) == [0, 1]
    # a record of an earlier version (segments only): the segment the last start restored from, whole
    assert choose(everyone, 0, ["0000000a", "0000000b"]) == (("0000000a", 40), None)


def test_a_rejoining_node_s_old_segment_gives_only_the_step_restored_from_it(tmp_path):
    """Three starts. Start 1 (segment a) committed steps 30 and 40. Start 2 (b), without node c, restored a's 30,
    the newest it saw (its record written as take_over writes it), and failed before its first snapshot. Start 3: node c
    rejoins with a's 40, whole and newer: an abandoned start's state, never taken (before: the record listed
    segment a whole, and 40 was restored); a's 30, which start 2 restored, is."""
    write_segments(str(tmp_path), "0000000b", ("0000000a", 30))
    admitted = read_segments(str(tmp_path))
    kept = _listing(30, True, _files(0, 1, world=2), world=2)                  # keep_only left 30 on a and b
    rejoined = {**kept, **_listing(40, True, _files(0, 1, world=2), world=2)}
    everyone = [Holding("a", "", 0, kept), Holding("b", "", 0, kept), Holding("c", "", 0, rejoined)]
    assert choose(everyone, 0, admitted) == (("0000000a", 30), None)


def test_a_new_rank_reads_only_the_old_files_its_slice_overlaps():
    meta = {"world_size": 3, "slices": [[0, 8], [8, 16], [16, 24]]}
    assert needed_files(meta, 1, [(0, 8), (8, 16), (16, 24)], False) == [classifier_file(1, 3)]
    assert needed_files(meta, 0, [(0, 12), (12, 24)], False) == [classifier_file(0, 3), classifier_file(1, 3)]
    assert needed_files(meta, 1, [(0, 12), (12, 24)], False) == [classifier_file(1, 3), classifier_file(2, 3)]
    assert needed_files(meta, 3, [(0, 6), (6, 12), (12, 18), (18, 24)], True) == [classifier_file(0, 3)]


def test_a_folder_that_two_nodes_share_is_found(tmp_path):
    store = NodeStore(str(tmp_path), "tok", str(tmp_path / "run"))
    store.open()
    store.mark_node("node1|boot|/dev/shm")
    assert store.other_nodes("node1|boot|/dev/shm", {"node1|boot|/dev/shm", "node2|boot|/dev/shm"}) is None
    store.mark_node("node2|boot|/dev/shm")
    assert store.other_nodes("node1|boot|/dev/shm", {"node1|boot|/dev/shm", "node2|boot|/dev/shm"}) == "node1, node2"
    # a mark of a node outside this job (another job's) is not this job's sharing
    assert store.other_nodes("node1|boot|/dev/shm", {"node1|boot|/dev/shm", "node3|boot|/dev/shm"}) is None
    assert json.loads(open(os.path.join(store.path, "owner.json")).read())["token"] == "tok"


def test_the_room_check_names_the_limit_that_is_short(tmp_path):
    assert room_error(str(tmp_path), 1, 1) is None
    line = room_error(str(tmp_path), 1 << 62, 2)
    assert line.startswith("checkpoint.memory_every: this node's snapshots need 4096.0 PB (the classifier slices of "
                           "its 2 rank(s)") and f"{tmp_path} has" in line and "memory available" in line


def test_snapshots_that_do_not_fit_are_refused_at_start_up(tmp_path, small_run_shards):
    """A node whose snapshot folder is smaller than two snapshots: one line with the figures, exit 2, before
    the first step."""
    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        env = dict(launch_env(), HVD_PARTIALFC_MEMORY_DIR=str(small))
        p = subprocess.run([sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", str(small_run_shards),
                            "--out", str(tmp_path / "run"), "--steps", "4", *sum((["--set", s] for s in SMALL_RUN
                            + ["checkpoint.memory_every=2", "model.kwargs={hidden_dim: 512}"]), [])],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        left = [d for d in os.listdir(small) if d.startswith("hvd_partialfc-")]
    finally:
        subprocess.run(["umount", str(small)])
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"\[rank 0\] error: checkpoint.memory_every: this node's snapshots need [0-9.]+ MB \(the "
                        r"classifier slices of its 1 rank\(s\) .*, but " + re.escape(str(small))
                        + r" has [0-9.]+ KB free; .*checkpoint.memory_every=0", line), p.stderr
    assert left == []                                           # nothing left behind in the small tmpfs
    assert not (tmp_path / "run" / "metrics.jsonl").exists()      # not one step trained


def _interruptible():
    """SIGINT as a terminal gives it: a suite started in the background (make test's single-process half) has
    it ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train_one(run, shards, sets, env=None, timeout=120, wait=True):
    """``hvd-partialfc train`` of the small job as one process (no launcher)."""
    cmd = [sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", str(shards), "--out", str(run),
           "--steps", "12", *sum((["--set", s] for s in SMALL_RUN + list(sets)), [])]
    e = dict(launch_env(), **(env or {}))
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e, cwd=ROOT)
    return subprocess.run(cmd, capture_output=True, text=True, env=e, cwd=ROOT, timeout=timeout,
                          preexec_fn=_interruptible)


def test_ctrl_c_keeps_the_snapshots_as_an_error_does(tmp_path, small_run_shards):
    """A user's Ctrl-C (KeyboardInterrupt, no checkpoint) after step 7: the snapshot of step 6 stays for the
    restart, as after an error (before, Ctrl-C and SystemExit removed them: the exit code was never set)."""
    root = tmp_path / "shm"
    root.mkdir()
    p = _train_one(tmp_path / "run", small_run_shards, ["checkpoint.memory_every=2", "checkpoint.every=0"],
                   env={"HVD_PARTIALFC_MEMORY_DIR": str(root), "HVD_PARTIALFC_FAULT": "sigint@7"})
    assert p.returncode != 0 and "KeyboardInterrupt" in p.stderr, p.stdout + p.stderr
    [store] = os.listdir(root)
    assert any(d.startswith("step-00000006.") and not d.endswith(".partial") for d in os.listdir(root / store))
