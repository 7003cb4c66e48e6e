"""One way to write a file so that a reader never sees half of it: write a temporary file beside it,
flush and ``fsync`` it, ``os.replace`` it onto the final name, then ``fsync`` the folder.

A crash (or SIGKILL, or a full disk) at any point leaves either the old file or the new one, never a
truncated mix; the temporary name carries the process id, so two processes writing the same name (ranks
on a shared file system) never write into one temporary file. Every file this package writes for a user
(checkpoints, manifests, pair sets, reports) goes through here. Not a collective; no Horovod.
"""
from __future__ import annotations

import os
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


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path beside ``path``; write it (any library: h5py, torch, json); on a normal exit
    it is fsynced and renamed onto ``path``. On an exception the temporary file is removed and ``path``
    is left as it was."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
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


def write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def torch_save(obj: Any, path: str) -> None:
    import torch
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)
