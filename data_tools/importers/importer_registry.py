"""The importer registry (timm-style): ``@register_importer("npz")``; unknown names raise with the known list.

Its own module so that an importer registers itself without importing the package that imports it
(`data_tools.importers` imports every importer, to fill the registry).
"""
from __future__ import annotations

from typing import Callable, Dict, List

_IMPORTERS: Dict[str, Callable] = {}


def register_importer(name: str):
    def deco(fn):
        _IMPORTERS[name] = fn
        return fn
    return deco


def get_importer(name: str) -> Callable:
    if name not in _IMPORTERS:
        raise ValueError(f"unknown source format {name!r}; known: {', '.join(sorted(_IMPORTERS))}")
    return _IMPORTERS[name]


def list_importers() -> List[str]:
    return sorted(_IMPORTERS)
