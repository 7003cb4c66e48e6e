"""Sizes as people read them: bytes in B, KB, MB, GB, TB, PB (powers of 1024). Shared by every layer."""
from __future__ import annotations


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1024 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)
