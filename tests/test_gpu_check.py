"""scripts/gpu/gpu_check.sh's CPU path (GPU_CHECK_TINY=1): every stage the GPU check runs, at toy sizes, so the
script cannot rot between the days a GPU is lent. It measures nothing worth keeping on CPU."""
import json
import os
import subprocess

import pytest

from conftest import BIN, ROOT, launch_env, require_horovod

pytestmark = pytest.mark.multirank


def test_gpu_check_cpu_path(tmp_path):
    require_horovod()        # the check builds and runs Horovod's stage too
    out = tmp_path / "out"
    env = dict(launch_env(), OUT=str(out), GPU_CHECK_TINY="1", PYTHON=os.path.join(BIN, "python"))
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "face_check.json").read_text())
    assert report["problems"] == []
    assert report["prepare"]["loader"]["samples_per_s"] > 0
    rows = [(e, r["precision"], r["head"]) for e, info in report["runs"].items() for r in info["rows"]]
    assert sorted(rows) == sorted((e, p, h) for e in ("torch", "horovod") for p in ("bf16",)
                                  for h in ("head125k", "head1k"))
    stages = [line.split("\t")[0] for line in (out / "stages.tsv").read_text().splitlines()]
    assert stages == ["env", "prepare", "torch", "speed", "build", "horovod", "report"]
    assert "gpu_check: passed" in p.stdout
    speed = json.loads((out / "speed.json").read_text())      # each kind of the speed stage's cells, at toy sizes
    tiny = ("profile-r50", "switches", "largest-r50", "compare-r50-125k-bmax")     # one cell of each kind
    assert {c["name"]: c["status"] for c in speed["cells"]} == {n: "ok" for n in tiny}, speed["cells"]
    assert "arcface_torch skipped: no ARCFACE_DIR given" in p.stdout       # the suite never needs InsightFace
    assert "| iresnet50, 125k-class local head: samples/s |" in (out / "speed_table.md").read_text()


def test_gpu_check_fails_loudly(tmp_path):
    """A stage that fails ends the script non-zero, naming the stage (it used to end with `echo`, exit 0)."""
    env = dict(launch_env(), OUT=str(tmp_path), GPU_CHECK_TINY="1", PYTHON="false")   # every python call fails
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert "FAILED in stage env" in p.stderr


def test_the_speed_run_packs_what_it_has_when_the_check_overruns(tmp_path):
    """scripts/gpu/gpu_speed_run.sh packs $OUT only after the check: its cap ends a check that overruns (here at
    3 s, in the prepare stage) and the packing still runs, so a device call is never cut with $OUT empty."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(launch_env(), OUT=str(out), GPU_CHECK_TINY="1", GPU_SPEED_RUN_CAP_S="3",
               PYTHON=os.path.join(BIN, "python"))
    p = subprocess.run(["bash", "scripts/gpu/gpu_speed_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 124, p.stdout[-2000:] + p.stderr[-2000:]
    listed = subprocess.run(["tar", "tzf", str(out / "gpu_check.tgz")], capture_output=True, text=True).stdout
    assert "gpu_check/stages.tsv" in listed and "gpu_check.log" in listed
