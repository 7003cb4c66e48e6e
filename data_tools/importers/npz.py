"""``npz FILE``: a NumPy archive with samples and labels.

Keys: samples under ``images`` (uint8, N x H x W[ x C]) or ``features`` (float, N x F); labels under
``labels`` (any integer or string labels); optional ``class_names`` (names indexed by the original
integer label).
"""
from __future__ import annotations

import numpy as np

from .importer_registry import register_importer
from ..imported import ImportedData


@register_importer("npz")
def import_npz(path: str, **_) -> ImportedData:
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if "labels" not in keys:
            raise ValueError(f"{path}: no 'labels' array (has: {', '.join(sorted(keys))})")
        if "images" in keys:
            kind, samples = "images", z["images"]
            if samples.dtype != np.uint8:
                raise ValueError(f"{path}: 'images' must be uint8, got {samples.dtype}")
        elif "features" in keys:
            kind, samples = "features", z["features"].astype(np.float32, copy=False)
        else:
            raise ValueError(f"{path}: no 'images' or 'features' array (has: {', '.join(sorted(keys))})")
        labels = z["labels"]
        names = [str(n) for n in z["class_names"]] if "class_names" in keys else None
    if len(samples) != len(labels):
        raise ValueError(f"{path}: {len(samples)} samples but {len(labels)} labels")
    if labels.ndim != 1:
        raise ValueError(f"{path}: labels must be 1-D, got shape {labels.shape}")
    original = [names[int(l)] if names is not None else str(l) for l in labels.tolist()] \
        if names is not None else labels
    return ImportedData(kind=kind, samples=samples, labels=original, source={"format": "npz", "path": path})
