"""``imagefolder DIR``: one subfolder per class, the torchvision ``ImageFolder`` convention.

The class name is the subfolder name; files with an image extension are taken recursively inside each
class folder, in sorted order (so the output does not depend on the file system's listing order). A class
folder without any image file is an error (a class that silently disappears would shift every later label).
"""
from __future__ import annotations

import os

from .importer_registry import register_importer
from ..imported import ImportedData
from ..storage import FileRef

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def image_files(folder: str):
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        out.extend(os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS))
    return out


@register_importer("imagefolder")
def import_imagefolder(path: str, **_) -> ImportedData:
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a folder (imagefolder expects DIR/CLASS/IMAGE files)")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and not d.startswith("."))
    if not classes:
        raise ValueError(f"{path}: no class subfolders (imagefolder expects DIR/CLASS/IMAGE files)")
    refs, labels = [], []
    for c in classes:
        files = image_files(os.path.join(path, c))
        if not files:
            raise ValueError(f"{path}: class folder {c!r} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
        refs.extend(FileRef(f) for f in files)
        labels.extend([c] * len(files))
    return ImportedData("refs", refs, labels, {"format": "imagefolder", "path": os.path.abspath(path)},
                        classes=classes)
