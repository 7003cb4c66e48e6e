"""One way to write a file so that a reader never sees half of it: write a temporary file beside it,
flush and ``fsync`` it, ``os.replace`` it onto the final name, then ``fsync`` the folder.

A crash (or SIGKILL, or a full disk) at any point leaves either the old file or the new one, never a
truncated mix. The temporary file is created exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``) under a name with
the process id and 64 random bits, in the target's folder: two processes writing the same name (ranks on a
shared file system) never write into one temporary file, and in a shared output folder a link planted
at a guessed name is never followed (before: ``.NAME.tmp-PID``, opened with ``O_TRUNC``, let another user
have a checkpoint write overwrite one of the victim's files). Every file this package writes for a user
(checkpoints, manifests, pair sets, reports) goes through here. Not a collective; no Horovod.

A whole folder (a shard set, an IJB-shaped set) is committed the same way, one level up: written in full
under another name, then renamed into place by `commit_folder`, with `recover_folder` to finish at the
next start what a crash interrupted. A folder cannot be ``os.replace``d onto a non-empty one, so the old
folder is first moved aside (never deleted) and removed only once the new one is in place.
"""
from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from typing import Any, Iterator


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _create_temporary(folder: str, name: str, mode: int = 0o666) -> str:
    """Create an empty file ``.NAME.tmp-PID-RANDOM`` in ``folder`` that no other file or link was at
    (``O_EXCL``), with the mode a plain ``open`` would give (0666 less the umask; ``mkstemp``'s 0600 would
    make checkpoints unreadable to the group that shares the run folder), or ``mode`` (less the umask: 0600
    for what only its owner may read, a memory snapshot, the run's token). The ``.NAME.tmp-`` prefix is what
    a killed build's clean-up looks for (data_tools/stream_restart.py)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            os.close(os.open(tmp, _EXCLUSIVE, mode))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free temporary name for {name} in 100 tries")


@contextmanager
def atomic_path(path: str, mode: int = 0o666) -> Iterator[str]:
    """Yield the path of a new empty temporary file beside ``path`` (created exclusively, see the module
    docstring); write it (any library: h5py, torch, json); on a normal exit it is fsynced and renamed onto
    ``path``. On an exception the temporary file is removed and ``path`` is left as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _create_temporary(folder, os.path.basename(path), mode)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


def write_bytes(path: str, data: bytes, mode: int = 0o666) -> None:
    with atomic_path(path, mode) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str, text: str, mode: int = 0o666) -> None:
    with atomic_path(path, mode) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def torch_save(obj: Any, path: str) -> None:
    import torch
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


# --- folders -------------------------------------------------------------------------------------------

def old_folder(final: str) -> str:
    """Where `commit_folder` keeps the previous ``final`` while the new one moves in."""
    return os.path.abspath(os.fspath(final)) + ".old"


def _fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (bottom-up), so that the rename that publishes it
    cannot reach the disk before its content does (a crash would then show a complete-looking folder of
    empty or short files)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _fsync_file(path)
        fsync_dir(root)


def recover_folder(final: str) -> None:
    """Finish what a crash in `commit_folder` left, at the next start of whoever owns ``final``.

    ``final`` missing and ``final.old`` present: the crash came between the two renames, the old folder is
    the only complete one: it goes back. Both present: the crash came after the new folder was in place
    and before (or while) the old one was deleted: the old one goes. A ``.partial`` (or other work) folder
    is left alone: only its owner knows whether it can be resumed (a streaming build's can).
    """
    final = os.path.abspath(os.fspath(final))
    old = old_folder(final)
    if not os.path.lexists(old):
        return
    try:
        if not os.path.lexists(final):
            os.rename(old, final)
            fsync_dir(os.path.dirname(final))
        else:
            shutil.rmtree(old)
    except FileNotFoundError:
        pass                           # done meanwhile by another process of the same job (build parts)


def commit_folder(partial: str, final: str) -> None:
    """Publish the folder ``partial`` (complete: written by the caller, conventionally ``final + ".partial"``)
    as ``final``, replacing any folder there; a reader sees the whole old folder or the whole new one.

    Steps: fsync ``partial``'s files and folders; rename an existing ``final`` to ``final.old``; rename
    ``partial`` to ``final``; fsync the parent folder (the renames are durable); delete ``final.old``.
    The old folder is deleted only after the new one is in place: a crash (or SIGKILL, or a failing
    rename) before that leaves ``final.old`` complete, and `recover_folder` (called here first, and by
    the owner at its next start) moves it back. On an exception the old folder is put back at once
    (best effort; `recover_folder` does it otherwise) and ``partial`` is left for the caller.
    """
    partial, final = os.path.abspath(os.fspath(partial)), os.path.abspath(os.fspath(final))
    parent, old = os.path.dirname(final), old_folder(final)
    recover_folder(final)              # a stale .old from an earlier crash would block the first rename
    _fsync_tree(partial)
    moved = False
    try:
        if os.path.lexists(final):
            os.rename(final, old)
            moved = True
        os.rename(partial, final)
    except BaseException:
        if moved and not os.path.lexists(final):
            try:
                os.rename(old, final)
            except OSError:
                pass                   # left to recover_folder at the next start
        raise
    fsync_dir(parent)
    if moved:
        shutil.rmtree(old)
