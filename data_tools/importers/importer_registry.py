"""The importer registry (timm-style): ``@register_importer("npz")``; unknown names raise with the known list.

Its own module so that an importer registers itself without importing the package that imports it
(`data_tools.importers` imports every importer, to fill the registry).
"""
from __future__ import annotations

from typing import Callable, List

from hvd_partialfc.registry import Registry

# its error keeps its words, without the nearest name (the command line's choices refuse a typo before it)
IMPORTERS: Registry[Callable] = Registry("source format", suggest=False)
register_importer = IMPORTERS.register


def get_importer(name: str) -> Callable:
    return IMPORTERS.get(name)


def list_importers() -> List[str]:
    return IMPORTERS.names()
