"""Importers: each turns a source format into (samples, original labels, kind, extra source info).

A small registry (timm-style): ``@register_importer("npz")``; unknown names raise with the known list.
"""
from __future__ import annotations

from typing import Callable, Dict

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


def list_importers():
    return sorted(_IMPORTERS)


from . import fonts, imagefolder, listfile, npz, recordio  # noqa: E402,F401
