"""Dirty encoded sets: an empty and a truncated JPEG in a set built without the decode
check. ``data.on_bad_sample: stop`` names the sample and the way out; ``skip`` trains, replaces each by the
next decodable sample of its class (the same after a resume and at any ``data.workers``), names it once
and counts it in metrics.jsonl; past ``data.max_bad_samples`` the run stops naming the shards, after its
checkpoint; ``inspect --decode`` lists them. One rank in this process (``simulate``), 64 faces of 112x112."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import read_json_lines, simulate_here

EMPTY, TRUNCATED = 5, 40           # class 0 in shard 0 (its sample 5); class 5 in shard 1 (its sample 8)
BASE = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
        "train.threads=1", "data.workers=0", "head.negatives_every=0", "train.log_every=1"]


@pytest.fixture(scope="module")
def dirty(tmp_path_factory):
    from data_tools.bench_loader import face_jpegs, write_face_shards
    blobs, _ = face_jpegs(64)
    out = str(tmp_path_factory.mktemp("dirty") / "set")
    return write_face_shards(out, 64, num_shards=2, per_class=8,
                             dirty={EMPTY: b"", TRUNCATED: bytes(blobs[TRUNCATED][:300])})


def sim(shards, out, steps, sets=(), ranks=1):
    """``steps`` steps of BASE and ``sets`` on ``ranks`` virtual ranks, in this process (conftest.simulate_here)."""
    from hvd_partialfc.config_io import load_config
    cfg = load_config(None, [*BASE, *sets, f"data.shards={shards}", f"out={out}", f"train.steps={steps}"])
    return simulate_here(cfg, ranks)


def same(a, b) -> bool:
    """Bitwise equality of nested dicts of tensors and plain values (a checkpoint's file)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_stop_names_the_sample_and_the_way_out(dirty):
    from hvd_partialfc.data.loader import RankShardDataset
    from hvd_partialfc.data.shards import ShardError
    ds = RankShardDataset(dirty, 0, 1)            # data.on_bad_sample: stop, the default
    for pos, where, why in [(EMPTY, "shard-00000-of-00002.h5: sample 5", "empty: 0 bytes"),
                            (TRUNCATED, "shard-00001-of-00002.h5: sample 8", "OSError")]:
        with pytest.raises(ShardError) as e:
            ds[[0, pos]]
        msg = str(e.value)
        assert f"rank 0: {dirty}/{where} cannot be decoded ({why}" in msg
        assert "data.on_bad_sample=skip" in msg and f"hvd-partialfc-shards inspect {dirty} --decode" in msg


def test_skip_stands_in_the_next_sample_of_the_class_on_either_decode(dirty):
    """The stand-in is the next stored sample of the same class (an independent decode of the stored bytes);
    the GPU path's workers replace the same samples (``looks_whole``), and its batch decodes to the CPU
    path's pixels (PIL standing in for nvJPEG where torchvision does not load)."""
    import h5py
    from hvd_partialfc.data.augment import BatchAugment
    from hvd_partialfc.data.device_decode import EncodedBatches, decode_batch
    from hvd_partialfc.data.loader import AugmentedBatches, RankShardDataset, prepare_batch
    from hvd_partialfc.data.shards import decode_image
    ds = RankShardDataset(dirty, 0, 1, on_bad_sample="skip")
    positions = [3, EMPTY, 12, TRUNCATED]
    batch = ds[positions]
    want = []
    for shard, i in [(0, 3), (0, 6), (0, 12), (1, 9)]:             # 5 -> 6 (class 0), 40 -> 41 (class 5)
        with h5py.File(os.path.join(dirty, f"shard-0000{shard}-of-00002.h5"), "r") as f:
            want.append(decode_image(f["encoded"][i], [112, 112, 3]))
    assert np.array_equal(batch.samples.numpy(), np.stack(want))
    assert batch.labels.tolist() == [0, 0, 1, 5]
    assert [(b.sample, b.replacement.rsplit(": ", 1)[1]) for b in batch.bad] == [(5, "sample 6"), (8, "sample 9")]
    flip = BatchAugment(["flip"], 3, 0, "encoded")
    encoded = EncodedBatches(ds, flip)[(7, positions)]
    assert [b.key for b in encoded.bad] == [b.key for b in batch.bad]
    cpu = prepare_batch(*AugmentedBatches(ds, flip)[(7, positions)], torch.device("cpu"), "encoded")
    assert torch.equal(decode_batch(encoded.samples, torch.device("cpu")), cpu[0])
    assert torch.equal(encoded.labels, cpu[1])


def test_skip_trains_counts_and_resumes_bitwise(dirty, tmp_path, capsys):
    """16 steps (2 epochs, each drawing both bad samples) uninterrupted, against the same run resumed from
    its step-4 checkpoint with 2 loader workers: the same losses at every step after the
    resume and the same final backbone, bitwise; metrics.jsonl counts 2 distinct bad samples; each is named
    once per process."""
    skip = ["data.on_bad_sample=skip", "data.max_bad_samples=0", "checkpoint.every=4", "checkpoint.keep=4"]
    one = sim(dirty, tmp_path / "one", 16, skip)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "replaced by" in ln]
    assert len(lines) == 2 and "sample 5 cannot be decoded (empty: 0 bytes); replaced by" in lines[0] + lines[1]
    recs = [r for r in read_json_lines(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    assert [r["bad_samples"] for r in recs][-1] == 2 and recs[-1]["bad_samples_replaced"] == 4
    step4 = os.path.join(str(tmp_path), "one", "checkpoints", "step-00000004")
    two = sim(dirty, tmp_path / "two", 16, skip + [f"checkpoint.resume={step4}", "data.workers=2"])
    loss = {r["step"]: r["loss"] for r in recs}
    after = {r["step"]: r["loss"] for r in read_json_lines(tmp_path / "two" / "metrics.jsonl") if "loss" in r}
    assert all(after[s] == loss[s] for s in range(5, 17))
    a, b = (torch.load(os.path.join(r.checkpoint, "backbone.pt"), weights_only=True) for r in (one, two))
    assert same(a, b)


def test_too_many_bad_samples_stop_naming_the_shards(dirty, tmp_path):
    """Two ranks, one bad sample each, max_bad_samples=1: each rank draws its own in its first epoch (4
    steps), so the log step 4 agrees on 2 > 1 and the run stops, naming both ranks' shards, after writing
    step 4's checkpoint. A fraction counts against the set's 64 samples."""
    from hvd_partialfc.engine.local import LocalComm
    from hvd_partialfc.run.watch.sample_watch import SampleWatch
    from hvd_partialfc.run.simulate import SimFailure
    run = tmp_path / "run"
    with pytest.raises(SimFailure) as e:
        sim(dirty, run, 16, ["data.on_bad_sample=skip", "data.max_bad_samples=1", "train.log_every=4"], ranks=2)
    msg = str(e.value.error)
    assert type(e.value.error).__name__ == "ShardError" and msg.startswith("step 4: 2 distinct samples")
    for shard in ("rank 0: {}/shard-00000-of-00002.h5 (1)", "rank 1: {}/shard-00001-of-00002.h5 (1)"):
        assert shard.format(dirty) in msg
    assert os.path.isdir(run / "checkpoints" / "step-00000004") and "checkpoint" in msg
    for fraction, stops in [(0.02, True), (0.05, False)]:           # 1.28 and 3.2 of 64 samples
        watch = SampleWatch("skip", fraction, 64)
        watch.found = {("a", 1): "", ("b", 2): ""}
        assert watch.agree(LocalComm())["bad_samples"] == 2 and bool(watch.error) == stops


def test_inspect_decode_lists_them_with_the_rebuild(dirty, capsys):
    from data_tools.shards_cli import main
    capsys.readouterr()
    assert main(["inspect", dirty, "--decode", "--workers", "2", "--no-sha256", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    got = [(r["file"], r["sample"], r["label"], r["bytes"]) for r in info["undecodable"]]
    assert got == [("shard-00000-of-00002.h5", 5, 0, 0), ("shard-00001-of-00002.h5", 8, 5, 300)]
    assert info["undecodable"][0]["reason"] == "empty: 0 bytes"
    assert main(["inspect", dirty, "--decode", "--workers", "1", "--no-sha256"]) == 1
    out = capsys.readouterr().out
    assert "2 of the 64 samples cannot be decoded" in out and "shard-00001-of-00002.h5: sample 8 (label 5" in out
    assert "--on-error skip" in out and "data.on_bad_sample=skip" in out
