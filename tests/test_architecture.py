"""The architecture's promises: a classifier mode is one registered component, and the core runs without
Horovod (only the Horovod engine, engine/horovod.py, imports it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from conftest import BLOCK_HOROVOD, ROOT, launch_env

FEATURES = os.path.join(ROOT, "tests", "fixtures", "pins", "data", "features")
SMALL = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=16",
         "train.threads=1", "head.loss=cosface", "head.scale=16", "head.margin=0.2"]


def test_a_fourth_mode_registered_in_one_place_trains_under_simulate(tmp_path):
    """A toy mode (a local head whose classifier is frozen) registered here, nowhere else, trains under
    ``simulate --ranks 2``: its head and its "optimizer" are the ones used, the backbone learns."""
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.classifier.modes import LocalMode, _MODES, register_mode
    from hvd_partialfc.classifier.optimizers import NoOptimizer
    from hvd_partialfc.run.simulate import simulate
    built = []

    @register_mode("frozen_local")
    class FrozenLocal(LocalMode):
        samples = negatives = False

        def create_head(self, cfg, layout, rank, comm):
            head = super().create_head(cfg, layout, rank, comm)
            built.append((rank, type(head).__name__, head.width))
            return head

        def classifier_optimizer(self, head, cfg):
            head.weight.requires_grad_(False)
            return NoOptimizer()

    try:
        cfg = load_config(None, [f"data.shards={FEATURES}", f"out={tmp_path / 'run'}", "train.steps=6",
                                 "head.mode=frozen_local", "head.negatives_every=0", *SMALL])
        result = simulate(cfg, 2)
    finally:
        _MODES.pop("frozen_local")
    assert sorted(built) == [(0, "LocalHead", 20), (1, "LocalHead", 20)]
    for r in range(2):
        f = torch.load(os.path.join(result.checkpoint, f"classifier-{r:05d}-of-00002.pt"), weights_only=True)
        # frozen: the rows are still their init (parts.init_classifier_rows), checked against a fresh draw
        from hvd_partialfc.run.parts import init_classifier_rows
        want = torch.empty(20, 16)
        init_classifier_rows(want, 20 * r, cfg.train.seed)
        assert torch.equal(f["weight"], want)
        assert f["optimizer"] == {}
    bb = torch.load(os.path.join(result.checkpoint, "backbone.pt"), weights_only=True)
    assert bb["optimizer"]["state"], "the backbone was stepped"


NO_HOROVOD = BLOCK_HOROVOD + """
import json
from hvd_partialfc.cli import main
from hvd_partialfc.tools.bench import main as bench_main
for args in json.loads(sys.argv[1]) if sys.argv[1].startswith("[[") else [sys.argv[1:]]:   # a list, or one
    rc = bench_main(args[1:]) if args[0] == "bench" else main(args)
    assert rc == 0, (args[0], rc)
assert not any(m == "horovod" or m.startswith("horovod.") for m in sys.modules), "horovod was imported"
"""


def _no_horovod(commands, cwd=ROOT):
    """Each ``hvd-partialfc ARGS`` of ``commands`` (``bench ...``: the benchmark's) in turn, in one process (one
    start-up) with horovod blocked."""
    p = subprocess.run([sys.executable, "-c", NO_HOROVOD, json.dumps([[str(a) for a in c] for c in commands])],
                       env=launch_env(), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_the_core_runs_without_horovod(tmp_path, monkeypatch):
    """``import horovod`` blocked (an install with ``--no-horovod``): ``simulate --ranks 2``, training under
    torchrun at 2 ranks (and alone, ``train.engine=auto`` picks the torch engine), the benchmark's
    no-communication job and ``eval`` run, and no module of horovod is ever imported."""
    sets = [x for s in SMALL for x in ("--set", s)]
    (tmp_path / "job").mkdir()
    out = _no_horovod([["simulate", "--ranks", 2, "--shards", FEATURES, "--out", tmp_path / "run", "--steps", 4, *sets],
                       ["bench", "--worker", "limit", "--classes", 40, "--dim", 16, "--batch", 8, "--steps", 2,
                        "--warmup", 1, "--np", 2, "--in-dim", 16, "--rank", 1, "--job", tmp_path / "job"],
                       ["eval", "--backbone", tmp_path / "run", "--all-pairs", FEATURES, "--out", tmp_path / "eval"]])
    assert os.listdir(tmp_path / "job") == ["rank-1.json"]
    assert "all-pairs" in out.stdout.lower() or os.listdir(tmp_path / "eval")
    script = tmp_path / "no_horovod.py"
    script.write_text(NO_HOROVOD)
    p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
                        "--standalone", str(script), "train", "--shards", FEATURES, "--out", tmp_path / "tr",
                        "--steps", "4", *sets], env=launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "train np=2" in p.stderr + p.stdout, p.stderr[-3000:]
    import importlib.util
    from hvd_partialfc.engine.select import choose_engine   # alone, without Horovod: auto means torch
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "horovod" else real(name, *a))
    assert choose_engine("auto", {}) == "torch"


def test_the_config_is_plain_data():
    """Loading and validating a config imports nothing of the runtime (no torch, no registry)."""
    code = ("import sys; from hvd_partialfc.config_io import load_config; "
            "load_config(None, ['data.shards=x', 'head.mode=global', 'data.augment=[flip]']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'h5py') "
            "or m.startswith('hvd_partialfc.') and m not in ('hvd_partialfc.config', 'hvd_partialfc.config_io')))")
    p = subprocess.run([sys.executable, "-c", code], env=launch_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_test_extra_holds_what_the_suite_imports():
    """``pip install -e .[test]`` gives everything the suite imports (a new user installed the test needs by
    hand, and Horovod's tests errored): every third-party module imported under tests/ is in install_requires,
    the ``test`` extra, or an optional extra whose tests skip without it."""
    import ast
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    names = lambda text: {l.split("=")[0].split(">")[0].split("<")[0].strip().lower()   # noqa: E731
                          for l in text.splitlines() if l.strip() and not l.strip().startswith("#")}
    have = names(cfg["options"]["install_requires"])
    extras = cfg["options.extras_require"]
    have |= names(extras["test"]) | names(extras["horovod"]) | names(extras["tensorboard"])
    dist = {"PIL": "pillow", "yaml": "pyyaml", "fontTools": "fonttools", "xdist": "pytest-xdist"}
    local = {"hvd_partialfc", "data_tools", "scripts"} | {
        f[:-3] for folder in ("tests", os.path.join("tests", "mr")) for f in os.listdir(os.path.join(ROOT, folder))
        if f.endswith(".py")}
    found = set()
    for folder in ("tests", os.path.join("tests", "mr")):
        for f in os.listdir(os.path.join(ROOT, folder)):
            if f.endswith(".py"):
                for node in ast.walk(ast.parse(open(os.path.join(ROOT, folder, f)).read())):
                    if isinstance(node, ast.Import):
                        found |= {a.name.split(".")[0] for a in node.names}
                    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                        found.add(node.module.split(".")[0])
    third = {m for m in found if m not in sys.stdlib_module_names and m not in local}
    missing = sorted(m for m in third if dist.get(m, m).lower() not in have)
    assert not missing, f"imported by the tests, in no requirement of setup.cfg: {missing}"
