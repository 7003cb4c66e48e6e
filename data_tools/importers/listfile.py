"""``list FILE``: lines ``path label`` (InsightFace ``.lst`` style).

Each non-empty line not starting with ``#`` holds an image path and a class label, separated by
whitespace; the last field is the label and everything before it the path (paths may contain spaces).
InsightFace's ``.lst`` lines ``flag<TAB>path<TAB>label`` (three tab-separated fields, first an integer) are
read too. Relative paths are resolved against the list file's folder.
"""
from __future__ import annotations

import os
from typing import Iterator, Tuple

from .importer_registry import register_importer
from ..imported import ImportedData
from ..storage import FileRef


def iter_list(path: str) -> Iterator[Tuple[str, str]]:
    """(image path, label) per entry of a list file, paths resolved against its folder; streamed."""
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            tabs = line.split("\t")
            if len(tabs) == 3 and tabs[0].strip().isdigit():       # InsightFace .lst: flag, path, label
                file, label = tabs[1], tabs[2]
            else:
                parts = line.rsplit(None, 1)
                if len(parts) != 2:
                    raise ValueError(f"{path}:{n}: expected 'path label', got {line!r}")
                file, label = parts
            file, label = file.strip(), label.strip()
            yield (file if os.path.isabs(file) else os.path.join(base, file)), label


def parse_list(path: str):
    refs, labels = [], []
    for file, label in iter_list(path):
        refs.append(FileRef(file))
        labels.append(label)
    return refs, labels


@register_importer("list")
def import_list(path: str, **_) -> ImportedData:
    refs, labels = parse_list(path)
    # Integer labels sort numerically (renumbering keeps their order); other labels sort as names.
    if labels and all(l.lstrip("-").isdigit() for l in labels):
        labels = [int(l) for l in labels]
    return ImportedData("refs", refs, labels, {"format": "list", "path": os.path.abspath(path)})
