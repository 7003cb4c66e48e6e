"""hvd_partialfc/forking.py: the one after-fork registry (a hook runs in every forked child, once, in order)."""
import os
import socket
import weakref

from hvd_partialfc import forking


def _exit_code_of_fork(child) -> int:
    """Fork; the child runs ``child()`` (an exit code) and leaves at once; the parent waits for it."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_hook_runs_in_the_child_not_the_parent_and_once_however_often_registered():
    r, w = os.pipe()
    ran = []

    def hook():
        ran.append(os.getpid())
        os.write(w, b"x")

    forking.at_fork_in_child(hook)
    forking.at_fork_in_child(hook)        # again: nothing more
    try:
        code = _exit_code_of_fork(lambda: 0 if ran == [os.getpid()] else 3)
    finally:
        forking._HOOKS.remove(hook)
    os.close(w)
    got = b""
    while chunk := os.read(r, 16):
        got += chunk
    os.close(r)
    assert code == 0 and got == b"x" and ran == []


def test_hooks_run_in_registration_order():
    r, w = os.pipe()
    hooks = [lambda: os.write(w, b"1"), lambda: os.write(w, b"2")]
    for h in hooks:
        forking.at_fork_in_child(h)
    try:
        assert _exit_code_of_fork(lambda: 0) == 0
    finally:
        for h in hooks:
            forking._HOOKS.remove(h)
    os.close(w)
    assert os.read(r, 16) == b"12"
    os.close(r)


def test_a_child_closes_its_copies_of_live_objects_sockets():
    class Holder:
        def __init__(self):
            self.a, self.b = socket.socketpair()

    live = weakref.WeakSet()
    h = Holder()
    live.add(h)
    forking.close_sockets_in_child(live, lambda o: (o.a,))
    try:
        assert _exit_code_of_fork(lambda: 0 if h.a.fileno() == -1 and h.b.fileno() != -1 else 3) == 0
        assert h.a.fileno() != -1            # the parent's stays open
    finally:
        h.a.close()
        h.b.close()
