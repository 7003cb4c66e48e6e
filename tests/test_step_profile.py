"""``hvd-partialfc profile`` (tools/step_profile.py, tools/profile_marks.py, tools/profile_trace.py): the phase marks
of the trainer's step, the arithmetic of the averaging's overlap, the files; one rank, then both engines at
np=2, where gradient averaging exists. Behaviour, not speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, launch_cmd, launch_env, require_horovod, run_job
from hvd_partialfc.tools.profile_trace import gpu_summary, horovod_allreduces, length, overlap, union

ORDER = ["step start", "loader", "to device", "backbone forward", "head forward", "head backward",
         "backbone backward", "gradient wait", "norms and decision", "backbone optimizer", "books",
         "head optimizer", "step end"]


def test_the_overlap_arithmetic():
    """Against intervals worked by hand: a step from 0 to 10, its last backward 2..6, the wait 6..8."""
    assert union([(3, 4), (1, 2), (1.5, 3.5)]) == [(1, 4)] and length([(0, 1), (0.5, 2), (5, 6)]) == 3
    windows = {0: {"start": 0, "end": 10, "backward": 2, "wait_start": 6, "wait_end": 8}}
    got = overlap(windows, [(1, 3), (4, 5), (4.5, 7), (9, 12)])   # 1..3 starts before the backward
    m = got["median_s"]
    assert (m["busy"], m["overlapped"], m["in_wait"], m["wait"], m["all_reduces"]) == (6, 3, 1, 2, 4)
    assert m["share"] == 0.5


def test_horovods_timeline_read(tmp_path):
    """Horovod's format as 0.28 writes it (rows per tensor, B/E pairs nested under ALLREDUCE, negotiation
    left out), before its shutdown's closing bracket and after; epoch micro-seconds onto the host clock."""
    rows = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 5_000_000}},
            {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 100, "pid": 1}, {"ph": "E", "ts": 900, "pid": 1},
            {"ph": "B", "name": "ALLREDUCE", "ts": 1000, "pid": 1},
            {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1100, "pid": 1}, {"ph": "E", "ts": 1900, "pid": 1},
            {"ph": "E", "ts": 2000, "pid": 1, "args": {"shape": "[4]"}},
            {"ph": "B", "name": "ALLREDUCE", "ts": 1500, "pid": 2}, {"ph": "E", "ts": 3000, "pid": 2}]
    path = tmp_path / "timeline.json"
    text = "[\n" + ",\n".join(json.dumps(r) for r in rows)
    for end in (",", "]"):
        path.write_text(text + end)
        got = horovod_allreduces(str(path), epoch_minus_perf=4.0)
        assert got == [pytest.approx((1.001, 1.002)), pytest.approx((1.0015, 1.003))]


def test_the_gpu_summary_of_a_kernel_trace(tmp_path):
    """torch.profiler's trace: busy = the union of kernels and copies, NCCL's time beside other kernels."""
    ev = [{"ph": "X", "cat": "kernel", "name": "conv", "ts": 0, "dur": 40},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 30, "dur": 40},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 80, "dur": 10},
          {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    g = gpu_summary(str(path))
    assert g["busy_share"] == pytest.approx(80 / 90) and g["idle_ms_per_step"] == pytest.approx(0.010)
    assert g["nccl_beside_compute_share"] == pytest.approx(10 / 40) and g["top_kernels_ms_per_step"][0][0] == "conv"


def _profile_argv(shards, out, extra=()):
    return ["-m", "hvd_partialfc.cli", "profile", "--shards", str(shards), "--profile-out", str(out),
            "--warmup", "1", "--profile-steps", "3", "--set", "model.name=mlp", "--set", "model.embedding_dim=16",
            "--set", "model.kwargs={hidden_dim: 16}", "--set", "data.batch_size=8", "--set", "train.threads=1",
            "--set", "train.device=cpu", "--set", "head.negatives_every=0", *extra]


def test_one_rank_profile_files(feature_shards, tmp_path):
    out = tmp_path / "prof"
    p = subprocess.run([sys.executable, *_profile_argv(feature_shards, out, ["--torch-trace", "--set",
                                                                            "train.engine=torch"])],
                       cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((out / "profile.json").read_text())
    assert [row["phase"] for row in r["phases"]] == ORDER
    assert sum(row["host_share"] for row in r["phases"]) == pytest.approx(1.0)
    assert r["averaging"] == {"note": "none at 1 rank(s)"} and r["steps"] == 3 and r["samples_per_s"] > 0
    trace = json.loads((out / "step_trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in trace if e["ph"] == "X"} == set(ORDER)
    assert len([e for e in trace if e["ph"] == "X" and e["name"] == "backbone forward"]) == 3
    assert "ProfilerStep#" in (out / "torch_trace.json").read_text()
    assert "gradient wait" in p.stdout and "wrote" in p.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", ["torchrun", "gloo"])
def test_the_overlap_under_both_engines(launcher, feature_shards, tmp_path):
    """At np=2 every step's all-reduces are found (the torch engine's buckets; Horovod's timeline, rank 0)
    and placed within the step: busy time, its part beside the backward and in the wait, per step."""
    if launcher == "gloo":
        require_horovod()
    out = tmp_path / "prof"
    p = run_job([*launch_cmd(launcher, 2), *_profile_argv(feature_shards, out)], launch_env(), timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    a = json.loads((out / "profile.json").read_text())["averaging"]
    assert a["source"].startswith("torch engine" if launcher == "torchrun" else "Horovod timeline")
    assert len(a["steps"]) == 3
    for s in a["steps"]:
        assert s["all_reduces"] >= 1 and 0 < s["busy"] < 1.0, a["steps"]
        assert 0 <= s["overlapped"] <= s["busy"] and s["in_wait"] <= s["wait"] + 1e-6
    assert os.path.exists(out / "horovod_timeline.json") == (launcher == "gloo")
