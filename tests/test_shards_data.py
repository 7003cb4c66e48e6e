"""Shard format and the dedicated per-rank loader (plain pytest, no Horovod)."""
import json
import os
import re

import h5py
import numpy as np
import pytest
import torch

from conftest import build_shards, make_feature_npz, make_image_npz
from data_tools.shards_cli import main as shards_main
from hvd_partialfc.data.loader import EpochBatchSampler, RankShardDataset, make_loader, prepare_batch
from hvd_partialfc.data.shards import ShardError, check_shard_file, rank_layout, read_manifest


@pytest.fixture
def four_shards(tmp_path):
    counts = [10] * 7 + [30] * 5        # 12 classes, uneven samples
    return build_shards(make_feature_npz(tmp_path / "f.npz", counts), tmp_path / "s", 4)


def test_rank_reads_only_its_block_of_shards(four_shards):
    m = read_manifest(four_shards)
    for world in (1, 2, 4):
        seen = []
        for r in range(world):
            ds = RankShardDataset(four_shards, r, world, m)
            layout = rank_layout(m, world)
            idx, sl = layout.shard_blocks[r], layout.slices[r]
            assert len(idx) == 4 // world
            x, y = ds[list(range(len(ds)))]
            glob = ds.labels
            assert glob.min() >= sl.start and glob.max() < sl.end   # only its own classes
            assert torch.equal(y, torch.from_numpy(glob - sl.start))  # local labels
            seen.append(sl)
        assert [s.start for s in seen][0] == 0 and seen[-1].end == 12


def test_world_size_at_most_the_shard_count(four_shards):
    with pytest.raises(ShardError, match="maximum world size is 4"):
        RankShardDataset(four_shards, 0, 5)


def test_label_outside_slice_names_file_and_rank(four_shards):
    m = read_manifest(four_shards)
    path = os.path.join(four_shards, m.shards[1].file)
    with h5py.File(path, "r+") as f:
        y = f["labels"][:]
        y[2] = 0  # a label of shard 0 inside shard 1
        f["labels"][:] = y
    with pytest.raises(ShardError, match=r"rank 1: .*shard-00001-of-00004.h5 holds label 0"):
        RankShardDataset(four_shards, 1, 4)
    with pytest.raises(ShardError, match="outside the shard's range"):
        check_shard_file(four_shards, m, 1)


def test_sha256_mismatch_detected(four_shards):
    m = read_manifest(four_shards)
    path = os.path.join(four_shards, m.shards[0].file)
    with h5py.File(path, "r+") as f:
        f["features"][0, 0] += 1
    with pytest.raises(ShardError, match="sha256"):
        check_shard_file(four_shards, m, 0, verify_sha256=True)


def test_content_digest_is_of_the_arrays_not_the_encoding(four_shards, tmp_path):
    # the same arrays written with another layout (chunked, compressed): other bytes, the same content digest;
    # one value changed: another content digest
    from hvd_partialfc.data.shards import sha256_content, sha256_file
    src = os.path.join(four_shards, read_manifest(four_shards).shards[0].file)
    copy = str(tmp_path / "copy.h5")
    with h5py.File(src, "r") as f, h5py.File(copy, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        for name in sorted(f, reverse=True):
            g.create_dataset(name, data=f[name][:], chunks=True, compression="gzip")
    assert sha256_file(copy) != sha256_file(src)
    assert sha256_content(copy) == sha256_content(src)
    with h5py.File(copy, "r+") as g:
        g["features"][3, 1] += 1
    assert sha256_content(copy) != sha256_content(src)


def test_content_digest_sees_the_middle_of_every_encoded_sample(tmp_path):
    # two encoded shards whose samples (3,000 bytes each) differ only in their middle byte: other digests (the
    # repr of an array over 1,000 elements, which the digest hashed before, shows its first and last three)
    from data_tools.shard_writer import write_shard
    from hvd_partialfc.data.partition import LabelSlice
    from hvd_partialfc.data.shards import sha256_content
    blobs = [np.random.default_rng(k).integers(0, 256, 3000, dtype=np.uint8) for k in range(4)]
    other = [b.copy() for b in blobs]
    for b in other:
        b[1500] ^= 1
    paths = [str(tmp_path / f"{name}.h5") for name in ("a", "b")]
    for path, samples in zip(paths, (blobs, other)):
        write_shard(path, "encoded", samples, np.arange(4), LabelSlice(0, 0, 4), 1, sample_shape=[8, 8])
    assert sha256_content(paths[0]) != sha256_content(paths[1])


def test_content_digest_of_arrays_and_strings_is_the_one_recorded_before(tmp_path):
    # raw images, labels, pairs, flags, variable-length strings: the digest the previous version gave (so the
    # scale study's kept cells, which record it, still match their data)
    from hvd_partialfc.data.shards import sha256_content
    path = str(tmp_path / "p.h5")
    i = np.arange(5 * 40 * 40, dtype=np.int64)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=((i * 2654435761) % 251).astype(np.uint8).reshape(5, 40, 40))
        f.create_dataset("labels", data=np.arange(5, dtype=np.int64) * 3)
        f.create_dataset("pairs", data=np.arange(10, dtype=np.int64).reshape(5, 2))
        f.create_dataset("same", data=np.arange(5) % 2 == 0)
        f.create_dataset("names", data=[f"class {k} \u00fcn\u00ef" for k in range(1500)], dtype=h5py.string_dtype())
        f.create_dataset("group/features", data=(np.arange(1200, dtype=np.float32) / 7).reshape(3, 400))
    assert sha256_content(path) == "afcdf818ea91bbe9327696e84ddb0bc8e8a18db042c2cf438de5c76b76741ea0"


INSPECT = ("copy the set again or rebuild it with `hvd-partialfc-shards build`; "
           "check it with `hvd-partialfc-shards inspect ")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_shard_names_rank_file_and_command(four_shards, damage, capsys):
    m = read_manifest(four_shards)
    path = os.path.join(four_shards, m.shards[1].file)
    data = open(path, "rb").read()
    ok = RankShardDataset(four_shards, 1, 4)                  # opened before the damage (a long run)
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    expected = (re.escape(f"rank 1: {path}: cannot open shard file (h5py: ") + ".*"
                + re.escape(f"); the file is truncated or not HDF5; {INSPECT}{four_shards}`"))
    with pytest.raises(ShardError, match=f"^{expected}$"):
        RankShardDataset(four_shards, 1, 4)                   # at start-up
    with pytest.raises(ShardError, match=f"^{expected}$"):
        ok[[0, 1]]                                            # in a reader (a DataLoader worker) afterwards
    with pytest.raises(ShardError, match=f"^{re.escape(path)}: cannot open shard file"):
        check_shard_file(four_shards, m, 1)
    RankShardDataset(four_shards, 0, 4)                       # the other ranks' files are not involved
    assert shards_main(["inspect", four_shards]) == 2
    err = capsys.readouterr().err
    assert f"{path}: cannot open shard file" in err and "Traceback" not in err


def test_missing_shard_names_rank_and_file(four_shards):
    path = os.path.join(four_shards, "shard-00002-of-00004.h5")
    os.unlink(path)
    with pytest.raises(ShardError, match=f"^{re.escape(f'rank 1: {path}: missing shard file; {INSPECT}')}"):
        RankShardDataset(four_shards, 1, 2)


def test_manifest_errors_name_the_file_and_what_to_do(tmp_path, four_shards):
    path = os.path.join(four_shards, "manifest.json")
    text = open(path).read()
    for content, says in [(text[:len(text) // 2], "not valid JSON"), (b"\x89HDF\xff\xfe", "not valid JSON"),
                          ("[1, 2]", "not a hvd_partialfc shard manifest (a JSON list, not an object)"),
                          (text.replace('"num_classes"', '"classes"'), "malformed manifest (KeyError: 'num_classes')"),
                          (text.replace('"num_classes": 12', '"num_classes": "twelve"'), "malformed manifest (ValueError")]:
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ShardError) as err:
            read_manifest(four_shards)
        assert str(err.value).startswith(f"{path}: {says}") and f"{INSPECT}{four_shards}`" in str(err.value)
    os.unlink(path)
    with pytest.raises(ShardError, match=f"^{re.escape(four_shards)}: no manifest.json .*`hvd-partialfc-shards build`"):
        read_manifest(four_shards)


def test_manifest_must_be_complete(tmp_path, four_shards):
    with pytest.raises(ShardError, match="no manifest.json"):
        read_manifest(str(tmp_path))
    d = json.load(open(os.path.join(four_shards, "manifest.json")))
    d["shards"][1]["label_start"] += 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ShardError, match="gap or overlap"):
        read_manifest(str(bad))


def test_sampler_is_seeded_per_rank_and_resumable():
    a = EpochBatchSampler(50, 8, seed=1, rank=0)
    b = EpochBatchSampler(50, 8, seed=1, rank=1)
    ia, ib = iter(a), iter(b)
    first_a = [next(ia) for _ in range(20)]   # 6 batches per epoch: crosses epochs
    again = iter(EpochBatchSampler(50, 8, seed=1, rank=0))
    assert [next(again) for _ in range(20)] == first_a             # reproducible
    assert first_a[0] != next(ib)
    resumed = iter(EpochBatchSampler(50, 8, seed=1, rank=0, start=13))
    assert [next(resumed) for _ in range(7)] == first_a[13:]
    epoch0 = sorted(i for b in first_a[:6] for i in b)
    assert len(set(epoch0)) == 48  # no repeats inside an epoch (2 dropped)


def test_loader_with_workers_matches_no_workers(tmp_path):
    shards = build_shards(make_image_npz(tmp_path / "i.npz", 6, 20), tmp_path / "s", 2)
    ds = RankShardDataset(shards, 1, 2)
    l0, spe = make_loader(ds, 8, seed=5, workers=0)
    l2, _ = make_loader(RankShardDataset(shards, 1, 2), 8, seed=5, workers=2)
    for (x0, y0), (x2, y2), _ in zip(l0, l2, range(5)):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
        assert x0.dtype == torch.uint8 and x0.shape == (8, 32, 32)
    assert spe == 60 // 8
    x, y = prepare_batch(x0, y0, torch.device("cpu"), "images")
    assert x.shape == (8, 1, 32, 32) and x.min() >= -1 and x.max() <= 1
