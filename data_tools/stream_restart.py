"""The work folder of a streaming build, and what lets a re-run resume it (`data_tools/stream.py`).

Shards go into ``.tmp-NAME-resumable`` beside ``OUT`` (and beside the held-out set): the folder that
`hvd_partialfc.atomic.commit_folder` publishes as ``OUT`` at the end, kept after a crash on purpose (it
is what a re-run resumes; ``--overwrite`` deletes it). Each shard file is written atomically
(`hvd_partialfc.atomic.atomic_path`) and followed by a ``FILE.done.json`` record (size, sha256, samples,
skipped): a re-run trusts a shard only if its record matches the file (`done_record`), and removes a
killed writer's temporary file (`remove_partial`). ``fingerprint.json`` (options, the index digest, sizes
and mtimes of the container files) tells a changed input or option, which is refused
(`check_fingerprint`): a resumed build must not mix shards of two different builds. It stays in the
finished set, so that re-running the command of a finished build is told apart from a clash with another
set (`finished_fingerprint`). The first training-set folder also holds ``plan.json`` (what
`data_tools.assemble` needs), ``index.npz`` (the index cache, `data_tools.stream_index`) and the lock
files (`data_tools.stream_lock`).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Optional

from hvd_partialfc.atomic import write_text
from hvd_partialfc.data.shards import FORMAT, MANIFEST, ShardError, sha256_file

PLAN = "plan.json"
FINGERPRINT = "fingerprint.json"
INDEX_CACHE = "index.npz"
DONE = ".done.json"


def resumable_dir(out: str) -> str:
    """The work folder of the build of ``out``, renamed to ``out`` when the build is assembled."""
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), f".tmp-{os.path.basename(out)}-resumable")


def is_work_file(name: str) -> bool:
    """A file of the work folder that is not part of the finished shard set."""
    return name.endswith(DONE) or name in (PLAN, INDEX_CACHE) or ".tmp-" in name or name.startswith(".lock-")


def fingerprint(index, opts, shape) -> Dict[str, Any]:
    """What a resumed build must share with the one that wrote the folder: options, input, sample shape."""
    files = []
    for p in index.inputs:
        st = os.stat(p)
        files.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    options = {k: getattr(opts, k) for k in ("num_shards", "balance", "store", "size", "color", "on_error", "seed",
                                             "holdout", "holdout_shards", "compression", "chunk_samples")}
    options["check"] = bool(getattr(opts, "check", True)) or opts.store == "raw"   # raw always decodes
    options["holdout_out"] = os.path.abspath(opts.holdout_out) if opts.holdout else None
    return {"format": FORMAT + ".build", "options": options, "sample_shape": shape, "source": index.source,
            "index_sha256": index.digest(), "files": files}


def differences(old: Dict[str, Any], fp: Dict[str, Any]) -> str:
    """What differs between two fingerprints, e.g. ``option holdout_shards, index_sha256``."""
    what = [k for k in fp if old.get(k) != fp[k]]
    if "options" in what:
        what = [f"option {k}" for k in fp["options"] if old.get("options", {}).get(k) != fp["options"][k]] \
            + [w for w in what if w != "options"]
    return ", ".join(what)


def read_fingerprint(folder: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(folder, FINGERPRINT)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def finished_fingerprint(out: str) -> Optional[Dict[str, Any]]:
    """The fingerprint of the streaming build that wrote the finished set ``out``; None if ``out`` is not
    one (missing, no manifest, or written by another builder)."""
    if not os.path.isfile(os.path.join(out, MANIFEST)):
        return None
    try:
        return read_fingerprint(out)
    except ValueError:
        return None


def check_fingerprint(folder: str, fp: Dict[str, Any], out: str) -> None:
    """Record ``fp`` in a new work folder; in an existing one, refuse a different one (naming what differs)."""
    path = os.path.join(folder, FINGERPRINT)
    old = read_fingerprint(folder)
    if old is not None:
        if old != fp:
            raise ShardError(f"{out}: an unfinished build in {folder} used other inputs or options "
                             f"({differences(old, fp)} differ); re-run it with the same command, or pass "
                             f"--overwrite to start afresh")
    else:
        os.makedirs(folder, exist_ok=True)
        write_text(path, json.dumps(fp, indent=1, sort_keys=True))


def done_record(folder: str, it: Dict, verify: bool = True) -> Optional[Dict[str, Any]]:
    """The done record of a finished shard whose file still matches it (size, and sha256 if ``verify``)."""
    rec, path = os.path.join(folder, it["file"] + DONE), os.path.join(folder, it["file"])
    if not (os.path.isfile(rec) and os.path.isfile(path)):
        return None
    with open(rec, encoding="utf-8") as f:
        done = json.load(f)
    if os.path.getsize(path) != done["size"] or (verify and sha256_file(path) != done["sha256"]):
        return None
    return done


def remove_partial(folder: str, file: str) -> None:
    """Remove ``atomic_path``'s temporaries of ``file`` (``.FILE.tmp-PID-RANDOM``: its private folders, or files of
    older builds) left by a killed build; a link goes, never what it points to."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(f".{file}.tmp-"):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)


def clear_work_folder(folder: str) -> None:
    """Empty ``folder`` for a fresh build (``--overwrite``), keeping the lock files (held by this build)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.startswith(".lock-"):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
