"""One registry for the components a config or a command line names: backbones, losses, classifier modes,
source formats.

Why one: each kind had its own dict, its own "registered twice" check (or none) and its own "unknown name"
error, and they had drifted apart. A ``Registry`` is filled by the modules that define the components (a
decorator beside each one) and answers a name the way a user needs: the component, or one line that lists
the known names and the nearest one to a typo.
"""
from __future__ import annotations

from typing import Callable, Dict, Generic, List, TypeVar

from .config import did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Named components of one kind. ``what`` names the kind in errors ("backbone"); ``key`` is the config key
    written before the name ("head.mode="); ``sort``: names in alphabetical order, else in registration order
    (where the first is the default, as the method is among the classifier modes); ``suggest``: the unknown
    name's error adds the nearest known one."""

    def __init__(self, what: str, *, key: str = "", sort: bool = True, suggest: bool = True):
        self.what, self.key, self.sort, self.suggest = what, key, sort, suggest
        self.entries: Dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` as ``name``; a second component of one name is a bug, refused."""
        if name in self.entries:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self.entries[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated function or class as ``name``, and leave it as it is."""
        def deco(obj: T) -> T:
            return self.add(name, obj)
        return deco

    def names(self) -> List[str]:
        return sorted(self.entries) if self.sort else list(self.entries)

    def get(self, name: str) -> T:
        """The component registered as ``name``; an unknown name is a ValueError of one line: the known names
        (and the nearest one)."""
        if name not in self.entries:
            known = self.names()
            hint = did_you_mean(name, known) if self.suggest else ""
            raise ValueError(f"unknown {self.what} {self.key}{name!r}; known: {', '.join(known)}{hint}")
        return self.entries[name]
