"""The face workload end to end (issue 13's "done when"): a face recipe with iresnet18 on 3 x 112 x 112 RGB
shards under ``horovodrun -np 2``: it trains with flip augmentation, verifies on an LFW-style ``.bin``
during training, checkpoints, is killed, resumes bitwise, and exports to ONNX."""
from __future__ import annotations

import io
import json
import os
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import BIN, build_shards, read_json_lines, run_hvd

pytestmark = pytest.mark.multirank
CLI = os.path.join(BIN, "hvd-partialfc")


def _faces(path, classes=6, per_class=8, seed=0):
    """Smooth random RGB 'faces': a class template (low-frequency colour field) plus per-sample noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(classes, 7, 7, 3)).astype(np.uint8)
    templates = np.stack([np.asarray(Image.fromarray(t).resize((112, 112), Image.BILINEAR)) for t in small])
    y = np.repeat(np.arange(classes), per_class)
    x = np.clip(templates[y].astype(int) + rng.integers(-30, 30, size=(len(y), 112, 112, 3)), 0, 255)
    np.savez(path, images=x.astype(np.uint8), labels=y)
    return path, templates


def _bin(path, templates, seed=1):
    from data_tools.pair_sets import write_bin
    rng = np.random.default_rng(seed)
    blobs, same = [], []
    for k in range(12):
        a = k % len(templates)
        b = a if k % 2 == 0 else (a + 1) % len(templates)
        for t in (a, b):
            im = np.clip(templates[t].astype(int) + rng.integers(-30, 30, size=(112, 112, 3)), 0, 255)
            buf = io.BytesIO()
            Image.fromarray(im.astype(np.uint8)).save(buf, format="PNG")
            blobs.append(buf.getvalue())
        same.append(a == b)
    write_bin(str(path), blobs, same)
    return str(path)


def _train(shards, out, sets, fault=None, check=True):
    args = ["-m", "hvd_partialfc.cli", "train", "--config", "configs/ms1mv3_r50.yaml", "--shards", shards,
            "--out", out]
    for s in sets:
        args += ["--set", s]
    env = {"HVD_PARTIALFC_FAULT": fault} if fault else {}
    return run_hvd(2, args, env=env, check=check, timeout=600)


def test_face_recipe_iresnet18_trains_verifies_resumes_and_exports_onnx(tmp_path):
    npz, templates = _faces(tmp_path / "faces.npz")
    shards = build_shards(npz, tmp_path / "shards", 2)
    lfw = _bin(tmp_path / "lfw.bin", templates)
    sets = ["model.name=iresnet18", "data.batch_size=4", "data.workers=0", "train.steps=6", "train.precision=fp32",
            "train.log_every=1", "checkpoint.every=2", f"eval.pairs=[{lfw}]", "eval.every=2", "eval.batch_size=8"]
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    _train(shards, whole, sets)
    p = _train(shards, resumed, sets, fault="kill@3:1", check=False)      # rank 1 dies after step 3
    assert p.returncode != 0
    _train(shards, resumed, sets + ["checkpoint.resume=auto"])

    cfg = json.load(open(os.path.join(whole, "checkpoints", "step-00000006", "meta.json")))["config"]
    assert cfg["model"]["name"] == "iresnet18" and cfg["data"]["augment"] == ["flip"] and cfg["eval"]["flip"]
    for run in (whole, resumed):
        evals = [r for r in read_json_lines(os.path.join(run, "metrics.jsonl")) if "eval" in r]
        assert sorted({r["step"] for r in evals}) == [2, 4, 6]           # verified during training, on the .bin
        assert all(r["eval"]["pairs"] == 12 for r in evals if r["step"] == 6)
    # the resumed run ends bitwise where the uninterrupted one does (backbone, both classifiers)
    ck = [os.path.join(r, "checkpoints", "step-00000006") for r in (whole, resumed)]
    metas = [json.load(open(os.path.join(c, "meta.json"))) for c in ck]
    assert metas[0]["digests"] == metas[1]["digests"]
    for name in metas[0]["classifier_files"]:
        a, b = (torch.load(os.path.join(c, name), weights_only=True) for c in ck)
        assert torch.equal(a["weight"], b["weight"])

    onnx_path = tmp_path / "model.onnx"
    r = subprocess.run([CLI, "export", resumed, "--onnx", "--out", str(onnx_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert onnx_path.stat().st_size > 10 ** 7                            # iresnet18's 24 M parameters
    import onnxruntime as ort
    from hvd_partialfc.tools.export import load_backbone
    export_pt = tmp_path / "bb.pt"
    subprocess.run([CLI, "export", resumed, "--out", str(export_pt)], check=True, capture_output=True)
    model, _ = load_backbone(str(export_pt))
    x = np.random.default_rng(0).uniform(-1, 1, size=(3, 3, 112, 112)).astype(np.float32)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert got.shape == (3, 512) and np.abs(got - want).max() < 1e-3
