"""data_tools: every importer on small real inputs, storage modes, balance, determinism, atomic builds, bad
inputs, inspect (--plot) and verification pairs (.h5 and LFW-style .bin). Plain pytest, CPU, seconds."""
from __future__ import annotations

import io
import os
import struct

import h5py
import numpy as np
import pytest
from PIL import Image

from data_tools.shards_cli import inspect_shard_set, main
from hvd_partialfc.data.loader import RankShardDataset
from hvd_partialfc.data.pair_files import read_pairs
from hvd_partialfc.data.shards import read_manifest

from helpers_recordio import write_rec

WQY = "/usr/share/fonts/truetype/wqy"
needs_wqy = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(WQY, f)) for f in ("wqy-zenhei.ttc", "wqy-microhei.ttc")),
    reason="fonts-wqy-zenhei or fonts-wqy-microhei is not installed (bash scripts/setup/install.sh --test-fonts)")


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image(seed: int, shape=(8, 8, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def build(*args) -> int:
    return main(["build", *[str(a) for a in args], "--workers", "1"])


def sha256s(path):
    return [s.sha256 for s in read_manifest(path).shards]


def load_all(path):
    """(samples, global labels) of a whole shard set through the trainer's loader (one rank)."""
    ds = RankShardDataset(str(path), 0, 1)
    x, y = ds[list(range(len(ds)))]
    return x.numpy(), y.numpy() + ds.label_slice.start


@pytest.fixture
def folder(tmp_path):
    """ImageFolder: classes a (3 images), b (2), c (4), PNG 8x8 RGB; returns (dir, {path: pixels})."""
    root = tmp_path / "folder"
    pixels = {}
    for c, n in (("a", 3), ("b", 2), ("c", 4)):
        (root / c).mkdir(parents=True)
        for i in range(n):
            arr = image(hash((c, i)) % 1000)
            p = root / c / f"{i}.png"
            p.write_bytes(png(arr))
            pixels[str(p)] = arr
    return root, pixels


# --- importers ---------------------------------------------------------------------------------------

@needs_wqy
def test_fonts_renders_characters_drops_missing_and_duplicates(tmp_path):
    chars = tmp_path / "chars.txt"
    chars.write_text("永和九年\U0002A6D6\n", encoding="utf-8")   # the last one (Ext B) is not in WenQuanYi
    out = tmp_path / "fonts"
    assert build("fonts", "--charset", chars, "--font-dir", WQY, "--size", 32, "--out", out,
                 "--num-shards", 2) == 0
    m = read_manifest(str(out))
    assert m.class_names == sorted("永和九年") and m.sample_shape == [32, 32] and m.kind == "images"
    src = m.source
    assert src["faces_found"] == 5 and src["duplicate_renderings_dropped"] > 0
    assert all(f["family"].startswith("WenQuanYi") for f in src["fonts"])
    x, y = load_all(out)
    assert x.shape[1:] == (32, 32) and x.dtype == np.uint8
    assert all(img.any() for img in x)                                 # no blank renderings
    for c in range(4):                                                 # no byte-identical duplicates
        imgs = [img.tobytes() for img, l in zip(x, y) if l == c]
        assert len(imgs) == len(set(imgs)) >= 1


@needs_wqy
def test_fonts_augmentation_is_seeded(tmp_path):
    args = ["fonts", "--charset", "gb2312-1", "--max-chars", 3, "--font-dir", WQY, "--size", 32,
            "--samples-per-font", 3, "--num-shards", 1]
    assert build(*args, "--out", tmp_path / "a", "--seed", 5) == 0
    assert main(["build", *map(str, args), "--out", str(tmp_path / "b"), "--seed", "5", "--workers", "2"]) == 0
    assert build(*args, "--out", tmp_path / "c", "--seed", 6) == 0
    assert sha256s(tmp_path / "a") == sha256s(tmp_path / "b") != sha256s(tmp_path / "c")
    x, y = load_all(tmp_path / "a")
    assert len(x) % 3 == 0 and not np.array_equal(x[0], x[1])           # clean, then 2 augmented


def test_imagefolder_raw_and_encoded_through_the_loader(folder, tmp_path):
    root, pixels = folder
    for store in ("raw", "encoded"):
        out = tmp_path / store
        assert build("imagefolder", root, "--out", out, "--num-shards", 3, "--store", store) == 0
        m = read_manifest(str(out))
        assert m.class_names == ["a", "b", "c"] and m.sample_shape == [8, 8, 3]
        assert m.kind == ("images" if store == "raw" else "encoded")
        x, y = load_all(out)
        expect = [pixels[str(root / c / f"{i}.png")] for c, n in (("a", 3), ("b", 2), ("c", 4)) for i in range(n)]
        np.testing.assert_array_equal(x, np.stack(expect))
        assert y.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
        for rank in range(3):                                           # one class per rank, local labels
            _, local = RankShardDataset(str(out), rank, 3)[[0]]
            assert local.tolist() == [0]


def test_imagefolder_resizes_to_size_and_gray(folder, tmp_path):
    root, _ = folder
    assert build("imagefolder", root, "--out", tmp_path / "o", "--num-shards", 1, "--size", "4,6",
                 "--color", "gray") == 0
    x, _ = load_all(tmp_path / "o")
    assert x.shape == (9, 4, 6)


def test_list_file_relative_paths_and_integer_labels(folder, tmp_path):
    root, pixels = folder
    lst = root / "train.lst"
    lst.write_text("# path label\na/0.png 10\nb/1.png 2\n" + f"{root / 'c' / '3.png'} 2\n\nc/0.png 10\n")
    out = tmp_path / "list"
    assert build("list", lst, "--out", out, "--num-shards", 2) == 0
    m = read_manifest(str(out))
    assert m.class_names == ["2", "10"]                                  # integer labels sort numerically
    x, y = load_all(out)
    np.testing.assert_array_equal(x[0], pixels[str(root / "b" / "1.png")])
    assert y.tolist() == [0, 0, 1, 1]


def test_recordio_with_header_and_split_records(tmp_path):
    imgs = [image(i, (6, 6)) for i in range(7)]
    blobs = [png(a) for a in imgs]
    # Make record 3's payload contain the magic word at a 4-byte boundary: the writer splits it in parts.
    pad = (-(24 + len(blobs[3]))) % 4
    blobs[3] = blobs[3] + b"\0" * pad + struct.pack("<I", 0xCED7230A) + b"tail"
    labels = [4, 4, 0, 0, 0, 9, 9]
    write_rec(str(tmp_path / "train"), blobs, labels)
    assert (tmp_path / "train.rec").read_bytes().count(struct.pack("<I", 0xCED7230A)) > 7 + 3 + 1
    out = tmp_path / "rec"
    assert build("recordio", tmp_path / "train", "--out", out, "--num-shards", 3, "--store", "encoded") == 0
    m = read_manifest(str(out))
    assert m.class_names == ["0", "4", "9"] and m.sample_shape == [6, 6] and m.num_samples == 7
    x, y = load_all(out)
    order = [2, 3, 4, 0, 1, 5, 6]                                         # grouped by class, input order
    np.testing.assert_array_equal(x, np.stack([imgs[i] for i in order]))
    with h5py.File(out / m.shards[0].file) as f:                          # original bytes, joined parts
        assert f["encoded"][1].tobytes() == blobs[3]
    # Without InsightFace's header record, and with multi-float labels (flag > 0): first label is the class.
    write_rec(str(tmp_path / "plain"), blobs[:3], [1, 2, 1], header=False,
              multi_label=[[1, 0.5], [2, 0.5], [1, 0.5]])
    assert build("recordio", tmp_path / "plain.rec", "--out", tmp_path / "p", "--num-shards", 2) == 0
    assert read_manifest(str(tmp_path / "p")).num_samples == 3


def test_npz_features_and_balance_policy(tmp_path, capsys):
    counts = [30, 30, 30, 1, 1, 1, 1, 1, 1, 1, 1, 1]                      # head classes + long tail
    labels = np.repeat(np.arange(len(counts)), counts)
    feats = np.random.default_rng(0).normal(size=(len(labels), 5)).astype(np.float32)
    np.savez(tmp_path / "d.npz", features=feats, labels=labels)
    imb = {}
    for policy in ("classes", "samples"):
        out = tmp_path / policy
        assert build("npz", tmp_path / "d.npz", "--out", out, "--num-shards", 3, "--balance", policy) == 0
        assert f"--balance {policy}" in capsys.readouterr().out           # imbalance reported
        m = read_manifest(str(out))
        imb[policy] = m.partition["sample_imbalance"]
        assert m.partition["sample_imbalance_by_classes"] == pytest.approx(imb["classes"])
        x, _ = load_all(out)
        np.testing.assert_array_equal(x, feats)
    assert imb["samples"] < 1.25 < 2.5 < imb["classes"]


# --- determinism, atomicity, bad inputs ----------------------------------------------------------------

def test_two_builds_give_identical_sha256(folder, tmp_path):
    root, _ = folder
    for name, workers in (("a", 1), ("b", 2)):
        assert main(["build", "imagefolder", str(root), "--out", str(tmp_path / name), "--num-shards", "2",
                     "--workers", str(workers), "--holdout", "0.34"]) == 0
    assert sha256s(tmp_path / "a") == sha256s(tmp_path / "b")
    assert sha256s(tmp_path / "a-holdout") == sha256s(tmp_path / "b-holdout")
    ma, ha = read_manifest(str(tmp_path / "a")), read_manifest(str(tmp_path / "a-holdout"))
    assert not set(ma.class_names) & set(ha.class_names) and len(ma.class_names) + len(ha.class_names) == 3
    # The two sets name each other relative to their own folders: no machine path, and they move together.
    assert ma.source["holdout"]["path"] == "../a-holdout" and ha.source["holdout_of"] == "../a"


def test_interrupted_build_leaves_no_output(folder, tmp_path, monkeypatch):
    from data_tools import build as B
    from data_tools.importers import get_importer
    from data_tools import shard_writer as shards
    root, _ = folder
    calls = []
    real = shards.write_shard

    def failing(*a, **k):                      # the second shard's write dies (disk full, Ctrl-C, ...)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(shards, "write_shard", failing)
    with pytest.raises(KeyboardInterrupt):
        B.build(get_importer("imagefolder"), str(root), B.BuildOptions(out=str(tmp_path / "out"), num_shards=2, progress=False,
                                          holdout=0.34))
    assert sorted(os.listdir(tmp_path)) == ["folder"]      # neither set, nor a .tmp-* folder

    def importer_that_dies(source, **_):
        raise RuntimeError("unreadable source midway")
    with pytest.raises(RuntimeError):
        B.build(importer_that_dies, None, B.BuildOptions(out=str(tmp_path / "out"), num_shards=1))
    assert sorted(os.listdir(tmp_path)) == ["folder"]


def test_unreadable_image_fail_or_skip(folder, tmp_path, capsys):
    root, _ = folder
    (root / "c" / "broken.png").write_bytes(b"not a png")
    assert build("imagefolder", root, "--out", tmp_path / "f", "--num-shards", 1) == 2
    assert "broken.png" in capsys.readouterr().err and not (tmp_path / "f").exists()
    assert build("imagefolder", root, "--out", tmp_path / "s", "--num-shards", 1, "--on-error", "skip") == 0
    m = read_manifest(str(tmp_path / "s"))
    assert m.num_samples == 9 and len(m.skipped) == 1 and "broken.png" in m.skipped[0]


@pytest.mark.parametrize("fmt, store", [("imagefolder", "raw"), ("imagefolder", "encoded"), ("list", "raw"),
                                        ("recordio", "raw")])
def test_skip_drops_a_truncated_image_with_a_worker_pool(folder, tmp_path, capsys, fmt, store):
    """The command the build's own error and ``inspect --decode`` recommend, as a user runs it: a real PNG cut
    in half, ``--on-error skip``, the default worker pool (two processes here). The shard is rewritten without
    the sample (`_compact`); before, the pool's workers, forked while the shard was open, held its lock and the
    rewrite failed: "unable to lock file"."""
    root, pixels = folder
    whole = png(image(7))
    (root / "c" / "cut.png").write_bytes(whole[:len(whole) // 2])
    files = sorted(str(p) for p in root.rglob("*.png"))
    if fmt == "imagefolder":
        source = root
    elif fmt == "list":
        source = tmp_path / "all.lst"
        source.write_text("".join(f"{p} {os.path.basename(os.path.dirname(p))}\n" for p in files))
    else:
        source = tmp_path / "all"
        write_rec(str(source), [open(p, "rb").read() for p in files], ["abc".index(p.split(os.sep)[-2]) for p in files])
        source = tmp_path / "all.rec"
    out = tmp_path / "s"
    assert main(["build", fmt, str(source), "--out", str(out), "--num-shards", "1", "--store", store, "--size", "8",
                 "--on-error", "skip", "--workers", "2"]) == 0, capsys.readouterr().err
    m = read_manifest(str(out))
    assert m.num_samples == len(files) - 1 and len(m.skipped) == 1
    assert "cut.png" in m.skipped[0] or fmt == "recordio"
    if store == "raw":          # the samples that stayed are the images, in order, each with its class
        samples, labels = load_all(out)
        want = [(pixels[p], "abc".index(p.split(os.sep)[-2])) for p in files if p in pixels]
        assert sorted((int(y), x.tobytes()) for x, y in zip(samples, labels)) == \
            sorted((y, x.tobytes()) for x, y in want)


@pytest.mark.parametrize("case, message", [
    ("no_classes", "no class subfolders"),
    ("empty_list", "no classes"),
    ("fewer_classes_than_shards", "fewer classes than shards"),
    ("empty_class_folder", "holds no image files"),
    ("class_emptied_by_skips", "is empty"),
    ("exists", "already exists"),
])
def test_bad_inputs_give_clear_errors(folder, tmp_path, capsys, case, message):
    root, _ = folder
    out = tmp_path / "out"
    args = ["imagefolder", root, "--out", out, "--num-shards", 1]
    if case == "no_classes":
        (tmp_path / "empty").mkdir()
        args[1] = tmp_path / "empty"
    elif case == "empty_list":
        (tmp_path / "e.lst").write_text("# nothing\n")
        args[:2] = ["list", tmp_path / "e.lst"]
    elif case == "fewer_classes_than_shards":
        args[-1] = 4
    elif case == "empty_class_folder":
        (root / "d").mkdir()
    elif case == "class_emptied_by_skips":
        (root / "d").mkdir()
        (root / "d" / "x.png").write_bytes(b"garbage")
        args += ["--on-error", "skip"]
    elif case == "exists":
        out.mkdir()
        (out / "keep").write_text("x")
    assert build(*args) == 2
    assert message in capsys.readouterr().err
    if case == "exists":
        assert (out / "keep").exists()
        assert build(*args, "--overwrite") == 0 and not (out / "keep").exists()
    else:
        assert not out.exists()


# --- inspect and pairs -------------------------------------------------------------------------------------

def test_inspect_validates_and_plots(folder, tmp_path, capsys):
    root, _ = folder
    out = tmp_path / "o"
    assert build("imagefolder", root, "--out", out, "--num-shards", 3) == 0
    assert main(["inspect", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    assert "valid" in capsys.readouterr().out
    assert Image.open(tmp_path / "p.png").size[0] > 100
    info = inspect_shard_set(str(out))
    assert [r["samples"] for r in info["shards"]] == [3, 2, 4]
    with h5py.File(out / "shard-00001-of-00003.h5", "a") as f:           # tamper: sha256 must catch it
        f["images"][0] = 0
    assert main(["inspect", str(out)]) == 2
    assert "sha256" in capsys.readouterr().err


def test_pairs_balanced_seeded_and_bin_round_trip(folder, tmp_path):
    root, pixels = folder
    held = tmp_path / "held"
    assert build("imagefolder", root, "--out", held, "--num-shards", 1) == 0
    assert main(["pairs", str(held), "--out", str(tmp_path / "p.h5"), "--num-pairs", "20", "--seed", "3"]) == 0
    assert main(["pairs", str(held), "--out", str(tmp_path / "q.h5"), "--num-pairs", "20", "--seed", "3"]) == 0
    p, q = read_pairs(str(tmp_path / "p.h5")), read_pairs(str(tmp_path / "q.h5"))
    assert p.num_pairs == 20 and p.same.sum() == 10
    np.testing.assert_array_equal(p.left, q.left)
    np.testing.assert_array_equal(p.images, q.images)
    with h5py.File(tmp_path / "p.h5") as f:
        lab = f["labels"][:]
    assert all((lab[i] == lab[j]) == s for i, j, s in zip(p.left, p.right, p.same))
    assert all(i != j for i, j, s in zip(p.left, p.right, p.same) if s)
    known = {a.tobytes() for a in pixels.values()}
    assert all(img.tobytes() in known for img in p.images)
    # .h5 -> LFW-style .bin -> .h5: same images, same flags.
    assert main(["pairs", str(tmp_path / "p.h5"), "--out", str(tmp_path / "p.bin")]) == 0
    assert main(["pairs", str(tmp_path / "p.bin"), "--out", str(tmp_path / "r.h5")]) == 0
    b, r = read_pairs(str(tmp_path / "p.bin")), read_pairs(str(tmp_path / "r.h5"))
    for s in (b, r):
        np.testing.assert_array_equal(s.same, p.same)
        np.testing.assert_array_equal(s.images[s.left], p.images[p.left])
        np.testing.assert_array_equal(s.images[s.right], p.images[p.right])
    assert main(["pairs", str(held), "--out", str(tmp_path / "d.bin"), "--num-pairs", "6", "--bin"]) == 0
    assert read_pairs(str(tmp_path / "d.bin")).num_pairs == 6
