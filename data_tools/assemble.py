"""The last step of a streaming build (`data_tools/stream.py`): manifests, and the sets moved into place.

``hvd-partialfc-shards assemble OUT`` (or a build without parts, itself) runs it once every part has
finished: it is separate because no part knows when the others are done. The manifests come from the
done records (`data_tools.stream_restart`); each work folder is then published as its set by
`hvd_partialfc.atomic.commit_folder`, the held-out set first (as the in-memory build writes them), so a
training set never appears without its held-out set, and an existing set being replaced (``--overwrite``)
is kept until the new one is in place.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict

from hvd_partialfc.atomic import commit_folder, recover_folder
from hvd_partialfc.data.shards import Manifest, ShardEntry, ShardError

from .shard_writer import write_manifest
from .stream_restart import PLAN, done_record, is_work_file, resumable_dir


def assemble(out: str) -> Dict[str, Any]:
    """Write the manifests of a build whose shards are all done (by any parts) and move the sets into
    place (the held-out set first, as the in-memory path). Checks every shard's size against its record."""
    folder = resumable_dir(out)
    plan_path = os.path.join(folder, PLAN)
    if not os.path.isfile(plan_path):
        raise ShardError(f"{out}: no unfinished build to assemble ({plan_path} is missing)")
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    dones = [done_record(folders[it["set"]], it, verify=False) for it in plan["items"]]
    missing = [it["file"] for it, d in zip(plan["items"], dones) if d is None]
    if missing:
        raise ShardError(f"{out}: {len(missing)} shards are not written yet ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}); run the missing parts of the build first")
    manifests = []
    for s, st in enumerate(plan["sets"]):
        entries, skipped = [], []
        for it, d in zip(plan["items"], dones):
            if it["set"] == s:
                entries.append(ShardEntry(it["file"], it["label_start"], it["label_end"], d["num_samples"],
                                          d["sha256"]))
                skipped += d["skipped"]
        manifests.append(Manifest(num_classes=st["num_classes"], kind=plan["kind"], sample_shape=plan["sample_shape"],
                                  sample_dtype="uint8", shards=entries, partition=st["partition"],
                                  class_names=st["class_names"], source=st["source"], skipped=skipped))
    for s in reversed(range(len(plan["sets"]))):       # held-out set first
        folder, target = folders[s], plan["sets"][s]["out"]
        recover_folder(target)
        for name in os.listdir(folder):
            if is_work_file(name):
                os.unlink(os.path.join(folder, name))
        write_manifest(folder, manifests[s])
        commit_folder(folder, target)
    return {"manifest": manifests[0], "holdout": manifests[1] if len(manifests) > 1 else None}
