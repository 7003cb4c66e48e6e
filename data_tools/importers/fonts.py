"""``fonts``: the default data set — CJK characters rendered from the installed fonts (one class per
character, one sample per (character, font face) and augmentation).

Pipeline:

1. **Faces.** Font files come from fontconfig (``fc-list``) or from ``--font-dir`` (recursively; ``.ttf``,
   ``.otf``, ``.ttc``/``.otc``), sorted by path; a collection contributes each of its faces (by index).
   A face's family is its typographic family name (name ID 16, else 1): e.g. all seven weights of
   "Noto Sans CJK SC" are one family. ``--max-fonts K`` keeps the first K families (whole families).
   Its *family key* (``family_key``) drops the words of that name that only name a regional or encoding
   edition or a width variant of one design (``FAMILY_QUALIFIERS``: SC, TC, JP, KR, HK, CN, TW, MBE, GB,
   Big5, Mono, Sharp, P, and a "P" glued to Gothic/Mincho): "Noto Sans Mono CJK JP" and "Noto Sans CJK
   SC" are the key "Noto Sans CJK", "VL PGothic" is "VL Gothic".
   ``--faces-per-family K`` keeps K faces per key (its "Regular" style first, then path order), and
   ``--min-families K`` counts keys (below).
2. **Coverage.** A face is used for a character only when its cmap maps the character to a glyph other
   than ``.notdef`` (read with fontTools) *and* the rendering has ink, differs from the face's own
   ``.notdef`` box, and is not pixel-equal to the face's rendering of another character of the charset
   (a placeholder or an alias: two code points one face draws identically cannot be told apart by that
   face; on the `cjk` set Noto maps some code-point pairs to one glyph, 170 renderings dropped; no face maps
   two gb2312-1 characters to one glyph): no blank squares, no tofu, no stand-ins.
3. **Rendering.** Pillow/FreeType, white on black, grayscale ``size`` x ``size``, glyph bounding box
   centred, font size 0.8 x ``size``. One task per face, in worker processes.
4. **Duplicates.** Within a character, a rendering byte-identical to one from an earlier face (e.g. the
   JP and SC faces of one collection sharing a glyph) is dropped, with its augmentations.
5. **Augmentation** (``--samples-per-font K`` > 1): sample 0 is the clean rendering, samples 1..K-1 apply
   a small random affine map (rotation, scale, shear, shift), stroke thickening or thinning, blur and
   noise, from a generator seeded by (seed, code point, face, k): the same options give the same bytes
   whatever the number of workers.
6. **Near duplicates** (``--near-duplicate T`` > 0): a rendering within T (mean absolute difference,
   0-255) of an earlier kept rendering of the same character, at some shift of at most one pixel, is
   dropped too (``is_near_duplicate``): fonts that share outlines but centre one pixel apart, or
   copies with small edits, are then not counted as two designs.
7. **Top-up** (``--min-samples N``): a kept character with fewer than N samples gets augmented ones
   (as in 5, round-robin over its renderings) until it has N; the others are left as they are. On the
   `cjk` set this replaces a uniform ``--samples-per-font``: 5-family characters need 4 samples per
   rendering, ~40-family ones none, and a uniform 4 would have multiplied samples, memory and time ~4x.
8. **Families per character** (``--min-families K``): a character is kept when the renderings left after
   steps 2, 4 and 6 come from at least K distinct family keys. The histogram of that count over the whole
   charset is in the manifest (``family_histogram``), next to the cmap-only one computed before any
   rendering (``cmap_family_histogram``).

The class name of each class is the character itself; the manifest's ``source`` lists every face used
(file, index, family, style, samples kept).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .importer_registry import register_importer
from ..imported import ImportedData
from ..charsets import load_charset
from ..storage import default_workers, pmap
from .font_list import pick_faces, read_font_list

FONT_EXTENSIONS = (".ttf", ".otf", ".ttc", ".otc")


def find_font_files(font_dir: Optional[str] = None) -> List[str]:
    if font_dir:
        if not os.path.isdir(font_dir):
            raise ValueError(f"--font-dir {font_dir}: not a folder")
        files = [os.path.join(r, f) for r, _, fs in os.walk(font_dir) for f in fs]
    else:
        try:
            out = subprocess.run(["fc-list", "--format", "%{file}\n"], capture_output=True, text=True,
                                 check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise ValueError(f"fc-list failed ({e}); install fontconfig or pass --font-dir") from e
        files = out.splitlines()
    return sorted({os.path.realpath(f) for f in files if f.lower().endswith(FONT_EXTENSIONS)})


# Words of a typographic family name that name a regional / encoding edition or a width variant of the
# same design, not another design: dropped to form the family key that --min-families counts.
# A proportional edition glued to its style word ("IPAPGothic", "VL PGothic") is the same design too.
FAMILY_QUALIFIERS = frozenset("SC TC JP KR HK CN TW MBE GB Big5 Mono Sharp P".split())
_GLUED_P = re.compile(r"(^|\s|IPA|Takao)P(Gothic|Mincho)")


def family_key(family: str) -> str:
    """The design a family name belongs to: its words minus ``FAMILY_QUALIFIERS``, a glued "P" edition
    ("VL PGothic", "IPAPMincho") as its monospaced name."""
    words = [w for w in family.split() if w not in FAMILY_QUALIFIERS]
    return _GLUED_P.sub(r"\1\2", " ".join(words)) or family


def built_with() -> Dict[str, str]:
    """The versions the shard bytes depend on besides the fonts (whose files' sha256 the manifest records):
    the renderer (Pillow and the FreeType it carries), numpy, and the HDF5 writer. Measured: the same
    ``cjk-20k`` build on two fresh machines (2026-12-01, 2026-12-02) gave other shard sha256s with the same
    samples (docs/evidence/data.md §4.1), and nothing then recorded which of these had moved; a rebuild that differs
    can now be compared entry by entry."""
    import h5py
    import PIL
    from PIL import features
    return {"Pillow": PIL.__version__, "freetype2": str(features.version("freetype2")), "numpy": np.__version__,
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}


def list_faces(files: Sequence[str]) -> List[Dict]:
    """Every face of every file: {file, index, family, style, key}, in (file, index) order."""
    from fontTools.ttLib import TTCollection, TTFont
    faces = []
    for path in files:
        try:
            n = len(TTCollection(path, lazy=True).fonts) if path.lower().endswith((".ttc", ".otc")) else 1
            for i in range(n):
                names = TTFont(path, fontNumber=i, lazy=True)["name"]
                family = names.getDebugName(16) or names.getDebugName(1) or os.path.basename(path)
                style = names.getDebugName(17) or names.getDebugName(2) or ""
                faces.append({"file": path, "index": i, "family": family, "style": style,
                              "key": family_key(family)})
        except Exception:  # noqa: BLE001 - an unreadable font file is skipped, not fatal
            continue
    return faces


def _covered(face: Dict, chars: Sequence[str]) -> List[int]:
    """Indices of the characters the face's cmap maps to a real glyph (an unreadable font: none)."""
    import logging
    from fontTools.ttLib import TTFont
    logging.getLogger("fontTools").setLevel(logging.ERROR)
    try:
        cmap = TTFont(face["file"], fontNumber=face["index"], lazy=True).getBestCmap() or {}
    except Exception:  # noqa: BLE001 - an unreadable font file covers nothing
        return []
    return [i for i, ch in enumerate(chars) if cmap.get(ord(ch), ".notdef") != ".notdef"]


def histogram(counts: Sequence[int]) -> List[int]:
    """h[n] = how many characters have n families."""
    return np.bincount(np.asarray(counts, dtype=np.int64), minlength=1).tolist()


def cmap_families(faces: Sequence[Dict], chars: Sequence[str]) -> List[int]:
    """Per character, the number of family keys with a face whose cmap maps it (no rendering)."""
    keys = sorted({f["key"] for f in faces})
    cover = np.zeros((len(keys), len(chars)), dtype=bool)
    for f in faces:
        cover[keys.index(f["key"]), _covered(f, chars)] = True
    return cover.sum(axis=0).tolist()


def render(font, ch: str, size: int) -> np.ndarray:
    """White-on-black uint8 (size, size) rendering of ``ch``, its ink bounding box centred."""
    from PIL import Image, ImageDraw
    img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), ch, font=font)
    x = (size - (right - left)) / 2 - left
    y = (size - (bottom - top)) / 2 - top
    draw.text((round(x), round(y)), ch, fill=255, font=font)
    return np.asarray(img, dtype=np.uint8)


def augment(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Small affine jitter, stroke thickness, blur and noise (all mild: the character stays legible)."""
    from PIL import Image, ImageFilter
    size = img.shape[0]
    angle = np.deg2rad(rng.uniform(-8, 8))
    scale = rng.uniform(0.9, 1.1)
    shear = rng.uniform(-0.15, 0.15)
    tx, ty = rng.uniform(-0.05, 0.05, size=2) * size
    # Inverse map (output -> input) about the centre, as Image.transform expects.
    a = np.array([[np.cos(angle), -np.sin(angle) + shear], [np.sin(angle), np.cos(angle)]]) * scale
    inv = np.linalg.inv(a)
    c = (size - 1) / 2
    off = np.array([c, c]) - inv @ np.array([c + tx, c + ty])
    pil = Image.fromarray(img).transform((size, size), Image.AFFINE,
                                         (inv[0, 0], inv[0, 1], off[0], inv[1, 0], inv[1, 1], off[1]),
                                         resample=Image.BILINEAR)
    stroke = rng.integers(3)                       # 0 keep, 1 thicker, 2 thinner
    if stroke == 1:
        pil = pil.filter(ImageFilter.MaxFilter(3))
    elif stroke == 2:
        thin = pil.filter(ImageFilter.MinFilter(3))
        # Thinning erases hairline fonts (Thin/Light weights): keep it only if most of the ink survives.
        if np.asarray(thin, np.float32).sum() >= 0.5 * np.asarray(pil, np.float32).sum():
            pil = thin
    if rng.random() < 0.5:
        pil = pil.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    out = np.asarray(pil, dtype=np.float32)
    out += rng.normal(0, rng.uniform(0, 10), size=out.shape)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


_TASK: Dict = {}   # (chars, size, samples_per_font, seed), set before the pool forks


def _render_face(job: Tuple[int, Dict]) -> Tuple[int, List[Tuple[int, bytes, bytes]], int]:
    """Render every covered character of one face: (face number, [(char index, sha1 of the clean render,
    K samples)], stand-in renderings dropped)."""
    from PIL import ImageFont
    face_no, face = job
    chars, size, k, seed = _TASK["chars"], _TASK["size"], _TASK["samples_per_font"], _TASK["seed"]
    try:
        covered = _covered(face, chars)
        if not covered:
            return face_no, [], 0
        font = ImageFont.truetype(face["file"], int(round(size * 0.8)), index=face["index"])
        notdef = render(font, "\U0010FFFD", size).tobytes()   # a private code point: the face's .notdef box
    except Exception:  # noqa: BLE001 - a font FreeType cannot open contributes nothing
        return face_no, [], 0
    clean = {}
    for ci in covered:
        img = render(font, chars[ci], size)
        if img.any() and img.tobytes() != notdef:
            clean[ci] = img
    digests = {ci: hashlib.sha1(img.tobytes()).digest() for ci, img in clean.items()}
    uses = Counter(digests.values())       # a rendering shared by two characters is a stand-in: drop both
    out = []
    for ci, img in clean.items():
        if uses[digests[ci]] > 1:
            continue
        samples = [img]
        for j in range(1, k):
            rng = np.random.default_rng([seed, ord(chars[ci]), face_no, j])
            samples.append(augment(img, rng))
        out.append((ci, digests[ci], np.stack(samples).tobytes()))
    return face_no, out, len(clean) - len(out)


def _top_up(job: Tuple[int, List[Tuple[int, bytes]], int]) -> bytes:
    """``need`` more augmented samples of one character, round-robin over its kept renderings: the j-th
    augments rendering j mod n with the generator (seed, code point, face, K + j // n), after the K of
    ``--samples-per-font`` (indices 1..K-1)."""
    ci, rows, need = job
    size, k, seed = _TASK["size"], _TASK["samples_per_font"], _TASK["seed"]
    out = []
    for j in range(need):
        face_no, blob = rows[j % len(rows)]
        clean = np.frombuffer(blob, np.uint8, count=size * size).reshape(size, size)
        out.append(augment(clean, np.random.default_rng([seed, ord(_TASK["chars"][ci]), face_no,
                                                         k + j // len(rows)])))
    return np.stack(out).tobytes()


def select_families(faces: List[Dict], max_fonts: Optional[int]) -> List[Dict]:
    """The faces of the first ``max_fonts`` families (in face order); all faces when None."""
    if not max_fonts:
        return faces
    keep = set(list(dict.fromkeys(f["family"] for f in faces))[:max_fonts])
    return [f for f in faces if f["family"] in keep]


def limit_faces_per_family(faces: List[Dict], k: Optional[int]) -> List[Dict]:
    """At most ``k`` faces per family key: its "Regular" styles first, then the others, each in face order
    (the result keeps face order); all faces when ``k`` is 0/None."""
    if not k:
        return faces
    by_key: Dict[str, List[int]] = {}
    for i, f in enumerate(faces):
        by_key.setdefault(f["key"], []).append(i)
    keep = set()
    for idx in by_key.values():
        keep.update(sorted(idx, key=lambda i: (faces[i]["style"] != "Regular", i))[:k])
    return [f for i, f in enumerate(faces) if i in keep]


_SHIFTS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]


def shift_distance(img: np.ndarray, kept: Sequence[np.ndarray]) -> np.ndarray:
    """Per rendering of ``kept``: the smallest mean absolute difference (0-255) to ``img`` over the shifts
    of ``img`` by at most one pixel each way (9 shifts)."""
    ref = np.stack(kept).astype(np.int16)                                      # (m, S, S)
    cand = np.stack([np.roll(img, s, axis=(0, 1)) for s in _SHIFTS]).astype(np.int16)
    return np.abs(cand[:, None] - ref[None]).mean(axis=(2, 3)).min(axis=0)     # (m,)


def is_near_duplicate(img: np.ndarray, kept: Sequence[np.ndarray], threshold: float) -> bool:
    """Whether ``img`` is within ``threshold`` of one of ``kept`` (the same character's earlier renderings)
    by ``shift_distance``.

    The shift: fonts sharing outlines (WenQuanYi Micro Hei is built from Droid Sans Fallback) often
    render one pixel apart after centring, which pixel equality misses (docs/evidence/data.md has the measured
    distances between related and unrelated families, `python -m data_tools.font_distances`)."""
    return bool(kept) and bool(shift_distance(img, kept).min() <= threshold)


def _show(hist: Sequence[int]) -> str:
    return ", ".join(f"{n}: {c}" for n, c in enumerate(hist) if c)


def _keep_renderings(results, faces: List[Dict], n_chars: int, side: int, near_duplicate: float):
    """Steps 4 and 6 over the faces' renderings, taken in face order so that the first face keeps a shared
    rendering: per character its kept (face number, K samples) and family keys, and the counts of
    duplicate, stand-in and near-duplicate renderings dropped."""
    seen: List[set] = [set() for _ in range(n_chars)]
    per_char: List[List[Tuple[int, bytes]]] = [[] for _ in range(n_chars)]     # (face number, K samples)
    char_keys: List[set] = [set() for _ in range(n_chars)]
    dropped_dupes = dropped_standins = dropped_near = 0
    kept_clean: List[List[np.ndarray]] = [[] for _ in range(n_chars)]     # clean renderings (near-duplicate check)
    for face_no, rows, standins in results:
        dropped_standins += standins
        for ci, digest, blob in rows:
            if digest in seen[ci]:
                dropped_dupes += 1
                continue
            seen[ci].add(digest)
            if near_duplicate:
                img = np.frombuffer(blob, np.uint8, count=side * side).reshape(side, side)
                if is_near_duplicate(img, kept_clean[ci], near_duplicate):
                    dropped_near += 1
                    continue
                kept_clean[ci].append(img)
            per_char[ci].append((face_no, blob))
            char_keys[ci].add(faces[face_no]["key"])
    return per_char, char_keys, (dropped_dupes, dropped_standins, dropped_near)


def _concatenate(per_char, keep_char, extra, chars, k: int, side: int, min_samples: int, n_faces: int):
    """The kept characters' samples (with their top-up ones) as one array, their labels, and the samples kept
    per face. Each character's renderings are let go once copied, so the array is the only copy kept."""
    kept = [0] * n_faces
    samples, labels = [], []
    for ci, rows in enumerate(per_char):
        if not keep_char[ci]:
            continue
        for face_no, b in rows:
            samples.append(np.frombuffer(b, np.uint8).reshape(k, side, side))
            kept[face_no] += k
        if ci in extra:
            samples.append(np.frombuffer(extra.pop(ci), np.uint8).reshape(-1, side, side))
        labels.extend([chars[ci]] * (k * len(rows) + max(0, min_samples - k * len(rows))))
        per_char[ci] = None
    arr = np.concatenate(samples) if samples else np.zeros((0, side, side), np.uint8)
    return arr, labels, kept


@register_importer("fonts")
def import_fonts(source: Optional[str] = None, *, charset: str = "gb2312-1", size: Optional[Sequence[int]] = None,
                 samples_per_font: int = 1, font_dir: Optional[str] = None, max_fonts: Optional[int] = None,
                 max_chars: Optional[int] = None, seed: int = 0, workers: Optional[int] = None,
                 min_fonts: int = 1, min_families: int = 1, faces_per_family: Optional[int] = None,
                 near_duplicate: float = 0.0, min_samples: int = 0, font_list: Optional[str] = None,
                 progress: bool = True, **_) -> ImportedData:
    """``source`` (optional) is a charset name or file, like ``--charset``; ``font_list`` a file naming the
    only faces to render (``read_font_list``)."""
    side = int(size[0]) if size else 64
    if size and len(size) == 2 and size[0] != size[1]:
        raise ValueError("fonts renders square images; pass --size S")
    chars = load_charset(source or charset)[: max_chars or None]
    faces = list_faces(find_font_files(font_dir))
    if font_list:
        faces = pick_faces(faces, read_font_list(font_list), font_list)
    faces = limit_faces_per_family(select_families(faces, max_fonts), faces_per_family)
    if not faces:
        raise ValueError(f"no font faces found ({'--font-dir ' + font_dir if font_dir else 'fc-list'}); "
                         f"run `bash scripts/setup/install.sh --fonts` or pass --font-dir")
    cmap_hist = histogram(cmap_families(faces, chars))
    if progress:
        print(f"fonts: {len(chars)} characters, {len(faces)} faces of {len({f['key'] for f in faces})} "
              f"family keys; characters by families whose cmap has them: {_show(cmap_hist)}", flush=True)
    _TASK.update(chars=chars, size=side, samples_per_font=max(1, samples_per_font), seed=seed)
    k = max(1, samples_per_font)
    results = pmap(_render_face, list(enumerate(faces)), workers or default_workers(), "render fonts",
                   chunksize=1, progress=progress)
    per_char, char_keys, (dropped_dupes, dropped_standins, dropped_near) = _keep_renderings(
        results, faces, len(chars), side, near_duplicate)
    family_hist = histogram([len(s) for s in char_keys])
    keep_char = [len(b) >= min_fonts and len(char_keys[ci]) >= min_families for ci, b in enumerate(per_char)]
    top_up = [(ci, per_char[ci], min_samples - k * len(per_char[ci])) for ci in range(len(chars))
              if keep_char[ci] and k * len(per_char[ci]) < min_samples]
    extra = dict(zip([t[0] for t in top_up],
                     pmap(_top_up, top_up, workers or default_workers(), "top up samples", progress=progress)))
    arr, labels, kept = _concatenate(per_char, keep_char, extra, chars, k, side, min_samples, len(faces))
    del per_char
    from hvd_partialfc.data.shards import sha256_file
    used = [dict(f, samples=kept[i], sha256=sha256_file(f["file"])) for i, f in enumerate(faces) if kept[i]]
    source_info = {"format": "fonts", "charset": source or charset, "charset_size": len(chars),
                   "size": side, "samples_per_font": k, "seed": seed, "min_fonts": min_fonts,
                   "min_families": min_families, "faces_per_family": faces_per_family or 0,
                   "font_list": os.path.basename(font_list) if font_list else None,
                   "faces_found": len(faces), "faces_used": len(used),
                   "families_used": len(sorted({f["family"] for f in used})),
                   "family_keys_used": len(sorted({f["key"] for f in used})),
                   "duplicate_renderings_dropped": dropped_dupes, "standin_renderings_dropped": dropped_standins,
                   "near_duplicate": near_duplicate, "near_duplicate_renderings_dropped": dropped_near,
                   "characters_dropped": keep_char.count(False),
                   "min_samples": min_samples, "top_up_samples": sum(t[2] for t in top_up),
                   "cmap_family_histogram": cmap_hist, "family_histogram": family_hist, "fonts": used,
                   "built_with": built_with()}
    return ImportedData("images", arr, labels, source_info, sample_shape=[side, side])
