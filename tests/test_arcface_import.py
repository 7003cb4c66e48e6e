"""``hvd-partialfc import-arcface`` and ``config --from-arcface`` (tools/arcface_import.py, arcface_config.py).

The source: a run of this package (2 ranks, 60 steps: one epoch, where arcface_torch saves; a poly schedule,
which its scheduler's state can say), written in arcface_torch's per-rank layout by tests/helpers_arcface.py
(Partial FC v2's partition of 42 classes over 2 ranks: 21 and 21 rows; the committed fixture's, over 3 ranks,
is 14, 13, 13). Imported, it must hold the same rows, momentum and backbone bitwise, and resume at 1 and at 3
ranks exactly as the original run's own checkpoint resumes there: the first steps after the resume equal
those computed from the original state (its momentum included: without it they differ).

Then arcface_torch's own runs: one at gradient_acc 4, one on uneven data with the older scheduler, each
continuing arcface_torch's lr curve (computed here from its schedulers' published behaviour) to its end; the
config's disagreements with the scheduler refused; the config parser's statements read or listed."""
from __future__ import annotations

import json
import os

import pytest
import torch

import pins
from conftest import build_shards, make_feature_npz, read_json_lines, simulate_here
from helpers_arcface import pfc_slices, write_run

SETS = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 32}", "data.batch_size=8",
        "head.negatives_every=0", "train.threads=1", "data.workers=0", "train.log_every=1", "checkpoint.every=4",
        "train.seed=3", "optim.warmup_steps=2", "optim.schedule=poly", "optim.poly_power=1", "head.loss=cosface",
        "head.scale=16", "head.margin=0.2"]
CLASSES, WORLD, STEP = 42, 2, 60     # 42 x 24 samples in 8 shards: the smaller rank's 480 are 60 steps of 2 x 8
SCHEDULE = {"total": STEP, "warmup": 2, "power": 1}     # the lr scheduler's state SETS translates to


def _json(path):
    with open(path) as f:
        return json.load(f)


def _cfg(shards, out, *extra):
    from hvd_partialfc.config_io import load_config
    return load_config(None, [*SETS, f"data.shards={shards}", f"out={out}", *extra])


def _original_state(ckpt):
    """(backbone state_dict, parameter names in order, {name: momentum}, rows (C, D), their momentum)."""
    from hvd_partialfc.models import create_model
    meta = _json(os.path.join(ckpt, "meta.json"))
    bb = torch.load(os.path.join(ckpt, "backbone.pt"), weights_only=True)
    m = meta["model"]
    names = [n for n, _ in create_model(m["name"], in_shape=m["in_shape"], embedding_dim=m["embedding_dim"],
                                        **m["kwargs"]).named_parameters()]
    momenta = {names[i]: s["momentum_buffer"] for i, s in bb["optimizer"]["state"].items()}
    files = [torch.load(os.path.join(ckpt, f), weights_only=True) for f in meta["classifier_files"]]
    rows = torch.cat([f["weight"] for f in files])
    rows_m = torch.cat([f["optimizer"]["state"][0]["momentum_buffer"] for f in files])
    return bb["state_dict"], names, momenta, rows, rows_m


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The original run, its arcface_torch copy, the import."""
    d = tmp_path_factory.mktemp("arcface")
    shards = build_shards(make_feature_npz(d / "f.npz", [24] * CLASSES), d / "shards", 8)
    original = simulate_here(_cfg(shards, d / "original", f"train.steps={STEP}"), WORLD).checkpoint
    state = _original_state(original)
    bb, names, momenta, rows, rows_m = state
    run = d / "arcface_run"
    write_run(str(run), bb, names, rows, rows_m, momenta, WORLD, STEP, **SCHEDULE)
    from hvd_partialfc.tools.arcface_import import import_arcface
    summary = import_arcface(str(run), _cfg(shards, d / "imported", f"train.steps={STEP}"), log=lambda m: None)
    return {"dir": d, "shards": shards, "original": original, "state": state, "run": run, "summary": summary}


def test_the_import_holds_the_rows_momentum_and_backbone_bitwise(source):
    bb, names, momenta, rows, rows_m = source["state"]
    ckpt = source["summary"]["checkpoint"]
    meta = _json(os.path.join(ckpt, "meta.json"))
    assert meta["step"] == STEP and meta["world_size"] == WORLD
    assert meta["slices"] == [[a, a + n] for a, n in pfc_slices(CLASSES, WORLD)] == [[0, 21], [21, 42]]
    files = [torch.load(os.path.join(ckpt, f), weights_only=True) for f in meta["classifier_files"]]
    assert torch.equal(torch.cat([f["weight"] for f in files]), rows)
    assert torch.equal(torch.cat([f["optimizer"]["state"][0]["momentum_buffer"] for f in files]), rows_m)
    got = torch.load(os.path.join(ckpt, "backbone.pt"), weights_only=True)
    assert all(torch.equal(got["state_dict"][k], v) for k, v in bb.items())
    assert {names[i]: s["momentum_buffer"] for i, s in got["optimizer"]["state"].items()}.keys() == momenta.keys()
    assert all(torch.equal(got["optimizer"]["state"][names.index(k)]["momentum_buffer"], v) for k, v in momenta.items())
    assert meta["length"]["samples"] == STEP * 8 * WORLD        # arcface_torch's steps of batch_size x W


@pytest.mark.parametrize("ranks", [1, 3])
def test_it_resumes_at_another_gpu_count_as_the_original_does(source, ranks):
    """Two steps after the resume at 1 and at 3 ranks, from the import and from the original run's own
    checkpoint: every digest equal (backbone and its momentum, rows and theirs, streams and counters)."""
    d = source["dir"]
    got = simulate_here(_cfg(source["shards"], d / f"imported{ranks}", f"train.steps={STEP + 2}",
                             f"checkpoint.resume={source['summary']['checkpoint']}"), ranks)
    want = simulate_here(_cfg(source["shards"], d / f"again{ranks}", f"train.steps={STEP + 2}",
                              f"checkpoint.resume={source['original']}"), ranks)
    assert pins.checkpoint_digests(got.checkpoint) == pins.checkpoint_digests(want.checkpoint)
    # each sample scored against its own class's row: the run goes on well below a fresh run's loss at this
    # world size (a row order off by one class scores like a fresh run)
    simulate_here(_cfg(source["shards"], d / f"fresh{ranks}", "train.steps=3"), ranks)
    mean = lambda run: sum(l := [r["loss"] for r in read_json_lines(run / "metrics.jsonl")]) / len(l)  # noqa: E731
    print(f"{ranks} ranks: loss before the import {read_json_lines(d / 'original' / 'metrics.jsonl')[-1]['loss']:.3f} (2 ranks, "
          f"step {STEP}), after it {mean(d / f'imported{ranks}'):.3f} (mean of the steps after the resume; the "
          f"original's resume: the same bits), a fresh run's first steps {mean(d / f'fresh{ranks}'):.3f}")
    assert mean(d / f"imported{ranks}") < 0.7 * mean(d / f"fresh{ranks}"), (mean(d / f"imported{ranks}"),
                                                                           mean(d / f"fresh{ranks}"))


def _copy_run(source, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(source["run"], run)
    return run


@pytest.mark.parametrize("case, said", [
    ("classes", "rows do not tile"),
    ("missing", "missing checkpoint_gpu_0.pt"),
    ("rows", "rows do not tile"),
    ("optimizer", "the optimizer's backbone group holds"),
    ("truncated", "cannot read this arcface_torch rank file"),
    ("step", "are not of one checkpoint"),
    ("power", "its lr scheduler's power is 2.0, the config's optim.poly_power 1.0: set optim.poly_power=2.0"),
    ("warmup", "its lr scheduler warms up over 5 batches (5 optimizer steps at gradient_acc 1), the config's "
               "optim.warmup_steps 2: set optim.warmup_steps=5"),
    ("total", "its lr scheduler runs 30 batches (30 optimizer steps at gradient_acc 1), the config 60 steps "
              "(train.steps=60): set train.steps=30"),
    ("no scheduler", "not an arcface_torch rank file (no state_lr_scheduler)"),
])
def test_a_bad_source_is_one_line_exit_2_and_writes_nothing(source, tmp_path, capsys, case, said):
    from hvd_partialfc.cli import main
    bb, names, momenta, rows, rows_m = source["state"]
    run = tmp_path / "run"
    if case == "classes":      # a run of 40 classes, a shard set of 42
        write_run(str(run), bb, names, rows[:40], rows_m[:40], momenta, WORLD, STEP, **SCHEDULE)
    elif case == "rows":       # 42 rows in all, not Partial FC's split
        paths = write_run(str(run), bb, names, rows, rows_m, momenta, WORLD, STEP, **SCHEDULE)
        for path, cut in zip(paths, (slice(0, 22), slice(22, 42))):
            f = torch.load(path, weights_only=True)
            f["state_dict_softmax_fc"]["weight"] = rows[cut].clone()
            f["state_optimizer"]["state"][len(names)]["momentum_buffer"] = rows_m[cut].clone()
            torch.save(f, path)
    else:
        run = _copy_run(source, tmp_path)
        path = run / "checkpoint_gpu_1.pt"
        if case == "missing":     # (the last one missing reads as a run of fewer ranks: its rows do not tile)
            os.remove(run / "checkpoint_gpu_0.pt")
        elif case == "truncated":
            path.write_bytes(path.read_bytes()[:1000])
        elif case in ("power", "warmup", "total", "no scheduler"):     # rank 0's file holds the run's schedule
            f = torch.load(run / "checkpoint_gpu_0.pt", weights_only=True)
            if case == "no scheduler":
                del f["state_lr_scheduler"]
            else:
                key, value = {"power": ("power", 2), "warmup": ("warmup_iters", 5), "total": ("total_iters", 30)}[case]
                f["state_lr_scheduler"][key] = value
            torch.save(f, run / "checkpoint_gpu_0.pt")
        else:
            f = torch.load(path, weights_only=True)
            if case == "optimizer":
                f["state_optimizer"]["param_groups"][0]["params"] = f["state_optimizer"]["param_groups"][0]["params"][:-1]
            else:
                f["global_step"] = STEP + 1
            torch.save(f, path)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["import-arcface", str(run), "--shards", str(source["shards"]), "--out", str(out), *sum(
        (["--set", s] for s in SETS + [f"train.steps={STEP}"]), [])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and said in err and len(err.splitlines()) == 1, err
    assert "earlier checkpoint" not in err                    # no checkpoint of this package to go back to
    assert case != "truncated" or "copy it again from the arcface_torch run" in err
    assert not out.exists()


ARCFACE_CONFIG = '''from easydict import EasyDict as edict
import os
config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r100"
config.embedding_size = 512
config.sample_rate = 0.2
config.fp16 = True
config.batch_size = 128
config.lr = 0.2
config.rec = "/data/webface42m"
config.num_classes = 2059906
config.num_image = 42474557
config.num_epoch = 20
config.warmup_epoch = 2
config.val_targets = ["lfw", "cfp_fp"]
config.dali = True
config.lr_steps = [x * 2 for x in range(3)]
open(MARKER, "w").write("ran")
'''


def test_an_arcface_config_is_read_never_run_and_translated(tmp_path, capsys):
    """The file's literals become this package's keys (base.py's defaults under them); the keys without a
    counterpart are listed with why; a statement in the file does not run; the YAML loads as a config."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.config_io import load_config
    marker = tmp_path / "marker"
    src = tmp_path / "wf42m_r100.py"
    src.write_text(ARCFACE_CONFIG.replace("MARKER", repr(str(marker))))
    out = tmp_path / "r100.yaml"
    assert main(["config", "--from-arcface", str(src), "--world-size", "64", "--out", str(out)]) == 0
    assert not marker.exists()                                    # parsed, never executed
    text = out.read_text()
    cfg = load_config(str(out), [], {"data": {"shards": "x"}})
    assert (cfg.model.name, cfg.model.embedding_dim) == ("iresnet100", 512)
    assert (cfg.head.loss, cfg.head.margin, cfg.head.scale, cfg.head.sample_rate, cfg.head.mode) == \
        ("cosface", 0.4, 64.0, 0.2, "local")
    assert cfg.train.precision == "fp16" and cfg.train.epochs == 20 and cfg.data.batch_size == 128
    assert cfg.optim.backbone_lr == cfg.optim.classifier_lr == 0.2 and cfg.optim.backbone_momentum == 0.9
    assert cfg.optim.backbone_weight_decay == 5e-4 and cfg.optim.schedule == "poly"
    assert cfg.optim.warmup_steps == 42474557 // (128 * 64) * 2
    assert cfg.eval.pairs == ["/data/webface42m/lfw.bin", "/data/webface42m/cfp_fp.bin"]
    for dropped in ("dali: DALI", "lr_steps (line 18: not a literal", "num_classes: read from the shard set"):
        assert dropped in text, text
    assert main(["config", "--from-arcface", str(src), "--mode", "global"]) == 0
    assert "mode: global" in capsys.readouterr().out


SMALL_ARCFACE = '''from easydict import EasyDict as edict
config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r18"
config.embedding_size = 16
config.batch_size = 4
config.lr = 0.05
config.rec = "REC"
config.num_classes = 6
config.num_image = 48
config.num_epoch = 2
config.val_targets = ["lfw"]
'''


def test_the_guide_end_to_end(tmp_path, capsys):
    """docs/migrate.md's commands on a small .rec (6 classes): its shards, the config translated, a 2-rank
    arcface_torch run imported, resumed at 4 ranks (``simulate``: the numbers of a 4-rank launch,
    tests/test_engines.py and test_simulate.py), exported to ONNX. A small resnet stands in for the
    iresnet18 the config names (--set), as the shapes of a real face run would take minutes here."""
    import io
    import numpy as np
    from PIL import Image
    from data_tools.shards_cli import main as shards_main
    from helpers_recordio import write_rec
    from hvd_partialfc.cli import main
    from hvd_partialfc.models import create_model
    rng = np.random.default_rng(0)
    images, labels = [], []
    for c in range(6):
        face = rng.integers(0, 256, (32, 32, 3))
        for _ in range(8):
            buf = io.BytesIO()
            Image.fromarray(np.clip(face + rng.integers(-20, 20, face.shape), 0, 255).astype(np.uint8)).save(buf, "PNG")
            images.append(buf.getvalue())
            labels.append(c)
    write_rec(str(tmp_path / "train"), images, labels)
    shards, out = str(tmp_path / "shards"), str(tmp_path / "runs" / "r18")
    assert shards_main(["build", "recordio", str(tmp_path / "train"), "--out", shards, "--num-shards", "4",
                        "--store", "encoded", "--workers", "1"]) == 0
    conf = tmp_path / "configs" / "small_r18.py"
    conf.parent.mkdir()
    conf.write_text(SMALL_ARCFACE.replace("REC", str(tmp_path)))
    yaml_path = str(tmp_path / "r18.yaml")
    assert main(["config", "--from-arcface", str(conf), "--world-size", "2", "--out", yaml_path]) == 0
    small = sum((["--set", s] for s in ("model.name=resnet", "model.kwargs={width: 4}", "train.precision=fp32",
                                        "data.workers=0", "eval.pairs=[]", "train.steps=6", "train.threads=1")), [])
    model = create_model("resnet", in_shape=[32, 32, 3], embedding_dim=16, width=4)
    names = [n for n, _ in model.named_parameters()]
    torch.manual_seed(0)
    write_run(str(tmp_path / "arcface_run"), model.state_dict(), names, torch.randn(6, 16), 0.01 * torch.randn(6, 16),
              {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}, world=2, step=4,
              lr=0.05, total=6, power=1)       # the YAML's lr and poly power, train.steps=6 below
    capsys.readouterr()
    assert main(["import-arcface", str(tmp_path / "arcface_run"), "--shards", shards, "--config", yaml_path,
                 "--out", out, *small]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert main(["simulate", "--ranks", "4", "--config", yaml_path, "--shards", shards, "--out", out,
                 "--resume", "auto", *small]) == 0
    assert "at step 4 (written by 2 ranks)" in capsys.readouterr().out
    from hvd_partialfc.run_files import find_resume
    meta = _json(os.path.join(find_resume(out), "meta.json"))
    # train.steps=6 counts the first world size's steps (2 ranks x 4): 48 samples, the last 16 in one 4-rank step
    assert meta["world_size"] == 4 and meta["length"]["samples"] == 6 * 2 * 4 and meta["step"] == 5
    assert main(["export", out, "--onnx", "--out", str(tmp_path / "r18.onnx")]) == 0


def test_the_committed_run_imports(tmp_path, capsys):
    """tests/fixtures/arcface/tiny (3 ranks, 40 classes; its README says how it was made) into the features
    shard set: its rows, in Partial FC v2's 14, 13, 13 slices, and their momentum, bitwise."""
    from hvd_partialfc.cli import main
    run = os.path.join(pins.ROOT, "tests", "fixtures", "arcface", "tiny")
    shards = os.path.join(pins.FIXTURES, "data", "features")
    out = tmp_path / "imported"
    sets = sum((["--set", s] for s in ("model.name=mlp", "model.embedding_dim=32", "model.kwargs={hidden_dim: 32}",
                                       "head.negatives_every=0", "optim.schedule=poly", "train.steps=70")), [])
    assert main(["import-arcface", run, "--shards", shards, "--out", str(out), *sets]) == 0
    meta = _json(out / "checkpoints" / "step-00000007" / "meta.json")
    assert meta["slices"] == [[0, 14], [14, 27], [27, 40]] and meta["imported_from"]["ranks"] == 3
    for r, name in enumerate(meta["classifier_files"]):
        src = torch.load(os.path.join(run, f"checkpoint_gpu_{r}.pt"), weights_only=True)
        got = torch.load(out / "checkpoints" / "step-00000007" / name, weights_only=True)
        assert torch.equal(got["weight"], src["state_dict_softmax_fc"]["weight"])
        assert torch.equal(got["optimizer"]["state"][0]["momentum_buffer"],
                           src["state_optimizer"]["state"][9]["momentum_buffer"])


# --- the run's own lr schedule (state_lr_scheduler) and gradient accumulation ---------------------------------

def arcface_lrs(sched, global_step, acc, end):
    """The lr of each optimizer step arcface_torch's train_v2.py takes when it resumes from the scheduler
    state ``sched`` at ``global_step`` and runs to batch ``end``, computed here from the schedulers' published
    behaviour (not this package's code): each batch adds 1 to global_step; when global_step % acc == 0 the
    optimizer steps at the scheduler's current lr; then the scheduler steps (last_epoch + 1), every batch.
    Today's PolynomialLRWarmup (``total_iters``): lr(0) = base, base * e / warmup up to e = warmup, then
    base * (1 - (e - warmup) / (total - warmup)) ** power, unchanged past total. The older PolyScheduler
    (``max_steps``): base * e / warmup below warmup, then the same decay, power 2."""
    new = "total_iters" in sched
    base, power = sched["base_lrs"][0], sched["power"]
    total, warm = (sched["total_iters"], sched["warmup_iters"]) if new else (sched["max_steps"], sched["warmup_steps"])

    def lr(e):
        if new and e == 0:
            return base
        if (new and e <= warm) or (not new and e < warm):
            return base * e / warm
        return base * (1 - (min(e, total) - warm) / (total - warm)) ** power

    e, out = sched["last_epoch"], []
    for g in range(global_step + 1, end + 1):
        if g % acc == 0:
            out.append(lr(e))
        e += 1
    return out


def _continue(run, cfg, sched, global_step, acc, batches, per_batch):
    """Import ``run`` into ``cfg.out``, resume it there (simulate, the same ranks) to its end: each resumed
    step's lr against arcface_torch's own (``arcface_lrs``) within 1e-6, the run ending where arcface's does
    (``batches`` batches of ``per_batch`` samples over all ranks)."""
    from dataclasses import replace
    from hvd_partialfc.tools.arcface_import import import_arcface
    summary = import_arcface(str(run), cfg, log=lambda m: None)
    assert summary["step"] == global_step // acc and summary["samples_consumed"] == global_step * per_batch
    simulate_here(replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")), WORLD)
    got = [r["lr"] for r in read_json_lines(os.path.join(cfg.out, "metrics.jsonl"))]
    want = arcface_lrs(sched, global_step, acc, batches)
    assert len(got) == len(want) == (batches - global_step) // acc
    worst = max(abs(a - b) for a, b in zip(got, want))
    print(f"gradient_acc {acc}: {len(got)} resumed steps, lr {got[0]:.6f} ... {got[-1]:.6f}, "
          f"max |lr - arcface_torch's| {worst:.2g}")
    assert worst < 1e-6, (got, want)
    from hvd_partialfc.run_files import find_resume
    length = _json(os.path.join(find_resume(cfg.out), "meta.json"))["length"]
    assert length["samples"] == length["budget_samples"] == batches * per_batch


def _small_run(run, world, step, **sched):
    from hvd_partialfc.models import create_model
    torch.manual_seed(0)
    model = create_model("mlp", in_shape=[16], embedding_dim=16, hidden_dim=16)
    write_run(str(run), model.state_dict(), [n for n, _ in model.named_parameters()], torch.randn(8, 16),
              0.01 * torch.randn(8, 16), {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()},
              world, step, epoch=1, **sched)
    return torch.load(os.path.join(run, "checkpoint_gpu_0.pt"), weights_only=True)["state_lr_scheduler"]


SMALL_SETS = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=4",
              "head.negatives_every=0", "train.threads=1", "data.workers=0", "train.log_every=1", "data.augment=[]"]

ACC_CONFIG = '''from easydict import EasyDict as edict
config = edict()
config.network = "r18"
config.embedding_size = 16
config.batch_size = 4
config.gradient_acc = 4
config.lr = 0.2
config.num_image = 96
config.num_epoch = 3
config.warmup_epoch = 2
'''


def test_a_gradient_acc_run_goes_on_at_arcface_lr_and_length(tmp_path):
    """arcface_torch at gradient_acc 4 on 2 ranks of 4 samples a batch: 96 images are 12 batches an epoch, its
    scheduler (one step a batch) 36 batches with 24 of warm-up. Saved after its first epoch (global_step 12:
    3 optimizer steps, 96 samples), it is translated (warm-up 6 optimizer steps, not 24), imported at step 3,
    and goes on for arcface's 6 remaining optimizer steps (3 in warm-up, 3 after) at arcface's own lr."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.config_io import load_config
    shards = build_shards(make_feature_npz(tmp_path / "f.npz", [12] * 8), tmp_path / "shards", 2)
    (tmp_path / "acc4.py").write_text(ACC_CONFIG)
    assert main(["config", "--from-arcface", str(tmp_path / "acc4.py"), "--world-size", "2",
                 "--out", str(tmp_path / "acc4.yaml")]) == 0
    cfg = load_config(str(tmp_path / "acc4.yaml"), SMALL_SETS,
                      {"data": {"shards": shards}, "out": str(tmp_path / "out")})
    assert cfg.optim.warmup_steps == 6 and cfg.optim.backward_passes_per_step == 4 and cfg.train.epochs == 3
    sched = _small_run(tmp_path / "run", WORLD, 12, lr=0.2, total=36, warmup=24, power=1.0)
    _continue(tmp_path / "run", cfg, sched, 12, 4, 36, 8)


def test_a_run_on_uneven_data_goes_on_at_arcface_lr_and_length(tmp_path):
    """Uneven data (classes of 40 and 8 samples, 4 shards): at 2 ranks of 4 a batch this package's loader
    gives the smaller rank 8 steps an epoch, arcface_torch's scheduler counts 96 // 8 = 12. An older
    arcface_torch run (PolyScheduler: power 2, last_epoch one behind) saved after its first epoch goes on
    at its own lr for its 24 remaining steps, to its 36 batches, not 3 x 8."""
    from hvd_partialfc.config_io import load_config
    shards = build_shards(make_feature_npz(tmp_path / "f.npz", [40] + [8] * 7), tmp_path / "shards", 4)
    cfg = load_config(None, [*SMALL_SETS, f"data.shards={shards}", f"out={tmp_path / 'out'}", "optim.schedule=poly",
                             "optim.poly_power=2", "optim.warmup_steps=12", "train.epochs=3"])
    sched = _small_run(tmp_path / "run", WORLD, 12, total=36, warmup=12, power=2, scheduler="poly")
    _continue(tmp_path / "run", cfg, sched, 12, 1, 36, 8)


SUM_CONFIG = '''from easydict import EasyDict as edict
config = edict()
config.margin_list = (1.0, 0.0, 0.4)
config.network = "r18"
config.embedding_size = 16
config.batch_size = 4
config.gradient_acc = 2
config.lr = 0.4
config.num_image = 8
config.num_epoch = 2
config.warmup_epoch = 0
'''


def test_a_gradient_acc_run_goes_on_with_arcface_summed_gradient(tmp_path, monkeypatch):
    """arcface_torch's train_v2.py backpropagates each of its gradient_acc batches' losses undivided: its step's
    gradient is their sum, k times this package's mean. A 1-rank run at gradient_acc 2 (8 samples: one optimizer
    step an epoch, 2 in its scheduler's 4 batches), saved after its first epoch, translated and imported, takes
    its last step here; arcface's own continuation is computed in the test from the same state and the same two
    batches (those the step drew): CosFace (s 64, m 0.4) over every class, each batch's mean loss backpropagated
    and summed, clip_grad_norm_(backbone, 5), one SGD over its two groups at the scheduler's lr. The backbone
    and the rows after the step agree within float tolerance (under mean they differ by 0.05 and 0.16). The
    import refuses the config's mean at gradient_acc > 1 with the key to set, and so does the resume of an
    import written before the key existed."""
    import torch.nn.functional as F
    from dataclasses import replace
    from hvd_partialfc.cli import main
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.models import create_model
    from hvd_partialfc.run import step as step_module
    from hvd_partialfc.run.ckpt.resume import check_config
    from hvd_partialfc.tools.arcface_import import ArcfaceImportError, import_arcface
    shards = build_shards(make_feature_npz(tmp_path / "f.npz", [1] * 8), tmp_path / "shards", 2)
    (tmp_path / "acc2.py").write_text(SUM_CONFIG)
    assert main(["config", "--from-arcface", str(tmp_path / "acc2.py"), "--world-size", "1",
                 "--out", str(tmp_path / "acc2.yaml")]) == 0
    cfg = load_config(str(tmp_path / "acc2.yaml"), SMALL_SETS, {"data": {"shards": shards}, "out": str(tmp_path / "out")})
    assert cfg.optim.accumulate == "sum" and cfg.optim.backward_passes_per_step == 2
    torch.manual_seed(0)
    model = create_model("mlp", in_shape=[16], embedding_dim=16, hidden_dim=16)
    with torch.no_grad():    # the same function (BatchNorm after each layer, the embedding normalised), a gradient
        for p in model.parameters():     # 1/100 as large: under the clip of 5, so the backbone's step shows it
            p.mul_(100)
    write_run(str(tmp_path / "run"), model.state_dict(), [n for n, _ in model.named_parameters()],
              torch.randn(8, 16), 0.01 * torch.randn(8, 16),
              {n: 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}, 1, 2, lr=0.4, total=4, power=1.0)
    src = torch.load(tmp_path / "run" / "checkpoint_gpu_0.pt", weights_only=True)
    with pytest.raises(ArcfaceImportError, match="set optim.accumulate=sum"):
        import_arcface(str(tmp_path / "run"), replace(cfg, optim=replace(cfg.optim, accumulate="mean")),
                       log=lambda m: None)
    summary = import_arcface(str(tmp_path / "run"), cfg, log=lambda m: None)
    assert summary["step"] == 1
    # an import from before the key (its config without it) resumes with the sum, never silently with the mean
    old = _json(os.path.join(summary["checkpoint"], "meta.json"))
    del old["config"]["optim"]["accumulate"]
    check_config(old, cfg, print)
    with pytest.raises(ValueError, match="optim.accumulate: 'sum' != 'mean'"):
        check_config(old, replace(cfg, optim=replace(cfg.optim, accumulate="mean")), print)
    drawn, prepare = [], step_module.prepare_batch

    def recording(*args):
        drawn.append(prepare(*args))
        return drawn[-1]
    monkeypatch.setattr(step_module, "prepare_batch", recording)
    ours = simulate_here(replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto")), 1).checkpoint
    assert _json(os.path.join(ours, "meta.json"))["step"] == 2 and len(drawn) == 2

    # arcface_torch's step, from its rank file
    model.load_state_dict(src["state_dict_backbone"])
    rows = torch.nn.Parameter(src["state_dict_softmax_fc"]["weight"].clone())
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [rows]}], lr=0.4, momentum=0.9,
                          weight_decay=5e-4)
    opt.load_state_dict(src["state_optimizer"])
    for g in opt.param_groups:
        g["lr"] = arcface_lrs(src["state_lr_scheduler"], 2, 2, 4)[0]
    model.train()
    for x, y in drawn:
        cos = (F.normalize(model(x)) @ F.normalize(rows).t()).clamp(-1, 1)
        F.cross_entropy(64 * (cos - 0.4 * F.one_hot(y, 8)), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5)
    opt.step()
    bb = torch.load(os.path.join(ours, "backbone.pt"), weights_only=True)["state_dict"]
    got_rows = torch.load(os.path.join(ours, _json(os.path.join(ours, "meta.json"))["classifier_files"][0]),
                          weights_only=True)["weight"]
    backbone = max((bb[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    row_diff = (got_rows - rows.detach()).abs().max().item()
    print(f"summed gradient norm {float(norm):.3f} (unclipped); max |ours - arcface_torch's|: backbone "
          f"{backbone:.2g}, rows {row_diff:.2g}")
    assert float(norm) < 5 and backbone < 1e-5 and row_diff < 1e-5, (float(norm), backbone, row_diff)


PARSED = '''config = edict()
config.lr, config.batch_size = 0.2, 64
config.embedding_size: int = 256
config["sample_rate"] = 0.3
if os.environ.get("BIG"):
    config.network = "r200"
config.margin_list = (1.0, 0.5, 0.0)
config.margin_list[1] = 0.4
config.momentum = 0.9
config.momentum *= 0.5
config.num_epoch = {[1]: 2}
'''


def test_the_config_parser_reads_every_plain_assignment_and_lists_the_rest(tmp_path, capsys):
    """Tuple, annotated and subscript assignments are read; one under an ``if``, an element set, an
    augmented one and a literal that raises TypeError are each listed as not read (no traceback); a file
    that is not Python is one line, exit 2."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.tools.arcface_config import read_config
    src = tmp_path / "c.py"
    src.write_text(PARSED)
    values, not_read = read_config(str(src))
    assert (values["lr"], values["batch_size"], values["embedding_size"], values["sample_rate"]) == (0.2, 64, 256, 0.3)
    assert values["network"] == "r50"        # base.py's: the file's r200 is conditional
    said = " | ".join(not_read)
    for key, line in (("network", 6), ("margin_list", 8), ("momentum", 10), ("num_epoch", 11)):
        assert f"{key} (line {line}" in said, said
    assert len(not_read) == 4, not_read
    src.write_text("config.lr = (\n")
    capsys.readouterr()
    assert main(["config", "--from-arcface", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{src}:1" in err, err


ARITHMETIC = """config = edict()
config.network = "vit_b_dp005_mask_005"
config.num_epoch = 40
config.warmup_epoch = config.num_epoch // 10
config["lr"] = -(-config.batch_size) * 1e-5
config.a = config.network + "x"
config.b = 1 // 0
config.c = config.nowhere * 2
config.d = config.num_epoch ** 2
config.seed = -7
"""


def test_the_parser_computes_arithmetic_of_literals_and_keys_set_before(tmp_path):
    """arcface_torch's ViT recipes write ``config.warmup_epoch = config.num_epoch // 10``: + - * / // % and a
    sign over numbers and keys set before (base.py's too: batch_size 128) are computed and said; strings,
    a division by zero, a key set nowhere and any other operator are listed as not read. A ViT that
    arcface_torch checkpoints gets model.checkpoint_activations."""
    from hvd_partialfc.tools.arcface_config import read_config, translate
    src = tmp_path / "vit.py"
    src.write_text(ARITHMETIC)
    computed = []
    values, not_read = read_config(str(src), computed)
    assert values["warmup_epoch"] == 4 and values["lr"] == 128 * 1e-5 and values["seed"] == -7   # (a literal)
    assert computed == ["warmup_epoch = config.num_epoch // 10 = 4 (line 4)",
                        "lr = --config.batch_size * 1e-05 = 0.00128 (line 5)"]
    said = " | ".join(not_read)
    assert all(f"{k} (line {n}: not a literal" in said for k, n in (("a", 6), ("b", 7), ("c", 8), ("d", 9))), said
    assert not {"a", "b", "c", "d"} & set(values)
    cfg, _ = translate(values, 8)
    assert cfg["model"] == {"name": "vit_b_dp005_mask_005", "checkpoint_activations": True, "embedding_dim": 512}
    assert translate(dict(values, network="vit_t"), 8)[0]["model"] == {"name": "vit_t", "embedding_dim": 512}
    assert translate(dict(values, network="mbf_large"), 8)[0]["model"] == {    # its get_mbf_large's arguments
        "name": "mobilefacenet", "kwargs": {"blocks": [2, 8, 12, 4], "scale": 4}, "embedding_dim": 512}


ADAMW = ["optim.name=adamw", "optim.backbone_lr=0.01", "optim.classifier_lr=0.01"]


def test_an_adamw_run_imports_bitwise_and_resumes_as_the_original(tmp_path):
    """arcface_torch's ViT recipes train with AdamW: its moments and step count of every backbone parameter
    and of the rows come over bitwise, and the import resumes at 1 rank exactly as the original run's own
    checkpoint does (without the moments, the first steps differ). Into a sampled ``local`` head, every row's
    count is the run's. A config of another optimizer or beta1 is refused with the key to set."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.tools.arcface_import import import_arcface
    shards = build_shards(make_feature_npz(tmp_path / "f.npz", [24] * CLASSES), tmp_path / "shards", 8)
    original = simulate_here(_cfg(shards, tmp_path / "original", f"train.steps={STEP}", *ADAMW), WORLD).checkpoint
    meta = _json(os.path.join(original, "meta.json"))
    bb = torch.load(os.path.join(original, "backbone.pt"), weights_only=True)
    m = meta["model"]
    from hvd_partialfc.models import create_model
    names = [n for n, _ in create_model(m["name"], in_shape=m["in_shape"], embedding_dim=m["embedding_dim"],
                                        **m["kwargs"]).named_parameters()]
    states = {names[i]: s for i, s in bb["optimizer"]["state"].items()}
    assert set(states[names[0]]) == {"step", "exp_avg", "exp_avg_sq"} and float(states[names[0]]["step"]) == STEP
    files = [torch.load(os.path.join(original, f), weights_only=True) for f in meta["classifier_files"]]
    rows = torch.cat([f["weight"] for f in files])
    row_state = {k: torch.cat([f["optimizer"]["state"][0][k] for f in files]) for k in ("exp_avg", "exp_avg_sq")}
    row_state["step"] = files[0]["optimizer"]["state"][0]["step"]
    run = tmp_path / "arcface_run"
    write_run(str(run), bb["state_dict"], names, rows, row_state, states, WORLD, STEP, lr=0.01, optimizer="adamw",
              **SCHEDULE)
    summary = import_arcface(str(run), _cfg(shards, tmp_path / "imported", f"train.steps={STEP}", *ADAMW),
                             log=lambda m: None)
    got = torch.load(os.path.join(summary["checkpoint"], "backbone.pt"), weights_only=True)["optimizer"]["state"]
    assert all(torch.equal(got[names.index(n)][k], s[k]) for n, s in states.items() for k in s)
    mine = [torch.load(os.path.join(summary["checkpoint"], f), weights_only=True) for f in meta["classifier_files"]]
    assert all(torch.equal(torch.cat([f["optimizer"]["state"][0][k] for f in mine]), row_state[k])
               for k in ("exp_avg", "exp_avg_sq"))
    resumed = [simulate_here(_cfg(shards, tmp_path / name, f"train.steps={STEP + 2}", *ADAMW,
                                  f"checkpoint.resume={ckpt}"), 1).checkpoint
               for name, ckpt in (("again", original), ("from_import", summary["checkpoint"]))]
    assert pins.checkpoint_digests(resumed[0]) == pins.checkpoint_digests(resumed[1])
    sampled = import_arcface(str(run), _cfg(shards, tmp_path / "sampled", f"train.steps={STEP}", *ADAMW,
                                            "head.sample_rate=0.5"), log=lambda m: None)
    f = torch.load(os.path.join(sampled["checkpoint"], meta["classifier_files"][1]), weights_only=True)
    assert torch.equal(f["optimizer"]["state"][0]["step"], torch.full((21,), float(STEP)))
    for extra, said in ((["optim.name=sgd"], "its optimizer is adamw, the config's optim.name sgd: set optim.name=adamw"),
                        (ADAMW + ["optim.classifier_momentum=0.8"],
                         "its AdamW's beta1 is 0.9, the config's optim.classifier_momentum 0.8: set "
                         "optim.classifier_momentum=0.9")):
        sets = sum((["--set", x] for x in SETS + [f"train.steps={STEP}"] + extra), [])
        assert main(["import-arcface", str(run), "--shards", str(shards), "--out", str(tmp_path / "no"), *sets]) == 2
        assert not (tmp_path / "no").exists()
