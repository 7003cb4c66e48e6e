"""The `cjk` character set and the fonts importer's selection rule (family keys, cmap check, stand-ins,
duplicates, near duplicates, --min-families, --min-samples top-up, held-out split, determinism).

Real fonts, tiny: a few installed Debian fonts are subset (fontTools) to a handful of characters and
renamed, so the test knows by construction which renderings are clones, stand-ins or missing. Seconds."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from data_tools.charsets import load_charset
from data_tools.shards_cli import main
from data_tools.importers.fonts import family_key, is_near_duplicate, limit_faces_per_family
from hvd_partialfc.data.loader import RankShardDataset
from hvd_partialfc.data.shards import read_manifest

DROID = "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf"      # fonts-droid-fallback
VL = "/usr/share/fonts/truetype/vlgothic/VL-Gothic-Regular.ttf"          # fonts-vlgothic
SUNG = "/usr/share/fonts/truetype/arphic-gbsn00lp/gbsn00lp.ttf"          # fonts-arphic-gbsn00lp
needs_fonts = pytest.mark.skipif(
    not all(os.path.isfile(p) for p in (DROID, VL, SUNG)),
    reason="fonts-droid-fallback, fonts-vlgothic or fonts-arphic-gbsn00lp is not installed "
           "(bash scripts/setup/install.sh --test-fonts)")
TEXT30 = "永和九年岁在癸丑暮春之初会于会稽山阴兰亭修禊事也群贤毕至少长咸集此地有崇岭茂林修竹"


def make_font(src: str, chars: str, family: str, out, alias=None) -> None:
    """``src`` subset to ``chars``, its family names (IDs 1, 16) set to ``family``; ``alias`` maps
    characters to the glyph of another one (a font's stand-in glyph)."""
    from fontTools import subset
    from fontTools.ttLib import TTFont
    f = TTFont(src)
    opts = subset.Options()
    opts.name_IDs = ["*"]
    opts.notdef_outline = True
    opts.layout_features = []
    sub = subset.Subsetter(opts)
    sub.populate(unicodes=[ord(c) for c in chars])
    sub.subset(f)
    for rec in f["name"].names:
        if rec.nameID in (1, 16):
            rec.string = family
    for table in f["cmap"].tables:
        if table.isUnicode():
            for a, b in (alias or {}).items():
                table.cmap[ord(a)] = table.cmap[ord(b)]
    f.save(str(out))


def build(*args) -> int:
    return main(["build", "fonts", *[str(a) for a in args]])


def load_all(path):
    ds = RankShardDataset(str(path), 0, 1)
    x, y = ds[list(range(len(ds)))]
    return x.numpy(), y.numpy() + ds.label_slice.start


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_cjk_charset_is_the_main_block_and_extension_a():
    chars = load_charset("cjk")
    cps = [ord(c) for c in chars]
    assert len(chars) == 27584 == 0x9FFF - 0x4E00 + 1 + 0x4DBF - 0x3400 + 1
    assert cps == sorted(cps) and cps[0] == 0x3400 and cps[-1] == 0x9FFF
    assert 0x4DBF in cps and 0x4DC0 not in cps and 0x4E00 in cps     # the Yijing hexagrams between are not


def test_family_key_and_one_face_per_family():
    assert family_key("Noto Sans Mono CJK JP") == family_key("Noto Sans CJK SC") == "Noto Sans CJK"
    assert family_key("AR PL UMing TW MBE") == "AR PL UMing" != family_key("AR PL UKai CN")
    assert family_key("VL PGothic") == "VL Gothic" and family_key("IPAPMincho") == "IPAMincho"
    assert family_key("Ume P Gothic S4") == "Ume Gothic S4" != family_key("Ume Gothic")
    assert family_key("PMingLiU") == "PMingLiU"        # a leading P that is part of the name stays
    faces = [{"key": "A", "style": "Bold"}, {"key": "B", "style": "Light"}, {"key": "A", "style": "Regular"},
             {"key": "A", "style": "Regular"}, {"key": "B", "style": "Medium"}]
    assert limit_faces_per_family(faces, 1) == [faces[1], faces[2]]      # A: Regular first; B: path order
    assert limit_faces_per_family(faces, 2) == [faces[1], faces[2], faces[3], faces[4]]
    assert limit_faces_per_family(faces, 0) == faces


def test_near_duplicate_tolerates_one_pixel_shifts_only():
    img = np.zeros((32, 32), np.uint8)
    img[10:16, 10:16] = 255                                   # a 6x6 square: 36 pixels of ink
    one = np.roll(img, 1, axis=1)
    two = np.roll(img, 2, axis=1)
    assert is_near_duplicate(one, [img], 0.0)
    # shifted by 2: the best 1-pixel shift leaves 2 columns of 6 pixels differing: 12 * 255 / 1024
    assert not is_near_duplicate(two, [img], 12 * 255 / 1024 - 0.01)
    assert is_near_duplicate(two, [img], 12 * 255 / 1024 + 0.01)
    assert not is_near_duplicate(img, [], 255.0)


@pytest.fixture(scope="module")
def fontdir(tmp_path_factory):
    """1 Droid "T Droid"; 2 its clone "T Clone"; 3 VL "T VL" with 九 and 年 on 永's glyph (stand-ins);
    4 Sung "T Sung" without 年; 5 VL "T Droid Mono" (the key "T Droid": another design in one key)."""
    d = tmp_path_factory.mktemp("fonts")
    make_font(DROID, "永和九年", "T Droid", d / "1-droid.ttf")
    make_font(DROID, "永和九年", "T Clone", d / "2-clone.ttf")
    make_font(VL, "永和九年", "T VL", d / "3-vl.ttf", alias={"九": "永", "年": "永"})
    make_font(SUNG, "永和九", "T Sung", d / "4-sung.ttf")
    make_font(VL, "永和九年", "T Droid Mono", d / "5-vlmono.ttf")
    return d


@needs_fonts
def test_min_families_counts_keys_after_cmap_standin_and_duplicate_checks(fontdir, tmp_path):
    chars = tmp_path / "chars.txt"
    chars.write_text("永和九年一", encoding="utf-8")          # 一: in no font
    out = tmp_path / "out"
    assert build("--charset", chars, "--font-dir", fontdir, "--size", 32, "--min-families", 2,
                 "--min-samples", 5, "--out", out, "--num-shards", 1, "--workers", 1) == 0
    m = read_manifest(str(out))
    src = m.source
    # By construction: 永 = Droid, Sung, VL-as-"T Droid" (2 keys, 3 renderings); 和 = Droid, VL, Sung
    # (VL-as-"T Droid" duplicates VL); 九 = Droid, Sung, VL-as-"T Droid"; 年 = Droid + VL-as-"T Droid" (1 key).
    assert m.class_names == sorted("永和九")
    assert src["family_histogram"] == [1, 1, 2, 1]            # 一: 0; 年: 1; 永, 九: 2; 和: 3
    assert src["cmap_family_histogram"] == [1, 0, 0, 1, 3]    # cmap only: 年 lacks Sung, 一 everything
    assert src["duplicate_renderings_dropped"] == 4 + 1       # the clone's 4, VL-as-"T Droid"'s 和
    assert src["standin_renderings_dropped"] == 3             # VL's 永, 九, 年 share one glyph
    assert src["characters_dropped"] == 2
    assert {f["family"] for f in src["fonts"]} == {"T Droid", "T VL", "T Sung", "T Droid Mono"}
    # what else the bytes depend on: each font file's sha256 and the renderer's and writer's versions
    import hashlib
    import h5py
    import PIL
    for f in src["fonts"]:
        assert f["sha256"] == hashlib.sha256(open(f["file"], "rb").read()).hexdigest()
    assert src["built_with"]["Pillow"] == PIL.__version__ and src["built_with"]["hdf5"] == h5py.version.hdf5_version
    assert set(src["built_with"]) == {"Pillow", "freetype2", "numpy", "h5py", "hdf5"}
    x, y = load_all(out)
    for label, ch in enumerate(m.class_names):
        imgs = x[y == label]
        assert len(imgs) == 5                                  # 3 renderings + 2 top-ups each
        assert len({i.tobytes() for i in imgs}) == 5 and all(i.any() for i in imgs)
    assert src["top_up_samples"] == 3 * 2
    # one face per key: VL-as-"T Droid" is not rendered, so 永 and 九 lose a rendering, not a family
    out1 = tmp_path / "out1"
    assert build("--charset", chars, "--font-dir", fontdir, "--size", 32, "--min-families", 2,
                 "--faces-per-family", 1, "--out", out1, "--num-shards", 1, "--workers", 1) == 0
    m1 = read_manifest(str(out1))
    assert m1.class_names == sorted("永和九") and m1.source["family_histogram"] == [1, 1, 2, 1]
    assert "T Droid Mono" not in {f["family"] for f in m1.source["fonts"]}
    _, y1 = load_all(out1)
    assert np.bincount(y1).tolist() == [{"永": 2, "和": 3, "九": 2}[c] for c in m1.class_names]
    # a near-duplicate threshold of 255 makes every later rendering a duplicate of the first: 1 family each
    out2 = tmp_path / "out2"
    assert build("--charset", chars, "--font-dir", fontdir, "--size", 32, "--near-duplicate", 255,
                 "--out", out2, "--num-shards", 1, "--workers", 1) == 0
    src2 = read_manifest(str(out2)).source
    assert src2["family_histogram"] == [1, 4] and src2["near_duplicate_renderings_dropped"] == 11 - 4


@needs_fonts
def test_font_list_pins_the_faces_and_refuses_a_missing_one(fontdir, tmp_path, capsys):
    chars = tmp_path / "chars.txt"
    chars.write_text("永和九", encoding="utf-8")
    pinned = tmp_path / "pinned.txt"
    pinned.write_text("# a comment\nT Sung\n\nT Droid:Regular  # one face of a family\n", encoding="utf-8")
    out = tmp_path / "out"
    assert build("--charset", chars, "--font-dir", fontdir, "--size", 32, "--font-list", pinned,
                 "--out", out, "--num-shards", 1, "--workers", 1) == 0
    src = read_manifest(str(out)).source
    assert [f["family"] for f in src["fonts"]] == ["T Droid", "T Sung"] and src["font_list"] == "pinned.txt"
    pinned.write_text("T Sung\nT Droid:Bold\nT Nowhere\n", encoding="utf-8")
    assert build("--charset", chars, "--font-dir", fontdir, "--size", 32, "--font-list", pinned,
                 "--out", tmp_path / "out2", "--num-shards", 1, "--workers", 1) == 2
    err = capsys.readouterr().err
    assert "2 of its 3 faces are not installed: 'T Droid:Bold', 'T Nowhere'; install them" in err
    assert not (tmp_path / "out2").exists()


@needs_fonts
def test_holdout_fraction_and_byte_identical_rebuilds(tmp_path):
    d = tmp_path / "fonts"
    d.mkdir()
    for i, (src, fam) in enumerate(((DROID, "T Droid"), (VL, "T VL"), (SUNG, "T Sung"))):
        make_font(src, TEXT30, fam, d / f"{i}.ttf")
    chars = tmp_path / "chars.txt"
    chars.write_text(TEXT30, encoding="utf-8")
    distinct = len(set(TEXT30))
    args = ["--charset", chars, "--font-dir", d, "--size", 32, "--min-families", 3, "--min-samples", 4,
            "--near-duplicate", 8, "--holdout", 0.1, "--seed", 3, "--out", tmp_path / "train",
            "--holdout-out", tmp_path / "held", "--num-shards", 2, "--overwrite"]
    digests = []
    for workers in (1, 2):
        assert build(*args, "--workers", workers) == 0
        digests.append([sha256(tmp_path / s / f) for s in ("train", "held")
                        for f in sorted(os.listdir(tmp_path / s))])
    assert digests[0] == digests[1]                            # manifests and shards, byte for byte
    train, held = read_manifest(str(tmp_path / "train")), read_manifest(str(tmp_path / "held"))
    kept = train.num_classes + held.num_classes
    assert kept == distinct - train.source["characters_dropped"] and kept >= 25
    assert held.num_classes == round(0.1 * kept) and not set(train.class_names) & set(held.class_names)
    _, y = load_all(tmp_path / "train")
    assert np.bincount(y).min() >= 4
