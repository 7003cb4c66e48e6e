"""checkpoint.allow_other_data goes on with other samples of the same classes only: a relabelled set of the
same size (same class count, shard ranges and per-class counts) is refused, where the old check (count and
ranges) let its classifier rows name other classes. Runs ``hvd-partialfc simulate --ranks 2`` in this
process on 8 classes of 16-d features; every case resumes a copy of one 2-step run."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import build_shards, simulate_cli
from hvd_partialfc.data import class_identity
from hvd_partialfc.data.shards import MANIFEST, data_digest, read_manifest

SETS = ["model.name=mlp", "model.embedding_dim=8", "model.kwargs={hidden_dim: 8}", "data.batch_size=8",
        "data.workers=0", "train.threads=1", "checkpoint.every=1", "head.negatives_every=0"]
CLASSES, PER_CLASS = 8, 8


def _npz(path, labels, shift_rest=0.0, names=None):
    """8 classes x 8 samples of features sorted by class; ``shift_rest`` moves every sample but each class's
    first two (which the class identity hashes); ``labels`` may relabel them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(CLASSES * PER_CLASS, 16)).astype(np.float32)
    rest = np.arange(len(x)) % PER_CLASS >= class_identity.FIRST_SAMPLES
    x[rest] += np.float32(shift_rest)
    extra = {} if names is None else {"class_names": np.array(names)}
    np.savez(path, features=x, labels=np.asarray(labels), **extra)
    return path


def _run(capsys, shards, out, steps, sets=()):
    """``simulate --ranks 2`` here with this file's settings; exit code and output."""
    return simulate_cli(capsys, 2, shards, out, SETS + list(sets), steps)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The set (labels 0 ... 7, no names) and a run of 2 steps on it."""
    d = tmp_path_factory.mktemp("classid")
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    shards = build_shards(_npz(d / "a.npz", labels), d / "a", 2)
    assert _run(None, shards, d / "run", 2)[0] == 0
    return d, shards, labels


def _resume(capsys, trained, tmp_path, shards, edit_meta=None, allow=True):
    """Resume a copy of the trained run on ``shards`` for one step, with checkpoint.allow_other_data."""
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(trained[0] / "run", run)
    if edit_meta:
        path = run / "checkpoints" / "step-00000002" / "meta.json"
        meta = json.loads(path.read_text())
        edit_meta(meta)
        path.write_text(json.dumps(meta))
    return _run(capsys, shards, run, 3, ["checkpoint.resume=auto", f"checkpoint.allow_other_data={allow}"])


def test_relabelled_set_of_the_same_size_is_refused(trained, tmp_path, capsys):
    # classes swapped in pairs inside each shard's range: the same count, ranges and per-class counts
    _, _, labels = trained
    relabelled = build_shards(_npz(tmp_path / "r.npz", np.array([1, 0, 3, 2, 5, 4, 7, 6])[labels]),
                              tmp_path / "r", 2)
    assert read_manifest(relabelled).class_identity["counts_sha256"] == \
        read_manifest(trained[1]).class_identity["counts_sha256"]
    for allow in (True, False):     # without the flag, resume says why, not to set it
        rc, text = _resume(capsys, trained, tmp_path, relabelled, allow=allow)
        assert rc != 0 and "and so do its classes' first samples" in text and "0 ... C-1" in text, text[-2000:]
        assert not (tmp_path / "run" / "checkpoints" / "step-00000003").exists()


def test_other_samples_of_the_same_classes_resume(trained, tmp_path, capsys):
    # each class's first samples kept, the others moved: other data, the same classes
    _, first, labels = trained
    other = build_shards(_npz(tmp_path / "o.npz", labels, shift_rest=0.25), tmp_path / "o", 2)
    assert data_digest(read_manifest(other)) != data_digest(read_manifest(first))
    rc, text = _resume(capsys, trained, tmp_path, other)
    assert rc == 0 and "going on with these samples" in text and "warning" not in text, text[-2000:]
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-00000003" / "meta.json").read_text())
    assert meta["class_identity"] == class_identity.of_run(read_manifest(other))


def test_checkpoint_without_class_identity_resumes_with_a_warning(trained, tmp_path, capsys):
    # a checkpoint written before the identity was recorded: resume cannot check it, says so, goes on
    _, _, labels = trained
    relabelled = build_shards(_npz(tmp_path / "r.npz", np.array([1, 0, 3, 2, 5, 4, 7, 6])[labels]),
                              tmp_path / "r", 2)
    rc, text = _resume(capsys, trained, tmp_path, relabelled, edit_meta=lambda m: m.pop("class_identity"))
    assert rc == 0 and "cannot be checked: the checkpoint records no class identity" in text, text[-2000:]


def test_named_classes_decide_by_name(tmp_path):
    # names that are names decide: another name differs; the same names with other counts are a cleaned set
    labels = np.repeat(np.arange(4), 3)
    names = ["ada", "bo", "cy", "di"]
    sets = {}
    for key, lab, nm in (("a", labels, names), ("renamed", labels, ["ada", "bo", "cy", "ed"]),
                         ("cleaned", labels[1:], names)):
        x = np.zeros((len(lab), 4), np.float32) + np.arange(len(lab))[:, None]
        np.savez(tmp_path / f"{key}.npz", features=x, labels=lab, class_names=np.array(nm))
        m = read_manifest(build_shards(tmp_path / f"{key}.npz", tmp_path / key, 2))
        sets[key] = class_identity.of_run(m)
    assert sets["a"]["numeric_names"] is False
    assert class_identity.compare(sets["a"], sets["renamed"])[0] == ["its class names"]
    assert class_identity.compare(sets["a"], sets["cleaned"]) == ([], [], ["its per-class sample counts"])
    assert class_identity.compare(sets["a"], sets["a"]) == ([], [], [])


def test_manifest_identity_is_left_out_of_the_data_digest(trained):
    # a set rebuilt with the new manifest key still resumes checkpoints of its build without it
    m = read_manifest(trained[1])
    assert m.class_identity
    with open(os.path.join(trained[1], MANIFEST)) as f:
        d = json.load(f)
    d.pop("class_identity")
    from hvd_partialfc.data.shards import Manifest
    assert data_digest(Manifest.from_json(d)) == data_digest(m)
