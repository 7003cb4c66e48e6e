"""What the one GPU call brings back, written into the results folder ``$OUT`` as it goes (docs/gpu.md, "The one
call"): a call cut at its limit brings back what is in ``$OUT`` then, so nothing may wait for the call's end.

    python -m scripts.gpu.publish WORK OUT

WORK holds ``gpu_check/`` (gpu_check.sh's results) and ``gpu_check.log``; OUT gets ``speed.json``,
``speed_table.md`` and ``face_check.json`` as they are now, ``gpu_check.tgz`` (every result and log but the
traces) and ``traces.tgz`` (the step and kernel traces; packed again only when they changed). The GPU call
brings back 8 files at most: these are 5. Each file is written beside its name and renamed over it, so a
call cut while this runs leaves the previous whole file, never half of one.

gpu_check.sh calls it at every stage's start, gpu_speed_check.py after every cell (both when
``GPU_PUBLISH_FROM`` and ``GPU_PUBLISH_TO`` are set: gpu_speed_run.sh sets them), gpu_speed_run.sh once more
at its end. Standard library only: it starts in milliseconds.
"""
from __future__ import annotations

import os
import shutil
import sys
import tarfile
from typing import List, Optional

FILES = ("speed.json", "speed_table.md", "face_check.json")
TRACES = ("trace.json", "horovod_timeline.json")


def _traces(work: str) -> List[str]:
    found = []
    for dp, dirs, files in os.walk(os.path.join(work, "gpu_check")):
        dirs.sort()
        found += [os.path.relpath(os.path.join(dp, f), work) for f in sorted(files) if f.endswith(TRACES)]
    return found


def _pack(path: str, work: str, names: List[str], keep=None) -> None:
    tmp = path + ".part"
    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:      # as `tar czf` (gzip -6)
        for name in names:
            if os.path.exists(os.path.join(work, name)):
                tar.add(os.path.join(work, name), arcname=name, filter=keep)
    os.replace(tmp, path)


def publish(work: str, out: str) -> None:
    """WORK's results into OUT now (see the module)."""
    check = os.path.join(work, "gpu_check")
    for name in FILES:
        src = os.path.join(check, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out, name + ".part"))
            os.replace(os.path.join(out, name + ".part"), os.path.join(out, name))
    _pack(os.path.join(out, "gpu_check.tgz"), work, ["gpu_check", "gpu_check.log"],
          keep=lambda info: None if info.name.endswith(TRACES) else info)
    traces = _traces(work)
    stamp = "\n".join(f"{t} {os.path.getsize(os.path.join(work, t))}" for t in traces)
    seen = os.path.join(work, "traces.packed")
    if traces and (not os.path.exists(seen) or open(seen).read() != stamp):
        _pack(os.path.join(out, "traces.tgz"), work, traces)
        with open(seen, "w") as f:
            f.write(stamp)


def publish_from_env() -> None:
    """``publish`` where the call asked for it (``GPU_PUBLISH_FROM``, ``GPU_PUBLISH_TO``), else nothing; a
    failure is said and the measuring goes on."""
    work, out = os.environ.get("GPU_PUBLISH_FROM"), os.environ.get("GPU_PUBLISH_TO")
    if work and out:
        try:
            publish(work, out)
        except OSError as e:
            print(f"publish: {e}", file=sys.stderr, flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m scripts.gpu.publish WORK OUT", file=sys.stderr)
        return 2
    publish(*args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
