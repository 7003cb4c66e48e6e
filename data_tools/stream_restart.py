"""The work folder of a streaming build, and what lets a re-run resume it (`data_tools/stream.py`).

Shards go into ``.tmp-NAME-resumable`` beside ``OUT`` (and beside the held-out set): the folder that
`hvd_partialfc.atomic.commit_folder` publishes as ``OUT`` at the end, kept after a crash on purpose (it
is what a re-run resumes; ``--overwrite`` deletes it). Each shard file is written atomically
(`hvd_partialfc.atomic.atomic_path`) and followed by a ``FILE.done.json`` record (size, sha256, samples,
skipped): a re-run trusts a shard only if its record matches the file (`done_record`), and removes a
killed writer's temporary file (`remove_partial`). ``fingerprint.json`` (options, the index digest, sizes
and mtimes of the container files) tells a changed input or option, which is refused
(`check_fingerprint`): a resumed build must not mix shards of two different builds. The first
training-set folder also holds ``plan.json`` (what `data_tools.assemble` needs) and ``index.npz`` (the
index cache, `data_tools.stream_index`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from hvd_partialfc.atomic import write_text
from hvd_partialfc.data.shards import FORMAT, ShardError, sha256_file

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
    return name.endswith(DONE) or name in (PLAN, FINGERPRINT, INDEX_CACHE) or ".tmp-" in name


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


def check_fingerprint(folder: str, fp: Dict[str, Any], out: str) -> None:
    """Record ``fp`` in a new work folder; in an existing one, refuse a different one (naming what differs)."""
    path = os.path.join(folder, FINGERPRINT)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != fp:
            what = [k for k in fp if old.get(k) != fp[k]]
            if "options" in what:
                what = [f"option {k}" for k in fp["options"] if old.get("options", {}).get(k) != fp["options"][k]] \
                    + [w for w in what if w != "options"]
            raise ShardError(f"{out}: an unfinished build in {folder} used other inputs or options "
                             f"({', '.join(what)} differ); re-run it with the same command, or pass --overwrite "
                             f"to start afresh")
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
    """Remove ``atomic_path``'s temporary files of ``file`` (``.FILE.tmp-PID-RANDOM``) left by a killed build."""
    for name in os.listdir(folder):
        if name.startswith(f".{file}.tmp-"):
            os.unlink(os.path.join(folder, name))
