"""The IJB protocol's options and two alignment mistakes, side by side, on one backbone and IJB folder.

    python -m scripts.studies.ijb_variants --backbone backbone.pt --ijb data/demo-fonts/ijb [--name IJBC] [--flip]

Rows: the protocol as given (``--flip``: mirror embedding on; glyphs: leave it off), the flip toggled,
norm-score and detector-score off, the 112 px template used on a smaller input (not scaled), and no
alignment at all (every image's landmarks replaced by the template of its whole loose crop, i.e. the crop
resized). docs/evidence/evaluation.md shows its table for the glyph IJB set.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from PIL import Image

from hvd_partialfc.models.pretrained import load_backbone
from hvd_partialfc.verification import ijb
from hvd_partialfc.verification.align import ARCFACE_TEMPLATE_112, arcface_template

KEYS = ["tar@far=1e-5", "tar@far=1e-4", "tar@far=1e-3", "tar@far=1e-2", "auc"]


def unaligned_copy(root: str, name: str, out: str) -> str:
    """``root`` with every image's five points set to the template of its whole loose crop."""
    paths = ijb.meta_paths(root, name)
    mine = ijb.meta_paths(out, name)
    os.makedirs(os.path.join(out, "meta"))
    os.symlink(os.path.abspath(os.path.join(root, "loose_crop")), os.path.join(out, "loose_crop"))
    for kind in ("tid_mid", "pairs"):
        os.symlink(os.path.abspath(paths[kind]), mine[kind])
    with open(paths["5pts"]) as f, open(mine["5pts"], "w") as g:
        for line in f:
            r = line.split()
            if not r:
                continue
            with Image.open(os.path.join(root, "loose_crop", r[0])) as im:
                w, h = im.size
            g.write(f"{r[0]} " + " ".join(f"{v:.3f}" for v in arcface_template(h, w).reshape(-1)) + f" {r[-1]}\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backbone", required=True)
    p.add_argument("--ijb", required=True)
    p.add_argument("--name", default="IJBC")
    p.add_argument("--flip", action="store_true")
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args(argv)
    model, args = load_backbone(a.backbone)
    shape = args["in_shape"]
    run = lambda label, root=a.ijb, **kw: print(f"{label:<52}" + "".join(
        f"{'-' if m[k] is None else format(m[k], '.4f'):>9}" for m in [ijb.evaluate_ijb(
            model, shape, root, a.name, a.batch_size, **{"flip": a.flip, **kw})] for k in KEYS), flush=True)
    print(f"{'variant':<52}" + "".join(f"{k.replace('tar@far=', 'TAR@'):>9}" for k in KEYS))
    run(f"as given (flip {'on' if a.flip else 'off'}, norm-score, detector-score)")
    run(f"flip {'off' if a.flip else 'on'}", flip=not a.flip)
    run("norm-score off, detector-score off", norm_score=False, detector_score=False)
    run("wrong: the 112 px template, not scaled to the input", template=ARCFACE_TEMPLATE_112)
    tmp = tempfile.mkdtemp()
    try:
        run("wrong: no alignment (the loose crop resized)", unaligned_copy(a.ijb, a.name, os.path.join(tmp, "u")))
    finally:
        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
