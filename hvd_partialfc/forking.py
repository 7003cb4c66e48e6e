"""What a forked child (a DataLoader's worker, on Linux) does first with what it inherits: this process's one
after-fork registry.

One registry: ``os.register_at_fork`` is called once, with a function that runs the hooks registered here in
their order (``at_fork_in_child``), each once however often its owner asks. Two kinds of hook use it:

* **Sockets** (``close_sockets_in_child``): a child holds copies of the parent's sockets, so a connection the
  parent's death should close (the heartbeat ring's, a memory-snapshot server's port) stays open until the
  child notices and ends too. The child closes its copies at once (the parent's stay open).
* **Inherited objects** (``workers_keep_inherited_objects``): a child never collects them. Its garbage
  collector would otherwise finalize the parent's unreachable cycles in the child, and a finalizer can need
  what a fork does not copy: onnxruntime's session joins its thread pool when freed, and in a child those
  threads do not exist. Seen in this project's suite: a DataLoader worker collected a session left in a cycle
  by an earlier ONNX check in the same process and waited for the join forever, and the trainer for its
  batch. ``gc.freeze()`` right after the fork, in the child, moves every inherited object out of the
  collector's reach (the parent still collects its own; the child never frees them, as a worker that ends in
  ``os._exit`` would not anyway); objects the child makes are collected as usual. Python's documentation
  gives ``gc.freeze`` for the pages it keeps shared after a fork too (the collector no longer writes to
  inherited objects' headers).
"""
from __future__ import annotations

import gc
import os
import traceback
from typing import Callable, Iterable, List

_HOOKS: List[Callable[[], None]] = []
_installed = False


def _run_hooks_in_child() -> None:
    """Every hook in registration order; one that raises is reported and the next still runs, as
    ``os.register_at_fork`` treats hooks registered with it one by one."""
    for hook in list(_HOOKS):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a child must still run the hooks after it
            traceback.print_exc()


def at_fork_in_child(hook: Callable[[], None]) -> None:
    """From now on every fork of this process runs ``hook`` in the child, after the hooks registered before
    it; registering one hook again changes nothing."""
    global _installed
    if hook in _HOOKS:
        return
    _HOOKS.append(hook)
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_run_hooks_in_child)
        _installed = True


def close_sockets_in_child(live: Iterable, sockets_of: Callable[[object], Iterable]) -> None:
    """From now on every forked child closes its copies of the sockets of the objects in ``live`` at the
    fork (a ``weakref.WeakSet``: the objects still alive), ``sockets_of(obj)`` giving each one's."""
    def close() -> None:
        for obj in list(live):
            for sock in sockets_of(obj):
                try:
                    sock.close()
                except OSError:
                    pass
    at_fork_in_child(close)


def workers_keep_inherited_objects() -> None:
    """From now on every fork of this process freezes what the child inherits (see the module); once."""
    at_fork_in_child(gc.freeze)
