"""The side-by-side script with arcface_torch (tools/arcface_compare.py, arcface_step.py), without an InsightFace
checkout: our contenders end to end at toy sizes, the gathered rows of `global`, finding and importing a
checkout's modules (a stand-in written here, no InsightFace code), the errors a user meets."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, launch_env
from hvd_partialfc.tools import arcface_step
from hvd_partialfc.tools.arcface_compare import GatheredRows, main

TOY = ["--model", "resnet", "--image-size", "32", "--set", "model.kwargs={width: 4}", "--batch", "4",
       "--classes", "50", "--precision", "fp32", "--device", "cpu", "--threads", "1", "--warmup", "1",
       "--rounds", "2", "--steps", "1", "--pool", "2"]


def _compare(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hvd_partialfc.tools.arcface_compare", *args], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=timeout)


def test_our_contenders_side_by_side(tmp_path):
    out = tmp_path / "cmp.json"
    p = _compare(["--contenders", "local,global", "--gathered", "3", *TOY, "--out", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["contenders"]) == {"local", "global"} and r["arcface_dir"] is None
    for c in r["contenders"].values():
        assert len(c["ms_per_step_rounds"]) == 2 and c["median_ms"] > 0 and "speed_vs_arcface" not in c
    assert "local" in p.stdout and "samples/s" in p.stdout


def test_the_users_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--contenders", "arcface,local", *TOY])
    assert e.value.code == 2 and "needs --arcface-dir" in capsys.readouterr().err
    assert main(["--arcface-dir", str(tmp_path), "--contenders", "arcface", *TOY]) == 2   # before any work
    err = capsys.readouterr().err
    assert f"{tmp_path}: no arcface_torch here" in err and "git clone" in err and len(err.strip().splitlines()) == 1


def test_gathered_rows_are_a_rank_of_n_after_its_gather():
    """`global` with --gathered 3: its head scores 3 x B rows, this rank's first; the gradient that comes back
    to this rank's features is its own rows' times N (Partial FC's scaling under an averaging optimizer)."""
    peers, peer_labels = torch.randn(4, 5), torch.tensor([7, 8, 9, 10])
    comm = GatheredRows(3, peers, peer_labels)
    x = torch.randn(2, 5, requires_grad=True)
    gathered = comm.allgather_with_grad(x, "head.features", grad_scale=comm.size)
    assert torch.equal(gathered, torch.cat([x.detach(), peers]))
    w = torch.randn(6, 5)
    (gathered * w).sum().backward()
    assert torch.equal(x.grad, 3 * w[:2])
    assert torch.equal(comm.allgather_tensor(torch.tensor([1, 2]), "head.labels"), torch.tensor([1, 2, 7, 8, 9, 10]))


def _stand_in(root):
    """A folder laid out as arcface_torch, holding stand-ins of its modules (written here)."""
    (root / "backbones").mkdir(parents=True)
    (root / "backbones" / "__init__.py").write_text("from .iresnet import NAME\n")
    (root / "backbones" / "iresnet.py").write_text("NAME = 'stand-in iresnet'\n")
    for name in ("partial_fc_v2", "losses", "lr_scheduler"):
        (root / f"{name}.py").write_text(f"NAME = {name!r}\n")


def test_a_checkout_is_found_and_its_modules_imported_under_private_names(tmp_path):
    _stand_in(tmp_path / "insightface" / "recognition" / "arcface_torch")
    before = list(sys.path)
    mods = arcface_step.load_arcface(str(tmp_path / "insightface"))          # the checkout's root
    assert mods["root"] == str(tmp_path / "insightface" / "recognition" / "arcface_torch")
    assert (mods["backbones"].NAME, mods["pfc"].NAME, mods["lr"].NAME) == ("stand-in iresnet", "partial_fc_v2",
                                                                           "lr_scheduler")
    assert arcface_step.find_arcface(mods["root"]) == mods["root"]          # or the folder itself
    assert sys.path == before and "backbones" not in sys.modules and "losses" not in sys.modules


def test_cuda_calls_are_the_identity_on_cpu_only_while_asked():
    t = torch.ones(2)
    with arcface_step.cpu_cuda_calls(torch.device("cpu")):
        assert t.cuda() is t
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            t.cuda()                                                          # torch's own again


def test_our_step_sets_the_device_flags_as_the_trainer_does(monkeypatch):
    """cuDNN's autotuner (train.cudnn_benchmark) set by our step itself, as start_trainer sets it: the speed
    stage's switches and compile cells build ours outside run(), which alone set it before."""
    from hvd_partialfc.run import speed
    from hvd_partialfc.tools import arcface_compare as cmp
    seen = []
    monkeypatch.setattr(speed, "set_device_flags", lambda cfg, device: seen.append((cfg.train.cudnn_benchmark,
                                                                                     device.type)))
    cmp.our_step(cmp.parser().parse_args(TOY), "local", torch.device("cpu"), 2)
    assert seen == [(True, "cpu")]


class _Poly(torch.optim.lr_scheduler._LRScheduler):
    """A stand-in of arcface_torch's older PolynomialLRWarmup (written here): it hands ``verbose`` on to torch's
    base class, which torch 2.13 no longer takes. Its lr: base x (1 - step / total)."""

    def __init__(self, optimizer, warmup_iters, total_iters=5, power=1.0, last_epoch=-1, verbose=False):
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch=last_epoch, verbose=verbose)

    def get_lr(self):
        return [base * (1 - self.last_epoch / self.total_iters) for base in self.base_lrs]


def _tiny_arcface_mods(loss_factor=lambda: 1.0, on_input=lambda x: None, scheduler=_Poly):
    """Stand-ins of arcface_torch's modules (written here): a linear backbone (``on_input`` sees its batch), a
    plain softmax PartialFC_V2 whose loss is scaled by ``loss_factor()``, and ``scheduler``."""
    class Backbone(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.fc = torch.nn.Linear(3, 8)

        def forward(self, x):
            on_input(x)
            return self.fc(x.mean((2, 3)))

    class PFC(torch.nn.Module):
        def __init__(self, margin, dim, classes, rate, fp16):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(classes, dim))

        def forward(self, emb, labels):
            return torch.nn.functional.cross_entropy(emb @ self.weight.t(), labels) * loss_factor()
    return {"backbones": SimpleNamespace(get_model=lambda name, **kw: Backbone(**kw)),
            "losses": SimpleNamespace(CombinedMarginLoss=lambda *a: None), "pfc": SimpleNamespace(PartialFC_V2=PFC),
            "lr": SimpleNamespace(PolynomialLRWarmup=scheduler)}


def test_arcface_step_gives_its_backbone_contiguous_images():
    """train_v2's loader gives (B, C, H, W) contiguous batches; a permuted uint8 batch is NHWC in memory, and a
    convolution given it runs channels_last (and so does every layer after), which is not arcface_torch's step.
    Stand-ins of its modules, written here."""
    seen = []
    mods = _tiny_arcface_mods(on_input=lambda x: seen.append(x.is_contiguous()), scheduler=lambda **kw: None)
    step = arcface_step.ArcfaceStep(mods, "r18", 5, 1.0, False, torch.device("cpu"), ddp=False, dim=8)
    step(torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), torch.tensor([1, 3]))
    assert seen == [True]


class _Counters:
    """A device's allocator counters that the contenders below move by hand (bytes)."""

    def __init__(self):
        self.now = self.top = 0

    def allocated(self):
        return self.now

    def reset_peak(self):
        self.top = self.now

    def peak(self):
        return self.top

    def alloc(self, n):
        self.now += n
        self.top = max(self.top, self.now)


def test_each_contenders_own_memory_apart_from_the_others():
    """Two contenders on one device: A builds 100, its first step keeps 50 (moments), each step rises 30 and
    frees it; B builds 200, keeps 10, rises 70. Own: A 180, B 280; the device's peak in B's steps holds A's 150
    too (430), in A's 390. The old figure was the device's peak alone: B's weights counted in A's."""
    from hvd_partialfc.tools.arcface_compare import build, measure
    mem = _Counters()
    sizes = {"local": (100, 50, 30), "global": (200, 10, 70)}

    def contender(name):
        kept, rise = sizes[name][1:]
        calls = []

        def run(batches):
            if not calls:
                mem.alloc(kept)
            calls.append(1)
            mem.alloc(rise)
            mem.alloc(-rise)
        return run

    import hvd_partialfc.tools.arcface_compare as cmp
    a = SimpleNamespace(contenders="local,global", warmup=2, rounds=3, steps=2, batch=4, classes=5, gathered=1)
    real = cmp.our_step, cmp.device_batches
    try:
        cmp.our_step = lambda a, name, device, total: (mem.alloc(sizes[name][0]), contender(name))[1]
        cmp.device_batches = lambda *args: iter(())
        built = build(a, torch.device("cpu"), memory=mem)
    finally:
        cmp.our_step, cmp.device_batches = real
    assert [built[n]["built_bytes"] for n in ("local", "global")] == [100, 200]
    r = measure(a, torch.device("cpu"), built, memory=mem)
    gib = 2 ** 30
    assert {n: round(r[n]["own_gib"] * gib) for n in r} == {"local": 180, "global": 280}
    assert {n: round(r[n]["device_gib"] * gib) for n in r} == {"local": 390, "global": 430}
    assert r["local"]["memory_bytes"] == {"built": 100, "warm_up": 50, "step_rise": 30}


def test_arcface_scheduler_runs_without_the_argument_torch_dropped():
    """Its scheduler passes ``verbose`` to a torch that takes none: built without it (recorded), it still steps
    arcface's lr (the step used to go on with no scheduler at all, silently)."""
    import inspect
    step = arcface_step.ArcfaceStep(_tiny_arcface_mods(), "r18", 5, 1.0, False, torch.device("cpu"), ddp=False, dim=8,
                                    steps=4)
    takes_verbose = "verbose" in inspect.signature(torch.optim.lr_scheduler.LRScheduler.__init__).parameters
    assert step.sched_dropped == ([] if takes_verbose else ["verbose"])
    step(torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), torch.tensor([1, 3]))
    assert [g["lr"] for g in step.opt.param_groups] == pytest.approx([0.1 * (1 - 1 / 4)] * 2)


def test_skipped_fp16_steps_are_counted_in_the_timed_rounds_only():
    """GradScaler skips the optimizer's step on an overflowing gradient (a cheaper step): arcface's step counts
    them (here the 2nd of 3, its weights unchanged by it), and measure() reports those of the timed rounds
    beside the time, not the warm-up's."""
    from hvd_partialfc.tools.arcface_compare import measure
    calls = []
    step = arcface_step.ArcfaceStep(_tiny_arcface_mods(lambda: 1e38 if len(calls) == 2 else 1.0), "r18", 5, 1.0,
                                    False, torch.device("cpu"), ddp=False, dim=8)
    step.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)      # fp16's path, on the CPU
    batch = (torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8), torch.tensor([1, 3]))
    for i in range(3):
        calls.append(i)
        before = step.pfc.weight.detach().clone()
        step(*batch)
        assert torch.equal(before, step.pfc.weight) == (i == 1)
    assert step.skipped() == 1

    counts = {"local": 0}

    def run():                         # skips on its 1st step (the warm-up) and its 3rd (a timed round)
        counts["local"] += 1
    skipped = lambda: (counts["local"] >= 1) + (counts["local"] >= 3)      # noqa: E731
    a = SimpleNamespace(warmup=1, rounds=2, steps=2, batch=4)
    r = measure(a, torch.device("cpu"), {"local": {"run": run, "skipped": skipped}})
    assert (r["local"]["skipped_steps"], r["local"]["timed_steps"]) == (1, 4)


def test_a_contender_out_of_memory_in_a_timed_round_leaves_the_others_measured():
    """Running out of memory in the 2nd timed round stops that contender only (the whole comparison used to be
    lost with it)."""
    from hvd_partialfc.tools.arcface_compare import measure
    n = {"local": 0}

    def big():
        n["local"] += 1
        if n["local"] > 2:           # warm-up 1 and round 1's step fit; round 2 does not
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    a = SimpleNamespace(warmup=1, rounds=3, steps=1, batch=4)
    r = measure(a, torch.device("cpu"), {"local": {"run": big}, "global": {"run": lambda: None}})
    assert r["local"]["error"] == "out of memory in timed round 2 at batch 4" and len(r["local"]["ms_per_step_rounds"]) == 1
    assert len(r["global"]["ms_per_step_rounds"]) == 3 and r["global"]["median_ms"] >= 0
