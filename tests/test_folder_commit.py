"""Folder commits (`hvd_partialfc.atomic.commit_folder` / `recover_folder`): a crash at any rename leaves,
after `recover_folder`, the whole old folder or the whole new one, never nothing; and the shard builders
(in-memory and streaming) no longer delete an existing set before the new one is in place. File commits
(`atomic_path`) create their temporary file exclusively: a link planted at a guessable name is not followed.
Plain pytest, CPU, seconds."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from hvd_partialfc import atomic
from hvd_partialfc.atomic import commit_folder, recover_folder
from hvd_partialfc.data.shards import ShardError, check_shard_file, read_manifest

OLD = {"a.txt": b"old a", "sub/b.txt": b"old b", "sub/deep/c.bin": b"\0old"}
NEW = {"a.txt": b"new a", "n.txt": b"new n", "sub/b.txt": b"new b"}


def write_tree(root, files) -> str:
    for rel, data in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)


def read_tree(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return out


class Crash(OSError):
    pass


def crashing_renames(monkeypatch, k: int, kill: bool):
    """os.rename and os.replace fail at their k-th call (together counted); ``kill``: and at every later
    call (a killed process does nothing more, no rollback either)."""
    calls = [0]
    real = {"rename": os.rename, "replace": os.replace}

    def make(name):
        def fn(src, dst, *a, **kw):
            calls[0] += 1
            if calls[0] == k or (kill and calls[0] > k):
                raise Crash(f"crash at {name} call {calls[0]}: {src} -> {dst}")
            return real[name](src, dst, *a, **kw)
        return fn
    monkeypatch.setattr(os, "rename", make("rename"))
    monkeypatch.setattr(os, "replace", make("replace"))
    return calls


def count_renames(tmp_path, monkeypatch, with_old: bool) -> int:
    final, partial = tmp_path / "count" / "final", tmp_path / "count" / "final.partial"
    if with_old:
        write_tree(final, OLD)
    write_tree(partial, NEW)
    calls = crashing_renames(monkeypatch, 0, False)
    commit_folder(str(partial), str(final))
    monkeypatch.undo()
    assert read_tree(final) == NEW and not os.path.exists(str(final) + ".old") and not partial.exists()
    return calls[0]


@pytest.mark.parametrize("with_old", [True, False], ids=["replace", "fresh"])
@pytest.mark.parametrize("kill", [False, True], ids=["raise", "kill"])
def test_crash_at_every_rename_leaves_old_or_new(tmp_path, monkeypatch, with_old, kill):
    n = count_renames(tmp_path, monkeypatch, with_old)
    assert n == (2 if with_old else 1)
    for k in range(1, n + 2):              # k = n + 1: no crash
        root = tmp_path / f"k{k}"
        final, partial = root / "final", root / "final.partial"
        if with_old:
            write_tree(final, OLD)
        write_tree(partial, NEW)
        crashing_renames(monkeypatch, k, kill)
        try:
            commit_folder(str(partial), str(final))
            crashed = False
        except Crash:
            crashed = True
        monkeypatch.undo()
        assert crashed == (k <= n)
        recover_folder(str(final))         # the owner's next start
        got = read_tree(final) if final.exists() else None
        assert got in ((OLD if with_old else None), NEW), f"k={k}: {got}"
        if with_old and not kill:
            assert got == OLD if crashed else got == NEW    # a raising rename is rolled back at once
        assert not os.path.exists(str(final) + ".old")
        if got != NEW:
            assert read_tree(partial) == NEW               # the caller's to retry or remove


def test_crash_while_deleting_the_old_folder(tmp_path, monkeypatch):
    """Killed half-way through deleting ``final.old``: the new folder is in place; recovery finishes."""
    final, partial = tmp_path / "final", tmp_path / "final.partial"
    write_tree(final, OLD)
    write_tree(partial, NEW)
    real = shutil.rmtree

    def half(path, *a, **kw):
        os.unlink(os.path.join(path, "a.txt"))
        raise Crash("killed in rmtree")
    monkeypatch.setattr(shutil, "rmtree", half)
    with pytest.raises(Crash):
        commit_folder(str(partial), str(final))
    monkeypatch.setattr(shutil, "rmtree", real)
    assert read_tree(final) == NEW and os.path.isdir(str(final) + ".old")
    recover_folder(str(final))
    assert read_tree(final) == NEW and not os.path.exists(str(final) + ".old")


def test_recover_folder(tmp_path):
    final = tmp_path / "set"
    recover_folder(str(final))                                     # nothing there: nothing to do
    assert not final.exists()
    write_tree(str(final) + ".old", OLD)                           # crash between the two renames
    write_tree(str(final) + ".partial", NEW)
    recover_folder(str(final))
    assert read_tree(final) == OLD and not os.path.exists(str(final) + ".old")
    assert read_tree(str(final) + ".partial") == NEW               # a partial folder is its owner's business
    write_tree(str(final) + ".old", {"x": b"stale"})               # crash after the new one was in place
    recover_folder(str(final))
    assert read_tree(final) == OLD and not os.path.exists(str(final) + ".old")
    commit_folder(str(final) + ".partial", str(final))
    assert read_tree(final) == NEW


def test_commit_over_a_stale_old_folder(tmp_path):
    """A ``.old`` left by an earlier crash does not block the next commit (recovered first)."""
    final = tmp_path / "set"
    write_tree(final, OLD)
    write_tree(str(final) + ".old", {"x": b"stale"})
    write_tree(str(final) + ".partial", NEW)
    commit_folder(str(final) + ".partial", str(final))
    assert read_tree(final) == NEW and not os.path.exists(str(final) + ".old")


# --- file commits ------------------------------------------------------------------------------------------

def test_atomic_write_does_not_follow_a_planted_link(tmp_path):
    """Another user of a shared output folder plants links at every name the old code could pick
    (``.NAME.tmp-PID``) and at the new code's prefix: the victim's file is untouched, and the write lands
    in a regular file of its own (the old code wrote the victim's file and renamed the link onto NAME)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"victim's data")
    shared = tmp_path / "shared"
    shared.mkdir()
    pid = os.getpid()
    for name in (f".ckpt.pt.tmp-{pid}", f".ckpt.pt.tmp-{pid}-0000000000000000"):
        os.symlink(victim, shared / name)
    atomic.write_bytes(str(shared / "ckpt.pt"), b"checkpoint")
    assert victim.read_bytes() == b"victim's data"
    assert not os.path.islink(shared / "ckpt.pt") and (shared / "ckpt.pt").read_bytes() == b"checkpoint"
    assert sorted(os.listdir(shared)) == sorted(["ckpt.pt", f".ckpt.pt.tmp-{pid}",
                                                 f".ckpt.pt.tmp-{pid}-0000000000000000"])


def test_atomic_temporaries_are_exclusive(tmp_path, monkeypatch):
    """A name already taken (a file or a link) is never reused: creation is O_EXCL, a new name is drawn."""
    draws = iter(["taken", "free", "inner"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(draws))
    taken = tmp_path / f".f.tmp-{os.getpid()}-taken"
    os.symlink(tmp_path / "elsewhere", taken)                   # a dangling link: O_CREAT alone would follow it
    with atomic.atomic_path(str(tmp_path / "f")) as tmp:
        assert (tmp_path / f".f.tmp-{os.getpid()}-free").is_dir()
        assert tmp.endswith("-inner") and os.path.isfile(tmp) and not os.path.islink(tmp)
        with open(tmp, "w") as f:
            f.write("x")
    assert not (tmp_path / "elsewhere").exists() and (tmp_path / "f").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["f", taken.name])     # the private folder gone
    assert (os.stat(tmp_path / "f").st_mode & 0o777) == (0o666 & ~_umask())   # as a plain open() gives


def test_a_temporary_swapped_for_a_link_while_it_is_written_overwrites_nothing(tmp_path, monkeypatch):
    """A member of a group-writable folder swaps a link to the owner's file in for the temporary between its
    exclusive create and the write (simulated: a hook on the create). The write goes to the file created, the
    link is never written through nor published, and the write fails in one line (before: the temporary was
    reopened by name, so the owner's file was overwritten and the link renamed onto the checkpoint's name)."""
    victim = tmp_path / "thesis.tex"
    victim.write_bytes(b"years of work")
    shared = tmp_path / "shared"
    shared.mkdir()
    real = atomic._create_temporary

    def create_then_swap(*args, **kwargs):
        made = real(*args, **kwargs)
        (tmp,) = [p for p in shared.iterdir() if p.name.startswith(".ckpt.pt.tmp-")]
        tmp.unlink()
        tmp.symlink_to(victim)
        return made
    monkeypatch.setattr(atomic, "_create_temporary", create_then_swap)
    with pytest.raises(OSError, match="ckpt.pt: its temporary file .* was replaced while it was written"):
        atomic.write_bytes(str(shared / "ckpt.pt"), b"a checkpoint")
    assert victim.read_bytes() == b"years of work"
    assert list(shared.iterdir()) == []                 # the link removed (not what it points to), nothing published


# Another user's swap, run as that user: every temporary of shard.h5 in the shared folder replaced by a link, a
# folder renamed away first ($1 the shared folder, $2 the owner's file, $3 another of the owner's folders).
SWAP = """for e in "$1"/.shard.h5.tmp-*; do
  if [ -d "$e" ] && [ ! -L "$e" ]; then mv "$e" "$1/moved-away" && ln -s "$3" "$e"
  else rm -f "$e" && ln -s "$2" "$e"; fi
done"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"),
                    reason="acting as another user (runuser -u nobody) needs root")
def test_a_by_name_writer_writes_where_no_one_else_can_swap_anything():
    """h5py writes its temporary by name. In an output folder every user may change (0777, as a group-writable one
    is to its members), ``nobody`` swaps whatever appeared there for links to the owner's files while the library
    writes: a file is replaced by a link to the owner's file, a folder renamed away and a link to another of the
    owner's folders put in its place. Nothing of the owner's is written and the shard is published (before: the
    temporary was a file in the shared folder, reopened by name, so the owner's file was overwritten)."""
    base = tempfile.mkdtemp(prefix="hvdpfc-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.chmod(base, 0o755)
        victim, victims, shared = (os.path.join(base, n) for n in ("thesis.tex", "papers", "shared"))
        with open(victim, "wb") as f:
            f.write(b"years of work")
        os.mkdir(victims)
        os.mkdir(shared)
        os.chmod(shared, 0o777)
        with atomic.atomic_path(os.path.join(shared, "shard.h5")) as tmp:
            swap = subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", SWAP, "swap", shared, victim,
                                   victims], capture_output=True, text=True)
            assert swap.returncode == 0 and os.path.islink(glob.glob(os.path.join(shared, ".shard.h5.tmp-*"))[0]), \
                swap.stderr
            with open(tmp, "wb") as f:                 # the library opens the name it was given
                f.write(b"shard")
        assert open(victim, "rb").read() == b"years of work" and os.listdir(victims) == []
        published = os.path.join(shared, "shard.h5")
        assert open(published, "rb").read() == b"shard" and not os.path.islink(published)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- the shard builders --------------------------------------------------------------------------------------

def readable(path: str, num_classes: int) -> bool:
    m = read_manifest(path)
    for i in range(len(m.shards)):
        check_shard_file(path, m, i, verify_sha256=True)
    return m.num_classes == num_classes


def fail_rename_of(monkeypatch, marker: str, kill: bool = False):
    """os.rename raises when it would move a folder whose name contains ``marker`` (the build's temporary
    folder) into place; ``kill``: every rename from then on raises too."""
    real = os.rename
    state = {"dead": False}

    def fn(src, dst, *a, **kw):
        if state["dead"] or marker in os.path.basename(os.fspath(src)):
            state["dead"] = kill
            raise Crash(f"crash renaming {src} -> {dst}")
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(os, "rename", fn)


def npz(path, classes: int, per_class: int = 6) -> str:
    rng = np.random.default_rng(classes)
    np.savez(path, features=rng.normal(size=(classes * per_class, 4)).astype(np.float32),
             labels=np.repeat(np.arange(classes), per_class))
    return str(path)


@pytest.mark.parametrize("kill", [False, True], ids=["raise", "kill"])
def test_in_memory_build_over_an_existing_set_keeps_it_on_a_crash(tmp_path, monkeypatch, kill):
    """The old code deleted ``out`` before renaming the new set in: a crash at that rename lost both."""
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    out = str(tmp_path / "set")
    build_shard_set(get_importer("npz")(npz(tmp_path / "a.npz", 6)), out, 2)
    fail_rename_of(monkeypatch, ".tmp-set-", kill)
    with pytest.raises(Crash):
        build_shard_set(get_importer("npz")(npz(tmp_path / "b.npz", 9)), out, 3, overwrite=True)
    monkeypatch.undo()
    if kill:                                   # the next build of ``out`` recovers the old set first
        with pytest.raises(ShardError, match="already exists"):
            build_shard_set(get_importer("npz")(npz(tmp_path / "b.npz", 9)), out, 3)
    assert readable(out, 6)
    assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.npz", "set"]     # no .old, no .tmp-* folder
    build_shard_set(get_importer("npz")(npz(tmp_path / "b.npz", 9)), out, 3, overwrite=True)
    assert readable(out, 9)


@pytest.mark.parametrize("kill", [False, True], ids=["raise", "kill"])
def test_streaming_build_over_an_existing_set_keeps_it_on_a_crash(tmp_path, monkeypatch, kill):
    from data_tools.bench_build import write_synthetic_rec
    from data_tools.build import BuildOptions
    from data_tools.stream import build_streaming
    from data_tools.stream_restart import resumable_dir
    src, out = str(tmp_path / "src"), str(tmp_path / "set")
    write_synthetic_rec(src, 60, 6, 0)

    def opts(**kw):
        return BuildOptions(**{"out": out, "num_shards": 2, "workers": 1, "progress": False, **kw})
    build_streaming("recordio", src, opts())
    before = read_manifest(out)
    fail_rename_of(monkeypatch, "-resumable", kill)
    with pytest.raises(Crash):
        build_streaming("recordio", src, opts(num_shards=3, overwrite=True))
    monkeypatch.undo()
    if kill:
        with pytest.raises(ShardError, match="already exists"):
            build_streaming("recordio", src, opts(num_shards=3))
    assert readable(out, 6) and read_manifest(out).shards == before.shards
    assert os.path.isdir(resumable_dir(out)) and not os.path.exists(out + ".old")
    build_streaming("recordio", src, opts(num_shards=3, overwrite=True))
    assert readable(out, 6) and read_manifest(out).num_shards == 3 and not os.path.exists(resumable_dir(out))


def test_checkpointer_recovers_a_checkpoint_left_aside_by_a_crash(tmp_path):
    """A crash between commit_folder's two renames leaves ``step-N.old`` and no ``step-N``: the next start
    (``Checkpointer.prepare``) moves it back, and ``latest`` names a complete checkpoint again."""
    from hvd_partialfc.engine.local import LocalComm
    from hvd_partialfc.run.ckpt.checkpoint import Checkpointer
    from hvd_partialfc.run_files import find_resume
    base = tmp_path / "run" / "checkpoints"
    (base / "step-00000004.old").mkdir(parents=True)
    (base / "step-00000004.old" / "meta.json").write_text("{}")
    (base / "latest").write_text("step-00000004\n")
    Checkpointer(str(tmp_path / "run"), 2, 2, LocalComm(), {}).prepare(4, log=lambda m: None)
    assert sorted(os.listdir(base)) == ["latest", "step-00000004"]
    assert find_resume(str(tmp_path / "run")).endswith("step-00000004")


# --- hvd-partialfc reshard -----------------------------------------------------------------------------------

def _two_rank_checkpoint(folder) -> str:
    """A 2-rank checkpoint written by hand (meta.json, backbone, two classifier files with momentum)."""
    import json
    import torch
    os.makedirs(folder)
    slices, names = [[0, 4], [4, 10]], []
    for r, (lo, hi) in enumerate(slices):
        names.append(f"classifier-{r:05d}-of-00002.pt")
        w = torch.arange(lo * 3, hi * 3, dtype=torch.float32).reshape(hi - lo, 3)
        torch.save({"rank": r, "world_size": 2, "label_start": lo, "label_end": hi, "weight": w,
                    "optimizer": {"state": {0: {"momentum_buffer": -w}}, "param_groups": [{"lr": 0.1}]}},
                   os.path.join(folder, names[-1]))
    torch.save({"state_dict": {"x": torch.ones(5)}}, os.path.join(folder, "backbone.pt"))
    meta = {"format_version": 2, "step": 3, "world_size": 2, "slices": slices, "shard_slices": slices,
            "classifier_files": names, "digests": ["d", "d"], "config": {"head": {"mode": "local"}}}
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(folder)


@pytest.mark.parametrize("stage", ["copy", 1, 2, 3])
def test_reshard_killed_at_any_stage_leaves_nothing_and_reruns(tmp_path, monkeypatch, stage):
    """Killed while copying the backbone, or at the k-th rename (the classifier file's, meta.json's, the
    folder's): no OUT, or a complete one; a later run removes the stale ``.partial`` (here also holding
    another world size's file from an earlier attempt) instead of publishing it with its own files."""
    import torch
    from hvd_partialfc.run.ckpt import reshard
    src = _two_rank_checkpoint(tmp_path / "src")
    clean = reshard.reshard_checkpoint(src, str(tmp_path / "clean"), 1)
    out, partial = str(tmp_path / "out"), str(tmp_path / "out.partial")
    os.makedirs(partial)
    write_tree(partial, {"classifier-00003-of-00004.pt": b"an earlier attempt at 4 ranks"})
    if stage == "copy":
        def half_copy(a, b):
            with open(a, "rb") as f, open(b, "wb") as g:
                g.write(f.read()[:10])
            raise Crash("killed while copying")
        monkeypatch.setattr(reshard.shutil, "copyfile", half_copy)
    else:
        crashing_renames(monkeypatch, stage, kill=True)
    with pytest.raises(Crash):
        reshard.reshard_checkpoint(src, out, 1)
    monkeypatch.undo()
    assert not os.path.exists(out) and os.path.isdir(partial)
    reshard.reshard_checkpoint(src, out, 1)
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean)) == \
        ["backbone.pt", "classifier-00000-of-00001.pt", "meta.json"]
    assert not os.path.exists(partial)
    assert read_tree(out)["backbone.pt"] == read_tree(clean)["backbone.pt"]
    got, want = (torch.load(os.path.join(d, "classifier-00000-of-00001.pt"), weights_only=True) for d in (out, clean))
    assert torch.equal(got["weight"], want["weight"])
    assert torch.equal(got["weight"][4:], torch.arange(12, 30.).reshape(6, 3))       # rank 1's rows
