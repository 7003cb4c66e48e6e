"""Importers: each turns a source format into (samples, original labels, kind, extra source info).

A small registry (`data_tools/importers/importer_registry.py`); importing this package registers every importer.
"""
from __future__ import annotations

from . import fonts, imagefolder, listfile, npz, recordio  # noqa: F401  (each registers itself)
from .importer_registry import get_importer, list_importers, register_importer

__all__ = ["get_importer", "list_importers", "register_importer"]
