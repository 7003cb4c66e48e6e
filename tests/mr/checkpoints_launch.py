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

Each item that ends as expected leaves ``OUT/NAME/done-rank-<r>``; one that does not ends the process at once
(non-zero: the launcher stops the other rank, nothing waits in a collective), so later items leave nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import ckpt_scenarios  # noqa: E402
from hvd_partialfc import cli  # noqa: E402
from hvd_partialfc.engine import horovod as comm_lib  # noqa: E402


def _train(args, out, rank):
    t0 = time.monotonic()
    with open(os.path.join(out, f"rank-{rank}.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            code = cli.main(["train", *(a.replace("{rank}", str(rank)) for a in args)])
        except BaseException:  # noqa: BLE001 (what the console script would print on its way out)
            traceback.print_exc()
            code = 1
    with open(os.path.join(out, f"rank-{rank}.result.json"), "w") as f:
        json.dump({"code": code, "seconds": time.monotonic() - t0}, f)
    return code


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    comm_lib.Comm.shutdown = lambda self: None
    rank = comm_lib.init().rank
    for item in spec["items"]:
        name = item.get("scenario") or item["train"]
        out = os.path.join(spec["out"], name)
        os.makedirs(out, exist_ok=True)
        try:
            if "scenario" in item:
                getattr(ckpt_scenarios, f"scenario_{name}")(spec["shards"], out)
            elif (_train(item["args"], out, rank) != 0) != bool(item.get("expect_error")):
                raise RuntimeError(f"train exited other than expected (see {out}/rank-{rank}.log)")
        except Exception as e:  # noqa: BLE001
            print(f"[rank {rank}] {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        open(os.path.join(out, f"done-rank-{rank}"), "w").close()


if __name__ == "__main__":
    main(sys.argv[1])
