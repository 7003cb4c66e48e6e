"""What a forked worker (a DataLoader's, on Linux) does with the objects it inherits: it never collects them.

A child's garbage collector would otherwise finalize the parent's unreachable cycles in the child, and a
finalizer can need what a fork does not copy: onnxruntime's session joins its thread pool when freed, and in a
child those threads do not exist. Seen in this project's suite: a DataLoader worker collected a session left
in a cycle by an earlier ONNX check in the same process and waited for the join forever, and the trainer for
its batch. ``gc.freeze()`` right after the fork, in the child, moves every inherited object out of the
collector's reach (the parent still collects its own; the child never frees them, as a worker that ends in
``os._exit`` would not anyway); objects the child makes are collected as usual. Python's documentation gives ``gc.freeze`` for
the pages it keeps shared after a fork too (the collector no longer writes to inherited objects' headers).
"""
from __future__ import annotations

import gc
import os

_registered = False


def workers_keep_inherited_objects() -> None:
    """From now on every fork of this process freezes what the child inherits (see the module); once."""
    global _registered
    if not _registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=gc.freeze)
        _registered = True
