"""data.augment: off by default (bitwise the batches as read), flip flips about half and keeps labels,
each operation does what it says, unknown names are config errors, and the randomness depends on
(seed, rank, batch index) only: not on the number of workers, nor on where the stream was resumed."""
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from hvd_partialfc.data.augment import AUGMENTATIONS, BatchAugment, parse_augment
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.data.loader import RankShardDataset, make_loader
from hvd_partialfc.data.partition import even_slices
from hvd_partialfc.seeds import derive_seed
from data_tools.shard_writer import write_shard_set

ALL = ["flip", "lowres:p=0.5", "blur:p=0.5", "jitter:p=0.5", "gray:p=0.3"]


def _rgb(n, size=24, seed=0):
    """Smooth random colour images (not mirror-symmetric)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (n, 4, 4, 3)).astype(np.uint8)
    return np.stack([np.asarray(Image.fromarray(s).resize((size, size), Image.BICUBIC)) for s in small])


@pytest.fixture(scope="module")
def rgb_shards(tmp_path_factory):
    """8 classes x 12 RGB 24x24 images, raw and JPEG-encoded, 2 shards each."""
    d = tmp_path_factory.mktemp("aug")
    x, y = _rgb(96), np.repeat(np.arange(8), 12)
    raw = str(d / "raw")
    write_shard_set(raw, "images", x, y, even_slices(8, 2), 8)
    blobs = []
    for img in x:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        blobs.append(np.frombuffer(buf.getvalue(), np.uint8))
    enc = str(d / "enc")
    write_shard_set(enc, "encoded", blobs, y, even_slices(8, 2), 8, sample_shape=[24, 24, 3])
    return raw, enc


def _batches(shards, n, augment=(), workers=0, start=0, rank=0, seed=5, batch=8):
    ds = RankShardDataset(shards, rank, 2)
    loader, _ = make_loader(ds, batch, seed, workers=workers, start=start, augment=augment)
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it, loader
    return out


def test_off_by_default_bitwise_the_rows_read(rgb_shards):
    raw, _ = rgb_shards
    ds = RankShardDataset(raw, 1, 2)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(derive_seed(5, 1, 0)))
    for k, (x, y) in enumerate(_batches(raw, 6, rank=1)):          # 48 samples: exactly one epoch
        x0, y0 = ds[perm[8 * k:8 * k + 8].tolist()]
        assert x.dtype == torch.uint8 and torch.equal(x, x0) and torch.equal(y, y0)
    assert load_config(None, ["data.shards=/x"]).data.augment == []


def test_flip_flips_about_half_and_keeps_labels(rgb_shards):
    raw, _ = rgb_shards
    plain, flipped = _batches(raw, 40), _batches(raw, 40, augment=["flip"])
    n_flipped = 0
    for (x0, y0), (x1, y1) in zip(plain, flipped):
        assert torch.equal(y0, y1)
        mirror = torch.flip(x0, dims=[2])                          # (B, H, W, C): W is dim 2
        same = (x1 == x0).flatten(1).all(1)
        mirrored = (x1 == mirror).flatten(1).all(1)
        assert bool((same | mirrored).all())                       # each sample: itself or its mirror
        n_flipped += int((mirrored & ~same).sum())
    assert 0.4 < n_flipped / 320 < 0.6                             # p = 0.5; sd of the fraction 0.028


@pytest.mark.parametrize("spec,match", [("mirror", "unknown augmentation 'mirror'; known: flip, lowres"),
                                        ("flip:q=1", "unknown parameter 'q' of flip"),
                                        ("flip:p=2", "out of range"), ("lowres:min_scale=x", "not a number")])
def test_unknown_names_are_config_errors(spec, match):
    # the config is plain data: the names are checked against the registry before the first step
    from hvd_partialfc.run.startup import check_runtime_options
    with pytest.raises(ConfigError, match=match):
        check_runtime_options(load_config(None, ["data.shards=/x", f"data.augment=['{spec}']"]), "images")


def test_features_cannot_be_augmented():
    with pytest.raises(ValueError, match="needs image samples"):
        parse_augment(["flip"], kind="features")


@pytest.mark.parametrize("shards", ["raw", "enc"])
def test_randomness_independent_of_workers_and_resume(rgb_shards, shards):
    d = dict(zip(["raw", "enc"], rgb_shards))[shards]
    ref = _batches(d, 10, augment=ALL, workers=0)
    plain = _batches(d, 10)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(ref, plain))   # it did augment
    for workers, start in ((2, 0), (1, 4), (0, 7)):
        got = _batches(d, 10 - start, augment=ALL, workers=workers, start=start)
        for (x0, y0), (x1, y1) in zip(ref[start:], got):
            assert torch.equal(x0, x1) and torch.equal(y0, y1), (workers, start)
    torch.manual_seed(123)                                          # torch's global stream plays no part
    again = _batches(d, 3, augment=ALL, workers=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref, again))


def test_streams_differ_by_rank_and_batch():
    x = _rgb(64)
    a = BatchAugment(["flip"], seed=1, rank=0)
    flips = lambda out: (out != x).reshape(64, -1).any(1)          # noqa: E731
    assert np.array_equal(a(3, x), a(3, x))
    assert not np.array_equal(flips(a(3, x)), flips(a(4, x)))
    assert not np.array_equal(flips(a(3, x)), flips(BatchAugment(["flip"], seed=1, rank=1)(3, x)))
    assert np.array_equal(a(10_007, x), a(10_007, x)) and \
        not np.array_equal(flips(a(10_007, x)), flips(BatchAugment(["flip"], seed=1, rank=1)(0, x)))


def test_each_operation_against_an_independent_computation():
    x = _rgb(16, size=32, seed=3)
    # gray: BT.601 luminance in every channel; PIL's convert("L") rounds in fixed point (off by <= 1)
    g = BatchAugment(["gray:p=1"], 0, 0)(0, x).astype(int)
    luma = np.stack([np.asarray(Image.fromarray(i).convert("L")) for i in x]).astype(int)
    assert all(np.abs(g[..., c] - luma).max() <= 1 for c in range(3))
    # jitter with every factor range 0: the identity; brightness only: a per-image constant ratio
    assert np.array_equal(BatchAugment(["jitter:p=1,brightness=0,contrast=0,saturation=0"], 0, 0)(0, x), x)
    b = BatchAugment(["jitter:p=1,brightness=0.3,contrast=0,saturation=0"], 0, 0)(0, x).astype(float)
    for i in range(16):
        keep = (x[i] > 40) & (b[i] < 250)
        ratio = b[i][keep] / x[i][keep]
        assert abs(ratio.mean() - 1) > 1e-3 and np.ptp(ratio) < 0.06 and 0.69 < ratio.mean() < 1.31
    # lowres at scale 0.5 exactly: PIL's down- then up-sampling of each image
    lo = BatchAugment(["lowres:p=1,min_scale=0.5,max_scale=0.5"], 0, 0)(0, x)
    want = np.stack([np.asarray(Image.fromarray(i).resize((16, 16), Image.BILINEAR).resize((32, 32), Image.BILINEAR))
                     for i in x])
    assert np.array_equal(lo, want)
    # blur: PIL's Gaussian blur, the sigma in [min, max]: smoother than the input, sharper than sigma 2
    bl = BatchAugment(["blur:p=1"], 0, 0)(0, x).astype(float)
    tv = lambda a: np.abs(np.diff(a.astype(float), axis=1)).mean()    # noqa: E731
    strong = np.asarray(Image.fromarray(x[0]).filter(ImageFilter.GaussianBlur(2)))
    assert tv(strong) < tv(bl[0]) < tv(x[0])
    # p = 0: untouched, for every operation; grayscale (H, W) images pass through every operation
    for name in AUGMENTATIONS:
        assert np.array_equal(BatchAugment([f"{name}:p=0"], 0, 0)(0, x), x)
        out = BatchAugment([f"{name}:p=1"], 0, 0)(0, x[..., 0])
        assert out.shape == x[..., 0].shape and out.dtype == np.uint8


def test_faces_bench_writes_its_table_without_machine_paths(tmp_path):
    import json
    from data_tools.bench_loader import run_faces
    run_faces(str(tmp_path / "out"), 384, 4)   # 4 batches: psutil counts CPU time in 10 ms ticks
    text = open(tmp_path / "out" / "faces_loader.json").read()
    res = json.loads(text)
    assert [(r["augment"], r["workers"]) for r in res["loader"]] == \
        [(a, w) for a in ("none", "flip", "all") for w in (0, 1, 2)]
    assert all(r["samples_per_s"] > 0 and r["samples_per_cpu_s"] > 0 for r in res["loader"])
    for aug, need in res["workers_needed"].items():   # ceil(target / per-worker rate)
        assert need["10000"] == int(np.ceil(10000 / res["per_worker_samples_per_s"][aug]))
    assert str(tmp_path) not in text and "/tmp" not in text and res["sample_shape"] == [112, 112, 3]
