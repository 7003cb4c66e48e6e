"""``hvd-partialfc doctor``: its exit codes with a bad shard set and with Horovod's import blocked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from conftest import BLOCK_HOROVOD, ROOT, launch_env

FEATURES = os.path.join(ROOT, "tests", "fixtures", "pins", "data", "features")   # 2 shards, 40 classes
SMALL = ["--set", "model.name=mlp", "--set", "model.embedding_dim=16"]


def _doctor(capsys, *args):
    from hvd_partialfc.cli import main
    capsys.readouterr()
    rc = main(["doctor", *map(str, args)])
    return rc, capsys.readouterr().out


def _line(out, start):
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def test_shard_set_that_fits_reports_layout_and_memory(capsys, tmp_path):
    """2 ranks on 2 shards: ok, and the memory line is the estimator's figure for that config."""
    from hvd_partialfc.sizes import human
    from hvd_partialfc.tools.estimate import estimate
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "run", "--shards", FEATURES, "--np", 2, *SMALL)
    assert rc == 0, out
    assert "20-20 classes a rank" in _line(out, "ok    2 ranks: 1 shard(s) a rank, equal blocks")
    want = estimate(40, 2, 16, 128, "mlp", "local", in_shape=[16], negatives_every=50, negatives_share=1024,
                    negatives_pool=8192)["memory_total"]
    assert f"): {human(want)}, classifier" in _line(out, "ok    memory per rank")


def test_bad_shard_sets_exit_1(capsys, tmp_path):
    """More ranks than shards, a folder without a manifest, a backbone that does not take the samples: each
    a FAIL line naming it, exit 1."""
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path, "--shards", FEATURES, "--np", 3, *SMALL)
    assert rc == 1 and "maximum world size is 2, not 3" in _line(out, "FAIL  3 ranks"), out
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path, "--shards", tmp_path, "--np", 2)
    assert rc == 1 and "no manifest.json" in _line(out, "FAIL  shards"), out
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path, "--shards", FEATURES, "--np", 2,
                      "--set", "model.name=iresnet18")
    assert rc == 1 and "112x112" in _line(out, "FAIL  model iresnet18"), out
    rc, out = _doctor(capsys, "--np", 2)                    # --np without a set: a usage error
    assert rc == 2


def test_unwritable_run_folder_exits_1(capsys, tmp_path):
    """A run folder under a plain file (writable by no one, root included): FAIL, exit 1."""
    (tmp_path / "file").write_text("")
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "file" / "run")
    assert rc == 1 and "cannot write" in _line(out, "FAIL  run folder"), out


BLOCKED = BLOCK_HOROVOD + """
from hvd_partialfc.cli import main
for argv in (["doctor", "--out", sys.argv[1]], ["doctor", "--engine", "horovod", "--out", sys.argv[1]]):
    print("rc", main(argv), flush=True)
"""


def test_horovod_blocked_is_a_note_for_auto_and_a_failure_for_the_horovod_engine(tmp_path):
    """``import horovod`` refused (an install with --no-horovod): ``auto`` resolves to the torch engine and Horovod
    is a note (exit 0); ``--engine horovod`` fails on it with the install command (exit 1). One process for both."""
    p = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path)], env=launch_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    auto, horovod = p.stdout.split("rc 0\n") if "rc 0\n" in p.stdout else (p.stdout, "")
    assert p.returncode == 0 and auto.startswith("hvd-partialfc doctor: engine torch"), p.stdout + p.stderr
    assert "blocked in this test" in _line(auto, "note  Horovod: not importable")
    assert "every requirement of the torch engine is met" in auto
    assert horovod.startswith("hvd-partialfc doctor: engine horovod") and horovod.rstrip().endswith("rc 1"), p.stdout
    assert "scripts/setup/install.sh" in _line(horovod, "FAIL  Horovod: not importable")


def test_the_oldest_supported_torch_is_stated_once_and_checked(capsys, tmp_path, monkeypatch):
    """setup.cfg's ``torch>=`` is ``hvd_partialfc.MIN_TORCH``; doctor fails an older torch, naming both, and
    leaves the folder it runs in as it found it (it wrote nothing, ``--out`` included)."""
    import configparser
    import torch
    from hvd_partialfc import MIN_TORCH
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert f"torch>={MIN_TORCH}" in cfg["options"]["install_requires"].split()
    monkeypatch.chdir(tmp_path)
    rc, out = _doctor(capsys, "--engine", "torch")
    assert rc == 0 and os.listdir(tmp_path) == [], (out, os.listdir(tmp_path))
    monkeypatch.setattr(torch, "__version__", "2.1.2+cu121")
    rc, out = _doctor(capsys, "--engine", "torch")
    assert rc == 1 and f"torch 2.1.2+cu121: older than {MIN_TORCH}" in _line(out, "FAIL")


def test_memory_snapshot_root_names_the_folders_runs_left(capsys, tmp_path, monkeypatch):
    """``$HVD_PARTIALFC_MEMORY_DIR`` with a run's folder left in it: a note naming the folder, its owner.json
    (run folder, token) and its size, with the command that removes it; an empty root is ok; a missing root a
    note (snapshots would be refused), never a failure (exit 0 throughout)."""
    from hvd_partialfc.sizes import human
    root = tmp_path / "shm"
    step = root / "hvd_partialfc-abc" / "step-00000010"
    step.mkdir(parents=True)
    (root / "hvd_partialfc-abc" / "owner.json").write_text(json.dumps({"run_dir": "runs/crashed", "token": "abc"}))
    (step / "classifier-00000-of-00002.pt").write_bytes(b"x" * 10_000)
    (root / "other").mkdir()                                             # not a snapshot folder: not named
    monkeypatch.setenv("HVD_PARTIALFC_MEMORY_DIR", str(root))
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "run")
    line = _line(out, f"note  memory snapshots: {root} writable")
    size = os.path.getsize(root / "hvd_partialfc-abc" / "owner.json") + 10_000
    assert rc == 0 and "1 snapshot folder(s): hvd_partialfc-abc (run runs/crashed, token abc, " \
                       f"{human(size)})" in line, out
    assert f"rm -r {root / 'hvd_partialfc-abc'}" in line and "other (" not in line
    assert " free, " in line and "memory available" in line
    (root / "hvd_partialfc-abc" / "owner.json").unlink()
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "run")
    assert "hvd_partialfc-abc (no readable owner.json" in _line(out, "note  memory snapshots"), out
    shutil.rmtree(root / "hvd_partialfc-abc")
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "run")
    assert "no snapshot folders" in _line(out, f"ok    memory snapshots: {root} writable"), out
    monkeypatch.setenv("HVD_PARTIALFC_MEMORY_DIR", str(tmp_path / "missing"))
    rc, out = _doctor(capsys, "--engine", "torch", "--out", tmp_path / "run")
    assert rc == 0 and "would be refused" in _line(out, f"note  memory snapshots: {tmp_path / 'missing'}"), out


def test_snapshots_that_would_not_fit_fail_as_training_would(capsys, tmp_path, monkeypatch):
    """With checkpoint.memory_every: the node's snapshots (the estimator's host terms) against the root's room:
    an ok line with the figure where they fit, a FAIL naming the shortfall where the start-up check would refuse."""
    from hvd_partialfc.sizes import human
    from hvd_partialfc.tools.estimate import estimate
    monkeypatch.setenv("HVD_PARTIALFC_MEMORY_DIR", str(tmp_path))
    monkeypatch.setenv("HVD_PARTIALFC_RANKS_PER_NODE", "1")
    args = ["--engine", "torch", "--out", tmp_path / "run", "--shards", FEATURES, "--np", 2, *SMALL,
            "--set", "checkpoint.memory_every=10"]
    rc, out = _doctor(capsys, *args)
    need = estimate(40, 2, 16, 128, "mlp", "local", in_shape=[16], memory_every=10,
                    ranks_per_node=1)["host_bytes"]["memory snapshots per node (host RAM)"]
    assert rc == 0 and f"{human(need)} a node of 1 rank(s)" in _line(out, "ok    memory snapshots every 10 steps"), out
    from hvd_partialfc.run.snapshots import snapshot_root   # a node with 1,000 bytes of memory available
    monkeypatch.setattr(snapshot_root, "mem_available", lambda: 1000)
    rc, out = _doctor(capsys, *args)
    line = _line(out, "FAIL  checkpoint.memory_every")
    assert rc == 1 and f"snapshots need {human(need)}" in line and "the node has 1000 B of memory available" in line
