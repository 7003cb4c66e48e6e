"""``--font-list``: the ``fonts`` importer's faces pinned by name, so that a data set built on two machines
with the same font packages renders from the same faces whatever else each has installed (the demo's list is
configs/demo_fonts.txt)."""
from __future__ import annotations

from typing import Dict, List, Sequence


def read_font_list(path: str) -> List[str]:
    """The face names of a ``--font-list`` file: one "Family" or "Family:Style" a line; blank lines and
    ``#`` comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
    except OSError as e:
        raise ValueError(f"--font-list {path}: {e.strerror}") from e
    return [line for line in lines if line]


def pick_faces(faces: List[Dict], names: Sequence[str], where: str) -> List[Dict]:
    """The faces ``names`` lists ("Family": all its faces, "Family:Style": one), in face order. A data set
    that must come out the same on every machine (the demo's) renders from a fixed list, not from whatever
    fonts a machine has; a listed name that matches no installed face is an error that names it, since
    rendering without it would silently give other data."""
    wanted = set(names)
    missing = [n for n in names if not any(n in (f["family"], f"{f['family']}:{f['style']}") for f in faces)]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4]) + (f" and {len(missing) - 4} more" * (len(missing) > 4))
        raise ValueError(f"--font-list {where}: {len(missing)} of its {len(names)} faces are not installed: "
                         f"{shown}; install them (bash scripts/setup/install.sh --fonts) or pass another list")
    return [f for f in faces if f["family"] in wanted or f"{f['family']}:{f['style']}" in wanted]
