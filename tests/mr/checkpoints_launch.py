"""tests/test_checkpoints.py's two-rank work under ONE ``horovodrun`` launch (one Horovod start-up), item by
item, each into its own folder ``OUT/<name>``:

* ``{"scenario": NAME}``: ``ckpt_scenarios.py``'s scenario NAME, as ``ckpt_scenarios.py NAME SHARDS OUT/NAME``
  would run it (it writes ``OUT/NAME/rank-<r>.json``);
* ``{"train": NAME, "args": [...], "expect_error": bool}``: ``hvd-partialfc train ARGS`` (``cli.main``, the
  console script's code; ``{rank}`` in an argument becomes the rank, for node-local folders). It writes
  ``OUT/NAME/rank-<r>.log`` (what it printed) and ``OUT/NAME/rank-<r>.result.json`` (``{"code": its exit
  code, "seconds": its wall time}``). Horovod is not
  shut down after it (``Comm.shutdown`` does nothing here), so the next item can use it.

    python checkpoints_launch.py SPEC.json      # SPEC: {"shards": ..., "out": ..., "items": [...]}

The loop is engines_launch.run_items (the engine horovodrun implies). Each item that ends as expected leaves ``OUT/NAME/done-rank-<r>``; one that does not ends the process at once
(non-zero: the launcher stops the other rank, nothing waits in a collective), so later items leave nothing.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import ckpt_scenarios  # noqa: E402
from engines_launch import run_items  # noqa: E402


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    run_items(spec, lambda name, comm, out: getattr(ckpt_scenarios, f"scenario_{name}")(spec["shards"], out))


if __name__ == "__main__":
    main(sys.argv[1])
