"""``--init-backbone`` (arcface_torch and exported files, not re-applied on resume) and
``export --onnx`` (checked against PyTorch with onnxruntime, nothing written when the check fails).

The training runs are ``hvd-partialfc simulate --ranks 1`` through the CLI's entry point in this process
(``train``'s options and its start-up, ``run/startup.py``, without a second torch import; nothing here
needs Horovod). iresnet18's ONNX export through the CLI is in tests/test_faces_e2e.py (from its 2-rank
face run); here the CLI path runs on the mlp."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random

import numpy as np
import pytest
import torch

from conftest import build_shards
from helpers_face import one_thread  # noqa: F401  (autouse fixture)
from helpers_face import iresnet_table, mbf_table, random_state
from hvd_partialfc.cli import main
from hvd_partialfc.models.pretrained import load_backbone
from hvd_partialfc.tools.export import ExportError, export_backbone
from hvd_partialfc.models import create_model, list_models, model_input_shape
from hvd_partialfc.tools.onnx_export import export_onnx
from hvd_partialfc.models.pretrained import InitBackboneError, load_initial_backbone

EMB = 64
TRAIN = ["--steps", "1", "--set", "model.name=iresnet18", "--set", f"model.embedding_dim={EMB}",
         "--set", "optim.backbone_lr=0.0", "--set", "data.batch_size=4", "--set", "head.negatives_every=0",
         "--set", "train.threads=1"]
# iresnet18: exported through the CLI in tests/test_faces_e2e.py; the other iresnets: the same code at more
# depth; mlp: through the CLI in test_cli_export_onnx below
NOT_HERE = {"iresnet18", "iresnet34", "iresnet50", "iresnet100", "iresnet200", "iresnet2060", "mlp",
            # the ViTs: vit_t's code at other widths and depths
            "vit_t_dp005_mask0", "vit_s", "vit_s_dp005_mask_0", "vit_b", "vit_b_dp005_mask_005", "vit_l_dp005_mask_005",
            "vit_h"}
SMALL = {"mobilefacenet": ([112, 112, 3], {"scale": 1, "blocks": [1, 1, 1, 1]}), "resnet": ([32, 32], {}),
         "resnet18": ([32, 32, 3], {"width": 16}), "vit_t": ([112, 112, 3], {"depth": 1})}


def _simulate(*args):
    """``hvd-partialfc simulate --ranks 1 ARGS`` in this process; its printed output. The torch thread count
    and the random streams are put back after (the run sets them)."""
    threads, rngs = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(["simulate", "--ranks", "1", *map(str, args)])
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rngs[0]), np.random.set_state(rngs[1]), random.setstate(rngs[2])
    assert rc == 0, f"simulate {args} exited {rc}\n{out.getvalue()[-5000:]}"
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """World size 1: 1 step of iresnet18 (D=64) from an arcface_torch-format file, backbone lr 0, on 16
    random 112x112x3 images of 4 classes."""
    d = tmp_path_factory.mktemp("init")
    rng = np.random.default_rng(0)
    np.savez(d / "faces.npz", images=rng.integers(0, 256, (16, 112, 112, 3)).astype(np.uint8),
             labels=np.repeat(np.arange(4), 4))
    shards = build_shards(d / "faces.npz", d / "shards", 1)
    state = random_state(iresnet_table((2, 2, 2, 2), EMB), seed=1)
    torch.save(state, d / "backbone.pth")
    log = _simulate("--shards", shards, "--out", d / "run", "--init-backbone", d / "backbone.pth", *TRAIN)
    return {"dir": d, "shards": shards, "state": state, "run": str(d / "run"), "log": log}


def _backbone(ckpt_dir):
    return torch.load(os.path.join(ckpt_dir, "backbone.pt"), weights_only=True)["state_dict"]


def test_init_backbone_from_arcface_state_dict(run):
    """After one step at backbone lr 0 every parameter is the file's, bitwise, and every BatchNorm counted one
    more batch: a run that ignored the file would hold its own random initialisation."""
    assert "backbone initialised from" in run["log"]
    trained = _backbone(os.path.join(run["run"], "checkpoints", "step-00000001"))
    params = dict(create_model("iresnet18", in_shape=[112, 112, 3], embedding_dim=EMB).named_parameters())
    assert set(trained) == set(run["state"])
    for key, value in run["state"].items():
        if key in params:
            assert torch.equal(trained[key], value), key
        elif key.endswith("num_batches_tracked"):
            assert int(trained[key]) == int(value) + 1, key
    changed = [k for k in run["state"] if k.endswith("running_mean") and not torch.equal(trained[k], run["state"][k])]
    assert changed   # the step ran in training mode


def test_resume_does_not_reapply_the_init_file(run):
    """The init file is gone; resuming (and extending to 2 steps) reads only the checkpoint. The resumed
    step checkpoints activations (a key free to change on resume): its BatchNorms count the batch once."""
    moved = run["dir"] / "moved.pth"
    os.replace(run["dir"] / "backbone.pth", moved)
    try:
        log = _simulate("--shards", run["shards"], "--out", run["run"], "--resume", "auto",
                        "--init-backbone", run["dir"] / "backbone.pth", *TRAIN[:1], "2", *TRAIN[2:],
                        "--set", "model.checkpoint_activations=true")
    finally:
        os.replace(moved, run["dir"] / "backbone.pth")
    assert "backbone initialised" not in log and "resumed from" in log
    step2 = _backbone(os.path.join(run["run"], "checkpoints", "step-00000002"))
    assert int(step2["bn1.num_batches_tracked"]) == int(run["state"]["bn1.num_batches_tracked"]) + 2
    assert torch.equal(step2["fc.weight"], run["state"]["fc.weight"])


def _mlp_with_statistics(embedding_dim=32):
    """An mlp whose BatchNorm statistics are not 0 / 1 (one training-mode forward)."""
    torch.manual_seed(0)
    model = create_model("mlp", in_shape=[16], embedding_dim=embedding_dim)
    with torch.no_grad():
        model.train()(torch.rand(8, 16) * 2 - 1)
    return model.eval()


def test_cli_export_onnx(tmp_path, capsys):
    """``export FILE --onnx`` through the CLI (an exported mlp backbone file): the JSON it prints (the check's
    difference on its default 64 samples, the input with a dynamic batch), the file it wrote, and
    onnxruntime's embeddings at another batch size equal to PyTorch's."""
    model = _mlp_with_statistics()
    m = {"name": "mlp", "in_shape": [16], "embedding_dim": 32, "kwargs": {}}
    torch.save({"format": "hvd_partialfc.exported_backbone", "model": m, "state_dict": model.state_dict()},
               tmp_path / "mlp.pt")
    out = tmp_path / "model.onnx"
    assert main(["export", str(tmp_path / "mlp.pt"), "--onnx", "--out", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print(f"\nmlp (via the CLI): max abs diff of L2-normalised embeddings {info['max_abs_diff_normalised']:.3g}")
    assert info["max_abs_diff_normalised"] <= 1e-4 and info["samples"] == 64 and info["input"] == ["batch", 16]
    assert info["model"] == m and info["bytes"] == os.path.getsize(out)
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[0] == "batch"
    loaded, _ = load_backbone(str(tmp_path / "mlp.pt"))
    x = torch.rand(3, 16) * 2 - 1
    got = session.run(["embedding"], {"input": x.numpy()})[0]
    with torch.no_grad():
        want = torch.nn.functional.normalize(loaded(x), dim=1).numpy()
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    assert np.abs(got - want).max() < 1e-4


def test_every_backbone_is_covered():
    assert set(SMALL) | NOT_HERE == set(list_models())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_onnx_export_of_each_backbone(name, tmp_path):
    """Each backbone's graph exports and agrees with PyTorch, checked on 8 samples (the dynamic batch: traced
    at 2); the CLI's default of 64 is test_cli_export_onnx's."""
    in_shape, kwargs = SMALL[name]
    torch.manual_seed(0)
    model = create_model(name, in_shape=in_shape, embedding_dim=32, **kwargs)
    with torch.no_grad():
        model.train()(torch.rand(8, *model_input_shape(in_shape)) * 2 - 1)   # BatchNorm statistics not 0 / 1
    info = export_onnx(model, in_shape, str(tmp_path / f"{name}.onnx"), samples=8)
    print(f"{name}: max abs diff of L2-normalised embeddings {info['max_abs_diff_normalised']:.3g}")
    assert 0 <= info["max_abs_diff_normalised"] <= 1e-4 and os.path.getsize(tmp_path / f"{name}.onnx") == info["bytes"]
    assert info["samples"] == 8


def test_failed_check_leaves_no_file(tmp_path):
    model = create_model("mlp", in_shape=[16], embedding_dim=8)
    with pytest.raises(ExportError, match="not written"):
        export_onnx(model, [16], str(tmp_path / "m.onnx"), tolerance=-1.0)
    assert os.listdir(tmp_path) == []


def test_init_errors_name_the_file_and_the_keys(tmp_path):
    model = create_model("mobilefacenet", in_shape=[112, 112, 3], embedding_dim=16)
    args = {"name": "mobilefacenet", "embedding_dim": 16}
    state = random_state(mbf_table(16))
    state["extra.weight"] = state.pop("conv_sep.layers.0.weight")
    state["features.layers.2.weight"] = torch.zeros(8, 512)
    torch.save(state, tmp_path / "mbf.pth")
    with pytest.raises(InitBackboneError) as err:
        load_initial_backbone(model, str(tmp_path / "mbf.pth"), args)
    msg = str(err.value)
    assert str(tmp_path / "mbf.pth") in msg and "1 missing keys: conv_sep.layers.0.weight" in msg
    assert "1 unexpected keys: extra.weight" in msg and "features.layers.2.weight [8, 512] != [16, 512]" in msg


def test_init_from_an_exported_backbone(run, tmp_path):
    """The package's own format: the exported file's weights land in a fresh model; another backbone
    name or embedding size is refused, naming the file."""
    out = str(tmp_path / "exported.pt")
    export_backbone(run["run"], out)
    exported = torch.load(out, weights_only=True)["state_dict"]
    model = create_model("iresnet18", in_shape=[112, 112, 3], embedding_dim=EMB)
    load_initial_backbone(model, out, {"name": "iresnet18", "embedding_dim": EMB})
    assert all(torch.equal(v, exported[k]) for k, v in model.state_dict().items())
    with pytest.raises(InitBackboneError, match="exported.pt: a iresnet18 backbone with embedding_dim 64"):
        load_initial_backbone(model, out, {"name": "iresnet18", "embedding_dim": 128})
