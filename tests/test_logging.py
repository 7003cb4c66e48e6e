"""Logging: metrics.jsonl carries data and step time; train.tensorboard writes the same numbers as TensorBoard
scalars (read back with TensorBoard's own reader); without TensorBoard the config is refused up front."""
import os
import sys

import numpy as np
import pytest

from conftest import launch_env, read_json_lines, run_job
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.run.metrics_log import LoaderWatch, scalars
from hvd_partialfc.run.startup import check_runtime_options
from data_tools.pair_sets import write_pairs_h5


def _pairs(path, n_images=40, n_pairs=40, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_images // 4), 4)
    pairs = rng.integers(0, n_images, (n_pairs, 2))
    pairs[::2, 1] = pairs[::2, 0] // 4 * 4 + (pairs[::2, 0] + 1) % 4    # every other pair: same class
    images = (rng.random((n_images, 32, 32)) * 255).astype(np.uint8)
    write_pairs_h5(str(path), images, pairs, labels[pairs[:, 0]] == labels[pairs[:, 1]], labels)
    return str(path)


def test_tensorboard_scalars_equal_metrics_jsonl(image_shards, tmp_path):
    pytest.importorskip("tensorboard", reason="scripts/setup/install.sh installs tensorboard; this venv lacks it")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = str(tmp_path / "run")
    sets = ["model.name=resnet", "model.kwargs={width: 4}", "data.batch_size=8", "train.log_every=2",
            "train.tensorboard=true", f"eval.pairs=[{_pairs(tmp_path / 'p.h5')}]", "eval.every=4",
            "data.augment=[flip]"]
    cmd = [sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", image_shards, "--out", run, "--steps", "8"]
    for s in sets:
        cmd += ["--set", s]
    p = run_job(cmd, launch_env(), timeout=120)     # one process, no horovodrun: world size 1
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    records = read_json_lines(os.path.join(run, "metrics.jsonl"))
    train_recs = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_recs] == [2, 4, 6, 8]
    for r in train_recs:
        assert 0 <= r["data_time"] <= r["step_time"]
    assert [r["step"] for r in records if "eval" in r] == [4, 8]

    ea = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    got = {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}
    want = {}
    for r in records:                              # an independent walk over the JSON records
        if "eval" in r:
            for k, v in r["eval"].items():
                if k not in ("step", "set") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    want.setdefault(f"eval/{r['eval']['set']}/{k}", {})[r["step"]] = v
        else:
            for k, v in r.items():
                if k not in ("step", "time"):
                    want.setdefault(f"train/{k}", {})[r["step"]] = v
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/data_time",
                "train/step_time", "eval/p/acc", "eval/p/auc"):
        assert tag in got, sorted(got)
    assert got.keys() == want.keys()
    for tag, by_step in want.items():
        assert got[tag].keys() == by_step.keys(), tag
        for step, v in by_step.items():
            assert got[tag][step] == np.float32(v), (tag, step)    # event files hold float32


def test_tensorboard_missing_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)          # `import tensorboard` now raises
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"train.tensorboard: TensorBoard is not installed .*tensorboard==2.21.0"):
        check_runtime_options(load_config(None, ["data.shards=/x", "train.tensorboard=true"]), "images")
    check_runtime_options(load_config(None, ["data.shards=/x"]), "images")   # off: no import at all


def test_scalars_of_a_record():
    rec = {"step": 3, "loss": 1.5, "lr": 0.1, "time": 5.0, "skipped_steps": 0, "note": "x", "flag": True}
    assert dict(scalars(rec)) == {"train/loss": 1.5, "train/lr": 0.1, "train/skipped_steps": 0.0}
    ev = {"eval": {"step": 3, "set": "lfw", "acc": 0.9, "tar@far=1e-3": None}, "step": 3}
    assert dict(scalars(ev)) == {"eval/lfw/acc": 0.9}


def test_loader_watch_warns_once_after_the_first_interval():
    w = LoaderWatch(workers=2)
    assert w.check(10, 0.9, 1.0, first=True) is None               # workers starting up: never
    assert w.check(20, 0.5, 1.0) is None                           # exactly half: not loader-bound
    msg = w.check(30, 0.6, 1.0)
    assert msg.startswith("step 30: loader-bound") and "data.workers (now 2)" in msg and "50%" in msg
    assert w.check(40, 0.9, 1.0) is None                           # once per run
