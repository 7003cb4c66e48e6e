"""`assemble` of a streaming build: killed at any point and run again, it ends with the
bytes of an uninterrupted assemble; it refuses an existing set without --overwrite and a shard whose
sha256 differs from its record; running copies of a part or of assemble are refused (locks); the command
of a finished build says so and exits 0. In-process on a tiny set (120 records), kills in forked
children: each test takes about a second."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal

import pytest

from data_tools.assemble import assemble
from data_tools.bench_build import write_synthetic_rec
from data_tools.build import BuildOptions
from data_tools.stream import build_streaming
from hvd_partialfc.data.shards import ShardError

MUTATIONS = ("rename", "replace", "unlink", "remove", "rmdir")    # every change assemble makes on disk


def opts(root, **kw):
    return BuildOptions(**{"out": str(root / "set"), "num_shards": 3, "holdout": 0.25, "holdout_shards": 1,
                           "workers": 1, "progress": False, **kw})


@pytest.fixture(scope="module")
def parts_done(tmp_path_factory):
    """A build in parts 1/2 + 2/2, not assembled: its work folders, kept aside under ``pristine``."""
    root = tmp_path_factory.mktemp("asm")
    write_synthetic_rec(str(root / "src"), 120, 12, 0)
    for k in (1, 2):
        build_streaming("recordio", str(root / "src"), opts(root), (k, 2))
    for name in (".tmp-set-resumable", ".tmp-set-holdout-resumable"):
        shutil.copytree(root / name, root / "pristine" / name)
    return root


def reset(root, old_sets: bool = False) -> None:
    """The state after both parts: only the work folders (and, with ``old_sets``, sets already there)."""
    for name in os.listdir(root):
        if name not in ("src.rec", "src.idx", "pristine"):
            p = root / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in os.listdir(root / "pristine"):
        shutil.copytree(root / "pristine" / name, root / name)
    if old_sets:
        for name in ("set", "set-holdout"):
            (root / name).mkdir()
            (root / name / "old.txt").write_text("another build's set")


def tree(root):
    """sha256 of every file under ``root`` but the input and the pristine copy: leftovers count too."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if not rel.startswith(("pristine", "src.")):
                with open(os.path.join(d, f), "rb") as fh:
                    out[rel] = hashlib.sha256(fh.read()).hexdigest()
    return out


def killed_at(k: int, fn) -> bool:
    """Run ``fn`` in a forked child that SIGKILLs itself just before its ``k``-th change on disk (a rename,
    replace, unlink or rmdir, shutil.rmtree's included): True if it was killed, False if it finished."""
    pid = os.fork()
    if pid == 0:
        try:
            count = [0]
            for name in MUTATIONS:
                def wrapped(*a, _real=getattr(os, name), **kw):
                    count[0] += 1
                    if count[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _real(*a, **kw)
                setattr(os, name, wrapped)
            fn()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, f"k={k}: the child failed ({status})"
    return os.WIFSIGNALED(status)


@pytest.mark.parametrize("old_sets", [False, True], ids=["fresh", "overwrite"])
def test_assemble_killed_at_every_step_then_rerun_gives_the_same_bytes(parts_done, old_sets):
    """Killed before each of its changes on disk in turn (13 kills fresh, 19 over old sets), then re-run
    (``assemble`` again, or the build's own command with part 1/1): every file of both sets is
    byte-identical to an uninterrupted assemble's, nothing else is left (work folders, ``.old``, locks,
    temporaries), and a third run says ``already``."""
    root = parts_done
    reset(root, old_sets)
    assemble(str(root / "set"), overwrite=old_sets)
    ref = tree(root)
    assert "set/manifest.json" in ref and "set-holdout/manifest.json" in ref and "set/old.txt" not in ref
    assert sorted(ref) == sorted(f"{s}/{f}" for s in ("set", "set-holdout") for f in os.listdir(root / s))
    k = 0
    while True:
        k += 1
        reset(root, old_sets)
        if not killed_at(k, lambda: assemble(str(root / "set"), overwrite=old_sets)):
            break
        if k % 2 or old_sets:          # (the build's command with --overwrite would rebuild all)
            assemble(str(root / "set"), overwrite=old_sets)
        else:
            assert build_streaming("recordio", str(root / "src"), opts(root))["shards_written"] == 0
        assert tree(root) == ref, f"killed before change {k}"
        assert assemble(str(root / "set"))["already"]
    assert k - 1 >= (19 if old_sets else 13), k     # kills: manifests, removals, renames, old sets' removal


def test_assemble_refuses_an_existing_set_without_overwrite(parts_done):
    root = parts_done
    reset(root)
    (root / "set-holdout").mkdir()
    (root / "set-holdout" / "mine.txt").write_text("not this build's")
    with pytest.raises(ShardError, match="set-holdout already exists.*--overwrite"):
        assemble(str(root / "set"))
    assert (root / "set-holdout" / "mine.txt").read_text() == "not this build's"
    assert not (root / "set").exists() and (root / ".tmp-set-holdout-resumable").is_dir()


def test_assemble_refuses_a_changed_shard_of_the_same_size(parts_done):
    root = parts_done
    reset(root)
    shard = root / ".tmp-set-resumable" / "shard-00001-of-00003.h5"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="differ from their done records.*shard-00001-of-00003.h5"):
        assemble(str(root / "set"))
    assert not (root / "set").exists() and not (root / "set-holdout").exists()
    r = build_streaming("recordio", str(root / "src"), opts(root), (2, 2))     # the part that wrote it
    assert r["shards_written"] == 1
    assert assemble(str(root / "set"))["manifest"].num_shards == 3


def flock(path, mode=fcntl.LOCK_EX, text=""):
    """Hold a lock as another process would (an open file of its own): the file, to close."""
    f = open(path, "a+")
    fcntl.flock(f, mode | fcntl.LOCK_NB)
    if text:
        f.truncate(0)
        f.write(text)
        f.flush()
    return f


def test_running_copies_of_a_part_or_assemble_are_refused(parts_done):
    root = parts_done
    reset(root)
    work = root / ".tmp-set-resumable"
    (work / "shard-00000-of-00003.h5.done.json").unlink()              # part 1/2 has work left
    partial = work / ".shard-00000-of-00003.h5.tmp-4242"
    partial.write_bytes(b"being written by the running copy")
    held = flock(work / ".lock-part-1-of-2", text="pid 4242 on host nodeA since 12:00 (build ...)")
    with pytest.raises(ShardError, match="part 1/2 .* already running: pid 4242 on host nodeA"):
        build_streaming("recordio", str(root / "src"), opts(root), (1, 2))
    assert partial.exists()                                            # the running copy's file is left alone
    with pytest.raises(ShardError, match="another split is running"):
        build_streaming("recordio", str(root / "src"), opts(root), (1, 1))
    # A part running (shared build lock): assemble is refused, naming it.
    shared = flock(work / ".lock-build", fcntl.LOCK_SH)
    with pytest.raises(ShardError, match="parts of the build are still running.*part-1-of-2: pid 4242"):
        assemble(str(root / "set"))
    shared.close()
    held.close()          # the copy ends (or dies: the kernel drops its lock)
    # Another assemble running (exclusive): refused too.
    other = flock(work / ".lock-build", text="pid 77 on host nodeB")
    with pytest.raises(ShardError, match="cannot assemble .* pid 77 on host nodeB"):
        assemble(str(root / "set"))
    other.close()
    pid = os.fork()                 # a copy killed while it holds the part's lock leaves no stale lock
    if pid == 0:
        flock(work / ".lock-part-1-of-2", text="pid of a dead copy")
        os.kill(os.getpid(), signal.SIGKILL)
    assert os.WIFSIGNALED(os.waitpid(pid, 0)[1])
    assert (work / ".lock-part-1-of-2").read_text() == "pid of a dead copy"
    r = build_streaming("recordio", str(root / "src"), opts(root), (1, 2))
    assert r["shards_written"] == 1 and not partial.exists()
    assert not assemble(str(root / "set"))["already"]


def test_rerunning_a_finished_build_says_so_and_exits_0(tmp_path, capsys):
    from data_tools.shards_cli import main
    write_synthetic_rec(str(tmp_path / "src"), 60, 6, 0)
    cmd = ["build", "recordio", str(tmp_path / "src"), "--out", str(tmp_path / "o"), "--num-shards", "2",
           "--workers", "1", "--holdout", "0.34"]
    assert main(cmd) == 0
    before = {f: os.stat(tmp_path / "o" / f).st_mtime_ns for f in os.listdir(tmp_path / "o")}
    capsys.readouterr()
    assert main(cmd) == 0
    assert "already built by this command" in capsys.readouterr().out
    assert main(["assemble", str(tmp_path / "o")]) == 0
    assert "already assembled" in capsys.readouterr().out
    assert {f: os.stat(tmp_path / "o" / f).st_mtime_ns for f in os.listdir(tmp_path / "o")} == before
    assert main([("3" if a == "2" else a) for a in cmd]) == 2                   # another build: refused
    assert "option num_shards differ" in capsys.readouterr().err
