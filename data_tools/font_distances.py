"""Distances between the renderings of two font families, to choose ``--near-duplicate`` (docs/evidence/data.md §4.1).

    python -m data_tools.font_distances [--size 32] [--step 97] "FAMILY KEY A,FAMILY KEY B" ...

For every ``step``-th character of the CJK main block that both families' first face (one face per
family key, as ``--faces-per-family 1`` picks it) maps, it renders both as the ``fonts`` importer does
and prints, per pair: the characters compared, how many renderings are pixel-equal, and the median,
10th and 90th percentile of ``shift_distance`` (mean absolute difference at the best shift of <= 1 px).
"""
from __future__ import annotations

import argparse
from typing import List, Optional

import numpy as np


def main(argv: Optional[List[str]] = None) -> int:
    from PIL import ImageFont
    from .importers.fonts import (_covered, find_font_files, limit_faces_per_family, list_faces, render,
                                  shift_distance)
    p = argparse.ArgumentParser(prog="python -m data_tools.font_distances", description=__doc__.split("\n")[0])
    p.add_argument("pairs", nargs="+", help='"KEY A,KEY B" (family keys, see fonts.family_key)')
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--step", type=int, default=97)
    args = p.parse_args(argv)
    faces = {f["key"]: f for f in limit_faces_per_family(list_faces(find_font_files()), 1)}
    chars = [chr(c) for c in range(0x4E00, 0xA000, args.step)]
    for pair in args.pairs:
        a, b = pair.split(",")
        if a not in faces or b not in faces:
            print(f"{pair}: not installed")
            continue
        fonts = [ImageFont.truetype(faces[k]["file"], int(round(args.size * 0.8)), index=faces[k]["index"])
                 for k in (a, b)]
        both = sorted(set(_covered(faces[a], chars)) & set(_covered(faces[b], chars)))
        imgs = [[render(f, chars[i], args.size) for f in fonts] for i in both]
        if not imgs:
            print(f"{pair}: no common character")
            continue
        d = np.array([shift_distance(x, [y])[0] for x, y in imgs])
        equal = sum(np.array_equal(x, y) for x, y in imgs)
        print(f"{a:22s} {b:22s} n={len(both):4d} equal={equal:4d} shift-distance median {np.median(d):5.1f} "
              f"p10 {np.percentile(d, 10):5.1f} p90 {np.percentile(d, 90):5.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
