"""The GPU call's CPU dry run (GPU_CHECK_TINY=1): scripts/gpu/gpu_speed_run.sh and every stage of
scripts/gpu/gpu_check.sh at toy sizes, so the scripts cannot rot between the days a GPU is at hand. It measures
nothing worth keeping on CPU. tests/test_gpu_call.py checks the call's shell plumbing without Python's work.

In two parts: the call with the stages that start no ranks (env, prepare, speed, report: a single-process test),
and gpu_check.sh's stages that launch ranks (torch under torchrun, Horovod's under horovodrun) with the prepare
and report stages they need (marked multirank). The two `python -c` probes, which the dry run starts no process
for, run in this process."""
import inspect
import json
import os
import re
import subprocess
import tarfile

import pytest

from conftest import BIN, ROOT, horovodrun, launch_env


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


def _env(out, skip, **extra):
    return dict(launch_env(), OUT=str(out), GPU_CHECK_TINY="1", PYTHON=os.path.join(BIN, "python"),
                GPU_CHECK_SKIP=skip, **extra)


def _ran(p):
    said = "\n".join(line for line in p.stdout.splitlines() if "failed" in line.lower())
    assert p.returncode == 0, said + "\n" + p.stdout[-6000:] + p.stderr[-3000:]
    assert "gpu_check: passed" in p.stdout


def test_the_gpu_call_dry_run(tmp_path):
    """The one GPU call (scripts/gpu/gpu_speed_run.sh) on the CPU at toy sizes (GPU_CHECK_TINY=1), arcface_torch
    a stand-in, the stages that start no ranks: env, prepare, the speed stage's four kinds of cell, the report,
    and what comes back in $OUT: the table, speed.json, face_check.json and gpu_check.tgz. It measures nothing
    worth keeping on the CPU: the scripts cannot rot between the days a GPU is at hand."""
    import torch
    for name, text in STAND_IN.items():
        (tmp_path / "arcface_torch" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "arcface_torch" / name).write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    env = _env(out, "torch,build,horovod", ARCFACE_DIR=str(tmp_path / "arcface_torch"))
    p = subprocess.run(["bash", "scripts/gpu/gpu_speed_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    _ran(p)
    assert {"speed.json", "speed_table.md", "face_check.json", "gpu_check.tgz"} <= set(os.listdir(out))
    report = json.loads((out / "face_check.json").read_text())
    assert report["problems"] == [] and report["runs"] == {}
    assert report["prepare"]["loader"]["samples_per_s"] > 0
    with tarfile.open(out / "gpu_check.tgz") as tar:
        stages = tar.extractfile("gpu_check/stages.tsv").read().decode()
    assert [line.split("\t")[0] for line in stages.splitlines()] == ["env", "prepare", "speed", "report"]
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


@pytest.mark.multirank
def test_the_gpu_call_dry_run_rank_stages(tmp_path):
    """gpu_check.sh's stages that launch ranks, on the CPU at toy sizes: the trainer under torchrun (the torch
    stage) and, where Horovod is installed, under horovodrun (Horovod's build stage, which in the dry run builds
    nothing, and its stage), each a 125k-class and a 1k-class head in bf16; the report assembles their rows.
    The prepare stage makes their shard sets; env and speed run in the test above."""
    from hvd_partialfc.engine.select import horovod_installed
    with_horovod = horovod_installed()
    # the suite's horovodrun: its build pre-check answered once a session (conftest), in launch_env's environment
    launcher = dict(GPU_CHECK_HOROVODRUN=horovodrun()[1]) if with_horovod else {}
    out = tmp_path / "out"
    env = _env(out, "env,speed" if with_horovod else "env,speed,build,horovod", **launcher)
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    _ran(p)
    stages = [line.split("\t")[0] for line in (out / "stages.tsv").read_text().splitlines()]
    assert stages == ["prepare", "torch"] + (["build", "horovod"] if with_horovod else []) + ["report"]
    report = json.loads((out / "face_check.json").read_text())
    assert report["problems"] == []
    engines = ("torch", "horovod") if with_horovod else ("torch",)
    rows = [(e, r["precision"], r["head"]) for e, info in report["runs"].items() for r in info["rows"]]
    assert sorted(rows) == sorted((e, p, h) for e in engines for p in ("bf16",) for h in ("head125k", "head1k"))


def test_the_gpu_call_dry_run_probes(capsys):
    """gpu_check.sh's two `python -c` probes (what torch sees, what Horovod's build holds), which the dry run
    starts no process for: their Python run here, as the GPU call runs it."""
    import torch
    script = open(os.path.join(ROOT, "scripts", "gpu", "gpu_check.sh")).read()
    probes = dict(re.findall(r'^(ENV_PROBE|BUILD_PROBE)="(.*)"$', script, re.M))
    exec(probes["ENV_PROBE"], {})
    assert f"torch {torch.__version__} cuda" in capsys.readouterr().out
    from hvd_partialfc.engine.select import horovod_installed
    if horovod_installed():
        import horovod
        exec(probes["BUILD_PROBE"], {})
        assert capsys.readouterr().out.startswith(f"horovod {horovod.__version__} nccl ")


def test_gpu_check_fails_loudly(tmp_path):
    """A stage that fails ends the script non-zero, naming the stage (it used to end with `echo`, exit 0)."""
    env = dict(launch_env(), OUT=str(tmp_path), GPU_CHECK_TINY="1", PYTHON="false")   # every python call fails
    p = subprocess.run(["bash", "scripts/gpu/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0
    assert "gpu_check: stage prepare failed" in p.stderr and "FAILED in stage(s) prepare torch speed" in p.stderr
