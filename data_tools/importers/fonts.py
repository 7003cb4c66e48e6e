"""``fonts``: the default data set — CJK characters rendered from the installed fonts (one class per
character, one sample per (character, font face) and augmentation).

Pipeline:

1. **Faces.** Font files come from fontconfig (``fc-list``) or from ``--font-dir`` (recursively; ``.ttf``,
   ``.otf``, ``.ttc``/``.otc``), sorted by path; a collection contributes each of its faces (by index).
   A face's family is its typographic family name (name ID 16, else 1): e.g. all seven weights of
   "Noto Sans CJK SC" are one family. ``--max-fonts K`` keeps the first K families (whole families).
2. **Coverage.** A face is used for a character only when its cmap maps the character to a glyph other
   than ``.notdef`` (read with fontTools) *and* the rendering has ink and differs from the face's own
   ``.notdef`` box: no blank squares, no tofu.
3. **Rendering.** Pillow/FreeType, white on black, grayscale ``size`` x ``size``, glyph bounding box
   centred, font size 0.8 x ``size``. One task per face, in worker processes.
4. **Duplicates.** Within a character, a rendering byte-identical to one from an earlier face (e.g. the
   JP and SC faces of one collection sharing a glyph) is dropped, with its augmentations.
5. **Augmentation** (``--samples-per-font K`` > 1): sample 0 is the clean rendering, samples 1..K-1 apply
   a small random affine map (rotation, scale, shear, shift), stroke thickening or thinning, blur and
   noise, from a generator seeded by (seed, code point, face, k): the same options give the same bytes
   whatever the number of workers.

The class name of each class is the character itself; the manifest's ``source`` lists every face used
(file, index, family, style, samples kept).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import register_importer
from ..build import ImportedData
from ..charsets import load_charset
from ..storage import default_workers, pmap

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


def list_faces(files: Sequence[str]) -> List[Dict]:
    """Every face of every file: {file, index, family, style}, in (file, index) order."""
    from fontTools.ttLib import TTCollection, TTFont
    faces = []
    for path in files:
        try:
            n = len(TTCollection(path, lazy=True).fonts) if path.lower().endswith((".ttc", ".otc")) else 1
            for i in range(n):
                names = TTFont(path, fontNumber=i, lazy=True)["name"]
                family = names.getDebugName(16) or names.getDebugName(1) or os.path.basename(path)
                style = names.getDebugName(17) or names.getDebugName(2) or ""
                faces.append({"file": path, "index": i, "family": family, "style": style})
        except Exception:  # noqa: BLE001 - an unreadable font file is skipped, not fatal
            continue
    return faces


def _covered(face: Dict, chars: Sequence[str]) -> List[int]:
    """Indices of the characters the face's cmap maps to a real glyph."""
    import logging
    from fontTools.ttLib import TTFont
    logging.getLogger("fontTools").setLevel(logging.ERROR)
    cmap = TTFont(face["file"], fontNumber=face["index"], lazy=True).getBestCmap() or {}
    return [i for i, ch in enumerate(chars) if cmap.get(ord(ch), ".notdef") != ".notdef"]


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


def _render_face(job: Tuple[int, Dict]) -> Tuple[int, List[Tuple[int, bytes, bytes]]]:
    """Render every covered character of one face: [(char index, sha1 of the clean render, K samples)]."""
    from PIL import ImageFont
    face_no, face = job
    chars, size, k, seed = _TASK["chars"], _TASK["size"], _TASK["samples_per_font"], _TASK["seed"]
    try:
        covered = _covered(face, chars)
        if not covered:
            return face_no, []
        font = ImageFont.truetype(face["file"], int(round(size * 0.8)), index=face["index"])
        notdef = render(font, "\U0010FFFD", size).tobytes()   # a private code point: the face's .notdef box
    except Exception:  # noqa: BLE001 - a font FreeType cannot open contributes nothing
        return face_no, []
    out = []
    for ci in covered:
        clean = render(font, chars[ci], size)
        blob = clean.tobytes()
        if not clean.any() or blob == notdef:
            continue
        samples = [clean]
        for j in range(1, k):
            rng = np.random.default_rng([seed, ord(chars[ci]), face_no, j])
            samples.append(augment(clean, rng))
        out.append((ci, hashlib.sha1(blob).digest(), np.stack(samples).tobytes()))
    return face_no, out


def select_families(faces: List[Dict], max_fonts: Optional[int]) -> List[Dict]:
    """The faces of the first ``max_fonts`` families (in face order); all faces when None."""
    if not max_fonts:
        return faces
    keep = set(list(dict.fromkeys(f["family"] for f in faces))[:max_fonts])
    return [f for f in faces if f["family"] in keep]


@register_importer("fonts")
def import_fonts(source: Optional[str] = None, *, charset: str = "gb2312-1", size: Optional[Sequence[int]] = None,
                 samples_per_font: int = 1, font_dir: Optional[str] = None, max_fonts: Optional[int] = None,
                 max_chars: Optional[int] = None, seed: int = 0, workers: Optional[int] = None,
                 min_fonts: int = 1, progress: bool = True, **_) -> ImportedData:
    """``source`` (optional) is a charset name or file, like ``--charset``."""
    side = int(size[0]) if size else 64
    if size and len(size) == 2 and size[0] != size[1]:
        raise ValueError("fonts renders square images; pass --size S")
    chars = load_charset(source or charset)[: max_chars or None]
    faces = select_families(list_faces(find_font_files(font_dir)), max_fonts)
    if not faces:
        raise ValueError(f"no font faces found ({'--font-dir ' + font_dir if font_dir else 'fc-list'}); "
                         f"run `bash launch/install.sh --fonts` or pass --font-dir")
    _TASK.update(chars=chars, size=side, samples_per_font=max(1, samples_per_font), seed=seed)
    k = max(1, samples_per_font)
    seen: List[set] = [set() for _ in chars]
    per_char: List[List[bytes]] = [[] for _ in chars]
    kept = [0] * len(faces)
    dropped_dupes = 0
    results = pmap(_render_face, list(enumerate(faces)), workers or default_workers(), "render fonts",
                   chunksize=1, progress=progress)
    for face_no, rows in results:          # in face order: the first face keeps a shared rendering
        for ci, digest, blob in rows:
            if digest in seen[ci]:
                dropped_dupes += 1
                continue
            seen[ci].add(digest)
            per_char[ci].append(blob)
            kept[face_no] += k
    samples, labels = [], []
    for ci, blobs in enumerate(per_char):
        if len(blobs) < min_fonts:
            continue
        for b in blobs:
            samples.append(np.frombuffer(b, np.uint8).reshape(k, side, side))
            labels.extend([chars[ci]] * k)
    arr = np.concatenate(samples) if samples else np.zeros((0, side, side), np.uint8)
    used = [dict(f, samples=kept[i]) for i, f in enumerate(faces) if kept[i]]
    source_info = {"format": "fonts", "charset": source or charset, "charset_size": len(chars),
                   "size": side, "samples_per_font": k, "seed": seed, "min_fonts": min_fonts,
                   "faces_found": len(faces), "faces_used": len(used),
                   "families_used": len(sorted({f["family"] for f in used})),
                   "duplicate_renderings_dropped": dropped_dupes,
                   "characters_dropped": sum(1 for b in per_char if len(b) < min_fonts), "fonts": used}
    return ImportedData("images", arr, labels, source_info, sample_shape=[side, side])
