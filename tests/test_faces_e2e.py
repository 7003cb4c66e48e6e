"""The face workload end to end: a face recipe with iresnet18 on 3 x 112 x 112 RGB
shards under ``horovodrun -np 2``, in the recipe's ``head.mode: local`` with cross-shard negatives: it trains
with flip augmentation, verifies on an LFW-style ``.bin`` during training, checkpoints, resumes bitwise from a
mid-run checkpoint, and exports to ONNX (the CLI's check, the dynamic batch and the embeddings against PyTorch).

The one test that trains an iresnet under real Horovod (its frozen ``features.weight``, PReLU and BatchNorm
buffers through the averaging optimizer, the broadcast and the buffer averaging before evaluation), so it
keeps two ranks; everything else is at the smallest size that still runs each part once: embedding 64
(iresnet18's 112 x 112 trunk unchanged), 2 images per rank per step, 2 steps, one resume. The kill itself
(a rank SIGKILLed right after a checkpoint: the job ends, nothing later is written, ``checkpoint.resume=auto``
goes on in the same folder, its metrics continuing) is tests/test_reliability.py's (a resnet with every random
stream, bitwise); here the resume starts from the uninterrupted run's own step-1 checkpoint (the same files a
kill after it leaves: 13 s of a third launch, 2026-12-07). Both runs are ``hvd-partialfc train`` under ONE
``horovodrun -np 2``, the one that tests/helpers_np2.py shares with other files' two-rank work (the console
script's code, one after the other in one process, as test_engines.py's cross-engine resume runs), not a
launch each."""
from __future__ import annotations

import functools
import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import helpers_np2
from conftest import build_shards, read_json_lines
from helpers_face import one_thread  # noqa: F401  (autouse fixture: the in-process export and check)

pytestmark = pytest.mark.multirank
EMB = 64


def _faces(path, classes=4, per_class=4, seed=0):
    """Smooth random RGB 'faces': a class template (low-frequency colour field) plus per-sample noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(classes, 7, 7, 3)).astype(np.uint8)
    templates = np.stack([np.asarray(Image.fromarray(t).resize((112, 112), Image.BILINEAR)) for t in small])
    y = np.repeat(np.arange(classes), per_class)
    x = np.clip(templates[y].astype(int) + rng.integers(-30, 30, size=(len(y), 112, 112, 3)), 0, 255)
    np.savez(path, images=x.astype(np.uint8), labels=y)
    return path, templates


def _bin(path, templates, pairs=10, seed=1):
    """An LFW-style .bin of ``pairs`` pairs (10: the fewest the 10-fold accuracy takes), every other one "same"."""
    from data_tools.pair_sets import write_bin
    rng = np.random.default_rng(seed)
    blobs, same = [], []
    for k in range(pairs):
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


SETS = ["model.name=iresnet18", f"model.embedding_dim={EMB}", "data.batch_size=2", "data.workers=0", "train.steps=2",
        "train.precision=fp32", "train.log_every=1", "checkpoint.every=1", "eval.every=1", "eval.batch_size=10"]


def _train_item(name, shards, out, sets):
    """``hvd-partialfc train`` of the face recipe as an item of the shared launch."""
    args = ["--config", "configs/ms1mv3_r50.yaml", "--shards", shards, "--out", out]
    for s in sets:
        args += ["--set", s]
    return {"train": name, "args": args}


def _np2_items(request, folder):
    """Both runs, items of the shared ``horovodrun -np 2`` (Gloo) launch (tests/helpers_np2.py: the console
    script's code, one after the other in one process, as test_engines.py's cross-engine resume runs), not a
    launch each: the uninterrupted run, then the one resumed from its step-1 checkpoint, each in its folder
    ``folder(NAME)/run``; the data in a folder of their own."""
    base = request.getfixturevalue("tmp_path_factory").mktemp("faces")
    npz, templates = _faces(base / "faces.npz")
    shards = build_shards(npz, base / "shards", 2)
    sets = SETS + [f"eval.pairs=[{_bin(base / 'lfw.bin', templates)}]"]
    whole = os.path.join(folder("whole"), "run")
    step1 = os.path.join(whole, "checkpoints", "step-00000001")
    return [_train_item("whole", shards, whole, sets),
            _train_item("resumed", shards, os.path.join(folder("resumed"), "run"),
                        sets + [f"checkpoint.resume={step1}"])]


NP2_PART = helpers_np2.Part("faces", fixture="runs", build=_np2_items, timeout=600)


@pytest.fixture(scope="module")
def runs(request):
    """{"whole", "resumed": (the run's folder, what both ranks printed)}, once both ranks ended both."""
    launch = helpers_np2.shared(request)
    out = {}
    for name in ("whole", "resumed"):
        folder = launch.done(name)
        out[name] = (os.path.join(folder, "run"),
                     "".join(open(os.path.join(folder, f"rank-{r}.log")).read() for r in range(2)))
    return out


def test_face_recipe_iresnet18_trains_verifies_resumes_and_exports_onnx(runs, tmp_path, capsys, monkeypatch):
    """Two steps, each checkpointed and verified on the .bin (step 1's mid-run: training goes on after it).
    A run resumed (in a folder of its own) from the uninterrupted run's step-1 checkpoint and trained to step
    2 must equal the uninterrupted run bitwise (backbone digests, both ranks' classifiers): any iresnet or
    optimizer state the checkpoint drops, or that the evaluation at step 1 disturbs outside the checkpoint
    (RNG, train mode, loader position), makes step 2 differ. Then ``export --onnx`` of the resumed run: the
    CLI's own check (on 4 samples here: 64 of iresnet18 at 112 px cost ~15 s; the default of 64 is checked in
    tests/test_init_onnx.py::test_cli_export_onnx), a dynamic batch, and embeddings equal to PyTorch's."""
    (whole, _), (resumed, said) = runs["whole"], runs["resumed"]
    step1 = os.path.join(whole, "checkpoints", "step-00000001")
    assert f"resumed from {step1} at step 1 (written by 2 ranks)" in said   # not started afresh

    cfg = json.load(open(os.path.join(whole, "checkpoints", "step-00000002", "meta.json")))["config"]
    assert cfg["model"]["name"] == "iresnet18" and cfg["data"]["augment"] == ["flip"] and cfg["eval"]["flip"]
    assert cfg["head"]["mode"] == "local" and cfg["head"]["negatives_every"] > 0   # the recipe runs the method
    evals = [r for r in read_json_lines(os.path.join(whole, "metrics.jsonl")) if "eval" in r]
    assert sorted({r["step"] for r in evals}) == [1, 2]                  # verified during training, on the .bin
    assert all(r["eval"]["pairs"] == 10 for r in evals if r["step"] == 2)
    evals = [r for r in read_json_lines(os.path.join(resumed, "metrics.jsonl")) if "eval" in r]
    assert [r["step"] for r in evals] == [2] and evals[0]["eval"]["pairs"] == 10     # the resumed part's own
    # the resumed run ends bitwise where the uninterrupted one does (backbone, both classifiers)
    ck = [os.path.join(r, "checkpoints", "step-00000002") for r in (whole, resumed)]
    metas = [json.load(open(os.path.join(c, "meta.json"))) for c in ck]
    assert metas[0]["digests"] == metas[1]["digests"]
    assert len(metas[0]["classifier_files"]) == 2
    for name in metas[0]["classifier_files"]:
        a, b = (torch.load(os.path.join(c, name), weights_only=True) for c in ck)
        assert torch.equal(a["weight"], b["weight"])

    # export --onnx of the resumed run, through the CLI's entry point (in-process: no second torch import)
    from hvd_partialfc.cli import main
    from hvd_partialfc.tools import onnx_export
    from hvd_partialfc.models.pretrained import load_backbone
    import onnxruntime as ort
    monkeypatch.setattr(onnx_export, "export_onnx", functools.partial(onnx_export.export_onnx, samples=4))
    onnx_path = tmp_path / "model.onnx"
    capsys.readouterr()
    assert main(["export", resumed, "--onnx", "--out", str(onnx_path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and info["max_abs_diff_normalised"] <= 1e-4 and info["samples"] == 4
    assert info["input"] == ["batch", 3, 112, 112] and info["bytes"] == onnx_path.stat().st_size
    assert onnx_path.stat().st_size > 10 ** 7                            # the weights inside: 12.8 M parameters
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape[0] == "batch"
    model, _ = load_backbone(resumed)
    x = np.random.default_rng(0).uniform(-1, 1, size=(3, 3, 112, 112)).astype(np.float32)
    got = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    assert got.shape == (3, EMB) and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()   # float32 rounding
    unit = [e / np.linalg.norm(e, axis=1, keepdims=True) for e in (got, want)]
    assert np.abs(unit[0] - unit[1]).max() < 1e-4
