"""Streaming shard builds: bounded memory, restartable, in parallel parts. `build_streaming`
runs the steps, each in its own module:

1. **Index** (`data_tools/stream_index.py`): one pass over the labels only, into numpy arrays (the dense
   class code and where the bytes are: RecordIO 20 bytes per sample, files 12 + the path length), saved
   in the work folder for a restarted or later part.
2. **Plan** (`data_tools/stream_plan.py`): the held-out split, renumbering and partition (``--balance``)
   from the codes alone, exactly as the in-memory path computes them; the work item of every sample.
3. **Write** (`data_tools/stream_write.py`): every shard of this part (``--part K/M``: work items
   ``K-1, K-1+M, ...``) is read by worker processes in blocks, decoded (``--store raw``) or checked
   (``encoded``), and written block by block into the shard's HDF5 file; at most ``2 * workers + 2``
   blocks are in flight, so the memory is the index plus a few blocks, whatever the sample count.
4. **Assemble** (`data_tools/assemble.py`): the manifests, and the sets moved into place. The part that
   completes the last shard does not assemble: ``build`` without parts (1/1) or
   ``hvd-partialfc-shards assemble OUT`` does. Re-running the command of a published build does nothing
   and says so (``already``); a running copy of the same part is refused (`data_tools.stream_lock`).

Used by ``build`` for the sources whose samples live in files (``recordio``, ``list``, ``imagefolder``).
Restart (`data_tools/stream_restart.py`): shards go into ``.tmp-NAME-resumable`` beside ``OUT``, each
followed by a done record; a re-run writes only what is missing, and refuses a changed input or option.
Shard bytes do not depend on the workers, the part or a restart.

Difference from the in-memory path (npz, fonts): with ``--on-error skip`` the partition is computed
before decoding, so a skipped sample still counts in ``--balance samples``; a shard that loses samples is
rewritten without them (one extra copy of that shard).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np

from hvd_partialfc.atomic import recover_folder, write_text
from hvd_partialfc.data.shards import MANIFEST, ShardError

from .assemble import assemble
from .stream_index import INDEXERS, load_index_cache, save_index_cache
from .stream_plan import make_plan
from .stream_lock import BUILD_LOCK, LOCK_PREFIX, hold, part_lock_name, running_parts
from .stream_restart import (DONE, PLAN, check_fingerprint, clear_work_folder, differences, done_record,
                             finished_fingerprint, fingerprint, remove_partial, resumable_dir)
from .stream_write import load_blocks, probe_sample_shape, set_reader, write_item


PAUSE = "HVD_PARTIALFC_BUILD_PAUSE"     # tests: stop after this many shards, said, until killed


def _pause_point(shards_done: int) -> None:
    """A test's kill point: with ``HVD_PARTIALFC_BUILD_PAUSE=N``, after this process's N-th shard the build
    says so and waits to be killed (a kill timed by polling for done records raced a fast build)."""
    if os.environ.get(PAUSE) == str(shards_done):
        print(f"build: paused after {shards_done} shards ({PAUSE})", flush=True)
        while True:
            time.sleep(60)


def build_streaming(fmt: str, source: str, opts, part: Tuple[int, int] = (1, 1)) -> Dict[str, Any]:
    """Index, plan, write this part's missing shards; with part 1/1, assemble. Returns a summary
    (``already``: every set was published by an earlier run of the same command; nothing done)."""
    k, m = part
    if opts.holdout and not opts.holdout_out:
        opts.holdout_out = opts.out.rstrip("/") + "-holdout"
    outs = [opts.out] + ([opts.holdout_out] if opts.holdout else [])
    if opts.overwrite and m > 1:
        raise ShardError("--overwrite with --part M > 1 would let one part delete what another wrote; remove "
                         f"{', '.join(outs)} and {', '.join(resumable_dir(o) for o in outs)} first")
    for path in outs:
        recover_folder(path)          # a crash while an earlier build replaced it
        if os.path.exists(path) and not opts.overwrite and finished_fingerprint(path) is None:
            raise ShardError(f"{os.path.abspath(path)} already exists (pass --overwrite to replace it)")
    t0 = time.perf_counter()
    index = None if opts.overwrite else load_index_cache(resumable_dir(opts.out), fmt, source)
    cached = index is not None
    if index is None:
        index = INDEXERS[fmt](source)
    if len(index) == 0:
        raise ShardError("no classes: the source holds no samples")
    set_reader(index)
    shape = probe_sample_shape(index, opts.size, opts.color)
    set_reader(index, store=opts.store, shape=shape, check=getattr(opts, "check", True))
    plan, labels, item = make_plan(index, opts, shape)
    t_index = time.perf_counter() - t0
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    fp = fingerprint(index, opts, shape)
    summary = {"part": part, "index_cached": cached, "shards_written": 0, "shards_resumed": 0, "seconds": 0.0,
               "index_seconds": t_index, "index_bytes": index.nbytes(),
               "index_bytes_per_sample": index.nbytes() / len(index), "samples_written": 0,
               "samples_per_s": 0.0, "manifest": None, "holdout": None, "already": False}
    if all(_published(outs, fp, opts.overwrite)):
        summary.update(assemble(opts.out))        # says so; removes lock files a killed assemble left
        return summary
    with hold(folders[0], part_lock_name(k, m), f"part {k}/{m} of {opts.out} is already running"):
        with hold(folders[0], BUILD_LOCK, f"cannot build part {k}/{m} of {opts.out}: it is being assembled",
                  shared=True):
            published = _published(outs, fp, opts.overwrite)     # again: an assemble may have ended meanwhile
            if all(published):
                _drop_lock_folder(folders[0])
                summary.update(assemble(opts.out))
                return summary
            other = [r for r in running_parts(folders[0]) if f"-of-{m}:" not in r]
            if other:
                raise ShardError(f"part {k}/{m} of {opts.out}: a part of another split is running ({'; '.join(other)})"
                                 f"; its shards overlap this split's: use one --part K/M for every part of a build")
            if opts.overwrite:
                for folder in folders:
                    clear_work_folder(folder)
            _write_part(fmt, source, opts, part, index, plan, labels, item, fp, published, summary, t0)
        if m == 1:       # the part lock stays held: a second copy of this build cannot start meanwhile
            summary.update(assemble(opts.out, overwrite=opts.overwrite))
    return summary


def _published(outs, fp, overwrite: bool) -> List[bool]:
    """Per set (training, held-out): published already by the same build (an assemble may have been
    killed between the two sets). Any other existing set is refused unless ``overwrite``."""
    out = []
    for path in outs:
        if overwrite or not os.path.exists(path):
            out.append(False)
            continue
        old = finished_fingerprint(path)
        if old != fp:
            raise ShardError(f"{os.path.abspath(path)} already exists, built with other inputs or options "
                             f"({differences(old, fp)} differ); pass --overwrite to replace it")
        out.append(True)
    return out


def _drop_lock_folder(folder: str) -> None:
    """Remove a work folder that holds nothing but lock files (made by a part that then found the build
    published); best effort."""
    try:
        names = os.listdir(folder)
        if all(n.startswith(LOCK_PREFIX) for n in names):
            for n in names:
                os.unlink(os.path.join(folder, n))
            os.rmdir(folder)
    except OSError:
        pass


def _write_part(fmt, source, opts, part, index, plan, labels, item, fp, published: List[bool], summary,
                t0) -> None:
    """Check/record the fingerprint, write this part's missing shards (of the sets not yet published)."""
    k, m = part
    folders = [resumable_dir(s["out"]) for s in plan["sets"]]
    building = [s for s, done in enumerate(published) if not done]
    for s in building:
        check_fingerprint(folders[s], fp, opts.out)
    if not summary["index_cached"]:
        save_index_cache(folders[0], fmt, source, index)
    write_text(os.path.join(folders[0], PLAN), json.dumps(plan, ensure_ascii=False))
    # A set whose work folder holds its manifest was checked and is being published by assemble: its done
    # records may be gone already, and its shards need no writing.
    writing = [s for s in building if not os.path.isfile(os.path.join(folders[s], MANIFEST))]
    mine = [j for j in range(len(plan["items"])) if j % m == k - 1 and plan["items"][j]["set"] in writing]
    todo = [j for j in mine if done_record(folders[plan["items"][j]["set"]], plan["items"][j]) is None]
    for j in todo:       # a killed writer's temporary file (only this part's shards: parts may run at once)
        remove_partial(folders[plan["items"][j]["set"]], plan["items"][j]["file"])
    bs = plan["block_samples"]

    def jobs() -> Iterator[np.ndarray]:      # runs ahead of the writer by the blocks in flight
        for j in todo:
            rows = np.flatnonzero(item == j)
            for a in range(0, len(rows), bs):
                yield rows[a:a + bs]

    blocks = load_blocks(jobs(), opts.workers)
    written = 0
    from tqdm import tqdm
    bar = tqdm(total=sum(plan["items"][j]["num_samples"] for j in todo), desc=f"part {k}/{m}", unit="sample",
               disable=not opts.progress, dynamic_ncols=True, mininterval=1.0)
    try:
        for j in todo:
            it = plan["items"][j]
            rows = np.flatnonzero(item == j)      # again (a scan of ~5 ms per 1M samples): no shared state
            folder = folders[it["set"]]
            done = write_item(os.path.join(folder, it["file"]), plan, it, labels[rows], rows, blocks, index, opts)
            write_text(os.path.join(folder, it["file"] + DONE), json.dumps(done))
            written += done["num_samples"]
            bar.update(it["num_samples"])
            _pause_point(todo.index(j) + 1)
    finally:
        blocks.close()
        bar.close()
    seconds = time.perf_counter() - t0
    summary.update(shards_written=len(todo), shards_resumed=len(mine) - len(todo), seconds=seconds,
                   samples_written=written, samples_per_s=written / seconds if seconds else float("inf"))

