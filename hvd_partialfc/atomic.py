"""One way to write a file so that a reader never sees half of it: write a temporary file beside it,
flush and ``fsync`` it, ``os.replace`` it onto the final name, then ``fsync`` the folder.

A crash (or SIGKILL, or a full disk) at any point leaves either the old file or the new one, never a
truncated mix. The temporary file is created exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``) under a name with
the process id and 64 random bits, in the target's folder: two processes writing the same name (ranks on a
shared file system) never write into one temporary file, and in a shared output folder a link planted
at a guessed name is never followed (before: ``.NAME.tmp-PID``, opened with ``O_TRUNC``, let another user
have a checkpoint write overwrite one of the victim's files). Every file this package writes for a user
(checkpoints, manifests, pair sets, reports) goes through here. Not a collective; no Horovod.

The temporary is written through the descriptor its exclusive create returned (`atomic_file`), in a folder
opened once as a descriptor, and renamed through that descriptor: it is never opened again by name, so a member
of a group-writable folder who swaps a link in for the temporary while it is written has nothing written through
the link, and the swapped name is never published (the write fails). `atomic_path` gives a library that writes
only by name (h5py) a name inside a private folder, reached through the folder's descriptor: nothing there can
be swapped by another user. The folder helpers (`open_dir`, `same_entry`, `clear_dir`, `remove_tree_at`) serve
the memory snapshot store too: they never follow a link and act on the folder a descriptor holds, whatever its
name points to now.

A whole folder (a shard set, an IJB-shaped set) is committed the same way, one level up: written in full
under another name, then renamed into place by `commit_folder`, with `recover_folder` to finish at the
next start what a crash interrupted. A folder cannot be ``os.replace``d onto a non-empty one, so the old
folder is first moved aside (never deleted) and removed only once the new one is in place.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from contextlib import contextmanager
from typing import IO, Any, Iterator, Optional, Tuple


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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW


def open_dir(path: str, dir_fd: Optional[int] = None, follow: bool = True) -> int:
    """A descriptor of the folder ``path`` (a name in the open folder ``dir_fd`` if given); ``follow=False``: a
    link there is refused (OSError), never followed."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)


def same_entry(dir_fd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in the folder ``dir_fd`` is still the file or folder open as ``fd`` (nothing else, a link
    or another file, put in its place)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def clear_dir(fd: int) -> None:
    """Remove everything in the open folder ``fd``, never through a link (a link goes, not what it points to);
    best effort, as ``rmtree(ignore_errors=True)``."""
    try:
        entries = list(os.scandir(fd))
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                remove_tree_at(fd, e.name)
            else:
                os.unlink(e.name, dir_fd=fd)
        except OSError:
            pass


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove the folder ``name`` of the open folder ``dir_fd`` and all in it; a link or a file at ``name`` stays.
    Best effort, as ``rmtree(ignore_errors=True)``."""
    try:
        fd = open_dir(name, dir_fd, follow=False)
    except OSError:
        return
    try:
        clear_dir(fd)
        if same_entry(dir_fd, name, fd):
            os.rmdir(name, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temporary(dir_fd: int, name: str, mode: int = 0o666) -> Tuple[str, int]:
    """(its name, a write descriptor) of a new empty file ``.NAME.tmp-PID-RANDOM`` in the folder ``dir_fd`` that
    no other file or link was at (``O_EXCL``), with the mode a plain ``open`` would give (0666 less the umask;
    ``mkstemp``'s 0600 would make checkpoints unreadable to the group that shares the run folder), or ``mode``
    (less the umask: 0600 for what only its owner may read, a memory snapshot, the run's token). The
    ``.NAME.tmp-`` prefix is what a killed build's clean-up looks for (data_tools/stream_restart.py)."""
    for _ in range(100):
        tmp = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            return tmp, os.open(tmp, _EXCLUSIVE, mode, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in 100 tries")


@contextmanager
def _temporary(path: str, mode: int, dir_fd: Optional[int], by_name: bool = False,
               into: Optional[int] = None) -> Iterator[Tuple[str, int]]:
    """(the temporary's name in the folder, its write descriptor) beside ``path`` (a name in the open folder
    ``dir_fd`` if given, else the folder is opened once here). On a normal exit: fsynced and renamed onto
    ``path`` through the folder's descriptor (or into the open folder ``into``), only if its name still holds
    the file created (a link or a file swapped in for it is never published), then the folder fsynced. On an
    exception: removed. ``by_name``: the caller writes by name and may itself replace the file (h5py's writer, a
    compaction that rewrites it beside and renames it over), so the name must still hold a regular file of this
    user, not the same one."""
    path = os.fspath(path)
    folder, name = (None, path) if dir_fd is not None else os.path.split(os.path.abspath(path))
    dfd = dir_fd if dir_fd is not None else open_dir(folder)
    to = dfd if into is None else into
    try:
        tmp, fd = _create_temporary(dfd, name, mode)
        try:
            yield tmp, fd
            if by_name:
                fd = _reopen_own(dfd, tmp, fd)
            os.fsync(fd)
            if not same_entry(dfd, tmp, fd):
                raise OSError(errno.EEXIST, f"{name}: its temporary file {tmp} was replaced while it was written "
                                            "(by another user of the folder?); nothing was written in its place")
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=to)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)
        try:
            os.fsync(to)
        except OSError:
            pass
    finally:
        if dir_fd is None:
            os.close(dfd)


def _reopen_own(dfd: int, tmp: str, fd: int) -> int:
    """The descriptor of what ``tmp`` names now (``fd`` closed), opened without following a link: a regular
    file of this user, or the write fails (a by-name writer may have replaced the file it was given)."""
    try:
        new = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as e:
        raise OSError(errno.EEXIST, f"{tmp}: the temporary file is no longer a file of this user ({e.strerror}); "
                                    "nothing was written in its place") from e
    st = os.fstat(new)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(new)
        raise OSError(errno.EEXIST, f"{tmp}: the temporary file was replaced by another user's or a non-regular "
                                    "file while it was written; nothing was written in its place")
    os.close(fd)
    return new


@contextmanager
def atomic_file(path: str, mode: int = 0o666, text: bool = False, dir_fd: Optional[int] = None) -> Iterator[IO]:
    """An open file (binary, or UTF-8 ``text``) that becomes ``path``, whole or not at all (see the module's
    docstring): written through the descriptor of its exclusive create, never reopened by name. ``dir_fd``:
    ``path`` is a name in that open folder (the snapshot store's)."""
    with _temporary(path, mode, dir_fd) as (_, fd):
        with open(fd, "w" if text else "wb", closefd=False, **({"encoding": "utf-8"} if text else {})) as f:
            yield f


@contextmanager
def atomic_path(path: str, mode: int = 0o666) -> Iterator[str]:
    """Yield the path of a new empty temporary file for ``path``, for a library that writes only by name (h5py):
    on a normal exit it is fsynced and renamed onto ``path``. On an exception it is removed and ``path`` is left
    as it was. Whatever can write into an open file uses `atomic_file` (no reopening by name).

    The library opens that name again, so the name must be one no one else can change: the temporary lies in a
    private folder (0700, created exclusively beside ``path`` as ``.NAME.tmp-PID-RANDOM``) and the path given
    goes through that folder's descriptor (``/proc/self/fd/N/...``): a member of a group-writable output folder
    can neither swap a link in for the temporary (the private folder is closed to them) nor for the private
    folder itself (the descriptor holds the folder created, whatever its name points to later)."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    dfd = open_dir(folder)
    try:
        private, pfd = _private_dir(dfd, name)
        try:
            with _temporary(name, mode, pfd, by_name=True, into=dfd) as (tmp, _):
                through = f"/proc/self/fd/{pfd}"
                yield os.path.join(through if os.path.isdir(through) else os.path.join(folder, private), tmp)
        finally:
            remove_tree_at(dfd, private)
            os.close(pfd)
    finally:
        os.close(dfd)


def _private_dir(dir_fd: int, name: str) -> Tuple[str, int]:
    """(its name, a descriptor) of a new folder ``.NAME.tmp-PID-RANDOM`` in the open folder ``dir_fd``, mode 0700,
    created where nothing was (``mkdir`` never follows a link) and checked to be this user's folder."""
    for _ in range(100):
        private = f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            os.mkdir(private, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            continue
        fd = open_dir(private, dir_fd, follow=False)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise OSError(errno.EEXIST, f"{private}: the private folder for {name} is not this user's alone")
        return private, fd
    raise FileExistsError(f"no free temporary name for {name} in 100 tries")


def write_bytes(path: str, data: bytes, mode: int = 0o666) -> None:
    with atomic_file(path, mode) as f:
        f.write(data)


def write_text(path: str, text: str, mode: int = 0o666) -> None:
    with atomic_file(path, mode, text=True) as f:
        f.write(text)


def torch_save(obj: Any, path: str) -> None:
    import torch
    with atomic_file(path) as f:
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
