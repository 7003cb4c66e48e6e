"""The GPU call's CPU dry run (GPU_CHECK_TINY=1): scripts/gpu/gpu_speed_run.sh and every stage of
scripts/gpu/gpu_check.sh at toy sizes, so the scripts cannot rot between the days a GPU is lent. It measures
nothing worth keeping on CPU. tests/test_gpu_call.py checks the call's shell plumbing without Python's work."""
import inspect
import json
import os
import subprocess
import tarfile

import pytest
import torch

from conftest import BIN, ROOT, launch_env

pytestmark = pytest.mark.multirank


# A stand-in of arcface_torch, written here, for the dry run ONLY: it has the names and signatures the
# side-by-side calls (hvd_partialfc/tools/arcface_step.py), a one-layer backbone and a plain softmax head,
# so that the call's arcface paths run on the CPU. It is not arcface_torch and nothing it gives is a figure.
# Its scheduler hands `verbose` on to torch's base class as arcface_torch's older one does.
STAND_IN = {
    "backbones/__init__.py": """from . import iresnet


def get_model(name, **kwargs):
    return iresnet.IResNet(iresnet.IBasicBlock, [1, 1, 1, 1], **kwargs)
""",
    "backbones/iresnet.py": """import torch


class IBasicBlock(torch.nn.Module):
    pass


class IResNet(torch.nn.Module):
    def __init__(self, block, layers, dropout=0.0, num_features=512, fp16=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, stride=8)
        self.fc = torch.nn.Linear(4, num_features)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))
""",
    "partial_fc_v2.py": """import torch


class PartialFC_V2(torch.nn.Module):
    def __init__(self, margin_loss, embedding_size, num_classes, sample_rate=1.0, fp16=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_classes, embedding_size)))

    def forward(self, embeddings, labels):
        return torch.nn.functional.cross_entropy(embeddings @ self.weight.t(), labels)
""",
    "losses.py": """class CombinedMarginLoss:
    def __init__(self, s, m1, m2, m3, interclass_filtering_threshold=0):
        self.s = s
""",
    "lr_scheduler.py": """from torch.optim.lr_scheduler import _LRScheduler


class PolynomialLRWarmup(_LRScheduler):
    def __init__(self, optimizer, warmup_iters, total_iters=5, power=1.0, last_epoch=-1, verbose=False):
        super().__init__(optimizer, last_epoch=last_epoch, verbose=verbose)

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]
""",
}


def test_the_gpu_call_dry_run(tmp_path):
    """The one GPU call (scripts/gpu/gpu_speed_run.sh) on the CPU at toy sizes (GPU_CHECK_TINY=1), arcface_torch
    a stand-in: every stage gpu_check.sh runs (Horovod's build and stage too where Horovod is installed), the
    speed stage's four kinds of cell, and what comes back in $OUT: the table, speed.json, face_check.json and
    gpu_check.tgz. It measures nothing worth keeping on the CPU: the scripts cannot rot between the days a GPU
    is lent."""
    from hvd_partialfc.engine.select import horovod_installed
    for name, text in STAND_IN.items():
        (tmp_path / "arcface_torch" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "arcface_torch" / name).write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    with_horovod = horovod_installed()           # the check builds and runs Horovod's stage too
    env = dict(launch_env(), OUT=str(out), GPU_CHECK_TINY="1", PYTHON=os.path.join(BIN, "python"),
               ARCFACE_DIR=str(tmp_path / "arcface_torch"), GPU_CHECK_SKIP="" if with_horovod else "build,horovod")
    p = subprocess.run(["bash", "scripts/gpu/gpu_speed_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    said = "\n".join(line for line in p.stdout.splitlines() if "failed" in line.lower())
    assert p.returncode == 0, said + "\n" + p.stdout[-6000:] + p.stderr[-3000:]
    assert {"speed.json", "speed_table.md", "face_check.json", "gpu_check.tgz"} <= set(os.listdir(out))
    report = json.loads((out / "face_check.json").read_text())
    assert report["problems"] == []
    assert report["prepare"]["loader"]["samples_per_s"] > 0
    engines = ("torch", "horovod") if with_horovod else ("torch",)
    rows = [(e, r["precision"], r["head"]) for e, info in report["runs"].items() for r in info["rows"]]
    assert sorted(rows) == sorted((e, p, h) for e in engines for p in ("bf16",) for h in ("head125k", "head1k"))
    with tarfile.open(out / "gpu_check.tgz") as tar:
        stages = tar.extractfile("gpu_check/stages.tsv").read().decode()
    stages = [line.split("\t")[0] for line in stages.splitlines()]
    assert stages == ["env", "prepare", "torch", "speed"] + (["build", "horovod"] if with_horovod else []) + ["report"]
    assert "gpu_check: passed" in p.stdout
    speed = json.loads((out / "speed.json").read_text())      # each kind of the speed stage's cells, at toy sizes
    tiny = ("profile-r50", "switches", "largest-r50", "compare-r50-125k-bmax")     # one cell of each kind
    assert {c["name"]: c["status"] for c in speed["cells"]} == {n: "ok" for n in tiny}, speed["cells"]
    arcface = next(c for c in speed["cells"] if c["name"] == "compare-r50-125k-bmax")["result"]["contenders"]["arcface"]
    takes_verbose = "verbose" in inspect.signature(torch.optim.lr_scheduler.LRScheduler.__init__).parameters
    assert arcface["ddp"] is False and arcface["scheduler_dropped"] == ([] if takes_verbose else ["verbose"])
    assert (arcface["skipped_steps"], arcface["samples_per_s"] > 0) == (0, True)
    table = (out / "speed_table.md").read_text()
    assert "| iresnet50, 125k-class local head: samples/s |" in table
    assert "compare-r50-125k-bmax: arcface_torch without DDP" in table


def test_gpu_check_fails_loudly(tmp_path):
    """A stage that fails ends the script non-zero, naming the stage (it used to end with `echo`, exit 0)."""
    env = dict(launch_env(), OUT=str(tmp_path), GPU_CHECK_TINY="1", PYTHON="false")   # every python call fails
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert "FAILED in stage env" in p.stderr
