"""Two-rank work of several test files under ONE launch (``horovodrun -np 2``, Gloo or MPI): one Horovod
start-up (a launcher and two ranks: ~10 CPU-s here) for all of it, instead of one a file.

    python np2_launch.py SPEC.json      # SPEC: {"out": ..., "items": [...]}

tests/mr/engines_launch.py's items and rules (``run_items``: each item in its folder ``OUT/<name>``, an
item that ends other than expected ends the process at once, one that ends as expected leaves
``done-rank-<r>`` there), with one more kind of scenario:

* ``{"scenario": NAME, "call": "MODULE.FUNCTION", "args": [...]}``: ``FUNCTION(*args)`` of the module of
  tests/mr named (e.g. ``modes_scenarios.scenario_np2``), which starts Horovod itself (once per process:
  the engine already started here) and writes what it observed where its arguments say.

The pytest side is tests/helpers_np2.py.
"""
from __future__ import annotations

import importlib
import json
import sys

from engines_launch import run_items


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    calls = {item["scenario"]: item for item in spec["items"] if "call" in item}

    def scenario(name, comm, out):
        module, _, function = calls[name]["call"].rpartition(".")
        getattr(importlib.import_module(module), function)(*calls[name]["args"])
    run_items(spec, scenario)


if __name__ == "__main__":
    main(sys.argv[1])
