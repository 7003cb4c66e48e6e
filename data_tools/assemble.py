"""The last step of a streaming build (`data_tools/stream.py`): manifests, and the sets moved into place.

``hvd-partialfc-shards assemble OUT`` (or a build without parts, itself) runs it once every part has
finished: it is separate because no part knows when the others are done. Steps, each safe to interrupt
(``kill -9`` included) and finished by running the same command again:

1. **Check**: under the build lock (exclusive: no part is writing, no other assemble runs;
   `data_tools.stream_lock`), every shard's size and sha256 against its done record
   (`data_tools.stream_restart`); a changed file is refused, named, before anything is written. An
   existing set at a target that is not this build's is refused unless ``--overwrite``.
2. **Manifests**: written (atomically) into each work folder. From here on a work folder's manifest is
   its record: a re-run does not need the done records, and does not hash its shards again.
3. **Publish**, the held-out set first (as the in-memory build writes them, so a training set never
   appears without its held-out set): the build records are removed from the work folder, then
   `hvd_partialfc.atomic.commit_folder` renames it into place (an existing set being replaced with
   ``--overwrite`` is kept until the new one is there). ``plan.json`` leaves the training set's folder
   only just before it moves, so a re-run always finds either the plan or both manifests.
4. **Locks out**: the lock files moved with the training set's folder are removed from it.

A re-run finds each set either still in its work folder (done again from where it stopped, steps 2-3
being idempotent) or published with ``fingerprint.json`` equal to the build's (left alone). When every
set is published it says so and returns (the CLI exits 0), so the command of a finished build can be
repeated. The hashing runs on threads (hashlib releases the GIL on large buffers), one per core up to 8.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from hvd_partialfc.atomic import commit_folder, recover_folder
from hvd_partialfc.data.shards import MANIFEST, Manifest, ShardEntry, ShardError, read_manifest, sha256_file

from .shard_writer import write_manifest
from .stream_lock import BUILD_LOCK, LOCK_PREFIX, hold, running_parts
from .stream_restart import (PLAN, done_record, finished_fingerprint, is_work_file, read_fingerprint,
                             resumable_dir)


def _load_json(path: str) -> Any:
    import json
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def holdout_of(out: str, manifest: Manifest) -> Optional[str]:
    """The held-out set written with the training set ``out`` (from its manifest), or None."""
    h = manifest.source.get("holdout")
    return os.path.normpath(os.path.join(out, h["path"])) if isinstance(h, dict) and "path" in h else None


def assemble(out: str, overwrite: bool = False) -> Dict[str, Any]:
    """Publish the sets of a build whose shards are all done (by any parts). Returns the manifests and
    ``already``: True when an earlier run had published everything (nothing done now)."""
    out = os.path.abspath(out)
    work = resumable_dir(out)
    recover_folder(out)                # a crash inside commit_folder: the old set back, or the new one kept
    if not os.path.isdir(work):
        return _finished(out)
    what = f"cannot assemble {out} now"
    with ExitStack() as stack:
        try:
            stack.enter_context(hold(work, BUILD_LOCK, what, make_folder=False))
        except FileNotFoundError:      # moved into place by another assemble meanwhile
            return _finished(out)
        except ShardError as e:
            parts = running_parts(work)
            raise ShardError(f"{what}: parts of the build are still running ({'; '.join(parts)})" if parts
                             else str(e)) from None
        return _assemble_locked(out, work, overwrite)


def _finished(out: str) -> Dict[str, Any]:
    """Every set published by an earlier run: check that, remove lock files a kill left in it."""
    fp = finished_fingerprint(out)
    if fp is None:
        why = "it is not a streaming build's set" if os.path.isdir(out) else "nothing there either"
        raise ShardError(f"{out}: no unfinished build to assemble ({resumable_dir(out)} is missing; {why})")
    manifest = read_manifest(out)
    hold_out = holdout_of(out, manifest)
    if hold_out is not None:
        recover_folder(hold_out)
        if finished_fingerprint(hold_out) != fp:
            raise ShardError(f"{out}: its held-out set {hold_out} is missing or from another build; rebuild "
                             f"both with --overwrite")
    for name in os.listdir(out):
        if name.startswith(LOCK_PREFIX):
            os.unlink(os.path.join(out, name))
    return {"manifest": manifest, "holdout": read_manifest(hold_out) if hold_out else None, "already": True}


def _assemble_locked(out: str, work: str, overwrite: bool) -> Dict[str, Any]:
    fp = read_fingerprint(work)
    plan_path = os.path.join(work, PLAN)
    plan = _load_json(plan_path) if os.path.isfile(plan_path) else None
    if fp is None or (plan is None and not os.path.isfile(os.path.join(work, MANIFEST))):
        raise ShardError(f"{out}: no unfinished build to assemble ({plan_path} is missing): run the build first")
    if plan is not None:
        outs = [s["out"] for s in plan["sets"]]
    else:                              # killed in step 3, after the plan left: both manifests are written
        outs = [out] + list(filter(None, [holdout_of(out, read_manifest(work))]))
    pending = [s for s, o in enumerate(outs) if os.path.isdir(resumable_dir(o))]
    for s, o in enumerate(outs):
        recover_folder(o)
        if s not in pending and finished_fingerprint(o) != fp:
            raise ShardError(f"{out}: the set {o} is neither being built ({resumable_dir(o)} is missing) nor "
                             f"published by this build; rebuild with --overwrite")
        if s in pending and os.path.exists(o) and not overwrite:
            raise ShardError(f"{o} already exists and is not this build's output (pass --overwrite to replace "
                             f"it)")
    manifests: Dict[int, Manifest] = {}
    todo = [s for s in pending if not os.path.isfile(os.path.join(resumable_dir(outs[s]), MANIFEST))]
    if todo:
        if plan is None:
            raise ShardError(f"{out}: {plan_path} is missing: re-run the build, then assemble")
        manifests.update(_checked_manifests(out, plan, todo))
    for s in todo:                                       # step 2
        write_manifest(resumable_dir(outs[s]), manifests[s])
    for s in reversed(pending):                          # step 3, held-out set first
        folder = resumable_dir(outs[s])
        for name in sorted(os.listdir(folder)):
            if is_work_file(name) and not name.startswith(LOCK_PREFIX):
                os.unlink(os.path.join(folder, name))
        commit_folder(folder, outs[s])
    for name in os.listdir(out):                         # step 4
        if name.startswith(LOCK_PREFIX):
            os.unlink(os.path.join(out, name))
    got = [read_manifest(o) for o in outs]
    return {"manifest": got[0], "holdout": got[1] if len(got) > 1 else None, "already": False}


def _checked_manifests(out: str, plan: Dict, sets: List[int]) -> Dict[int, Manifest]:
    """The manifests of ``sets`` from their done records, after checking every shard's size and sha256."""
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    items = [it for it in plan["items"] if it["set"] in sets]
    dones = [done_record(folders[it["set"]], it, verify=False) for it in items]
    missing = [it["file"] for it, d in zip(items, dones) if d is None]
    if missing:
        raise ShardError(f"{out}: {len(missing)} shards are not written yet or changed size since "
                         f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); run the missing parts "
                         f"of the build first (the same command: it rewrites a changed shard)")
    paths = [os.path.join(folders[it["set"]], it["file"]) for it in items]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        sums = list(pool.map(sha256_file, paths))
    bad = [p for p, d, h in zip(paths, dones, sums) if h != d["sha256"]]
    if bad:
        raise ShardError(f"{out}: {len(bad)} shards differ from their done records (sha256; the file changed "
                         f"after it was written): {', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}; re-run "
                         f"the build command of their parts (it rewrites them), then assemble")
    manifests = {}
    for s in sets:
        st = plan["sets"][s]
        entries, skipped = [], []
        for it, d in zip(items, dones):
            if it["set"] == s:
                entries.append(ShardEntry(it["file"], it["label_start"], it["label_end"], d["num_samples"],
                                          d["sha256"]))
                skipped += d["skipped"]
        manifests[s] = Manifest(num_classes=st["num_classes"], kind=plan["kind"], sample_shape=plan["sample_shape"],
                                sample_dtype="uint8", shards=entries, partition=st["partition"],
                                class_names=st["class_names"], source=st["source"], skipped=skipped)
    return manifests
