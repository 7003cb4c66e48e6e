"""Memory snapshots against another user of the node (run/snapshots/memory_store.py, memory_link.py, engine/listener.py).

The stranger is real: ``runuser -u nobody`` reads, lists and plants in a root made like /dev/shm (every user's,
sticky); the link is attacked over TCP by connections that hold the run's token but not the start's secret,
by floods of idle and garbage connections, and under a file-descriptor limit that a flood exhausts. One
process each (no training but the one start refused); the flood during a real run: test_memory_snapshots.py.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import types

import pytest

from conftest import MR, ROOT, SMALL_RUN, launch_env
from hvd_partialfc import atomic
from hvd_partialfc.run.snapshots.memory import MemorySnapshots
from hvd_partialfc.run.snapshots.node_memory import NodeMemory, Peer, run_token
from hvd_partialfc.run.snapshots.memory_plan import Plan
from hvd_partialfc.engine.listener import HANDSHAKE_S
from hvd_partialfc.run.snapshots import memory_link
from hvd_partialfc.run.snapshots.memory_link import Link, LinkError, answer_mac, new_secret
from hvd_partialfc.run.snapshots.memory_store import NodeStore, StoreError, store_name
from hvd_partialfc.run_files import classifier_file

SEG = "0000000a"
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"),
                             reason="acting as another user (runuser -u nobody) needs root")


def as_nobody(*cmd):
    return subprocess.run(["runuser", "-u", "nobody", "--", *map(str, cmd)], capture_output=True, text=True)


@pytest.fixture
def shm():
    """A snapshot root made like /dev/shm: every user may create in it (1777), none may rename another's."""
    root = tempfile.mkdtemp(prefix="hvdpfc-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@AS_ROOT
def test_another_user_can_neither_read_list_nor_write_a_snapshot(shm, tmp_path):
    run = tmp_path / "run"
    token = run_token(str(run), keep=False)
    store = NodeStore(shm, token, str(run), SEG)
    store.open()
    store.write(8, classifier_file(0, 2), b"the rows of rank 0")
    store.commit(8)
    final = store.find((SEG, 8), classifier_file(0, 2))
    for path, mode in ((store.path, 0o700), (os.path.dirname(final), 0o700), (final, 0o600),
                       (os.path.join(store.path, "owner.json"), 0o600), (run / "run_id", 0o600)):
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    os.chmod(tmp_path, 0o755)                    # the run folder's token: its file alone keeps it from others
    for cmd in (["cat", final], ["ls", store.path], ["touch", os.path.join(store.path, "planted")],
                ["cat", run / "run_id"]):
        assert as_nobody(*cmd).returncode != 0, cmd
    assert as_nobody("ls", shm).returncode == 0                      # the stranger can reach the root itself
    assert os.path.basename(store.path) == store_name(token, str(run)) != store_name(token, str(tmp_path / "copy"))


@AS_ROOT
@pytest.mark.parametrize("who", ["nobody", "this user"])
def test_a_link_in_the_folder_s_place_is_refused_and_nothing_it_points_to_is_removed(shm, tmp_path, who):
    home = tmp_path / "home"
    (home / "thesis").mkdir(parents=True)
    (home / "thesis" / "chapter1.tex").write_text("years of work")
    store = NodeStore(shm, "tok", str(tmp_path / "run"), SEG)
    ln = ["ln", "-s", str(home), store.path]
    assert (as_nobody(*ln) if who == "nobody" else subprocess.run(ln)).returncode == 0
    with pytest.raises(StoreError, match=f"{store.path} is there already and is not this run's snapshot folder: "
                                         f"a symbolic link \\(to {home}\\)"):
        store.open()
    store.keep_only(None)                          # what a start's clean-up and a dropped snapshot call
    store.commit(8)
    store.remove()
    assert (home / "thesis" / "chapter1.tex").read_text() == "years of work"
    assert os.path.islink(store.path)


@AS_ROOT
def test_a_root_that_lets_others_rename_its_folders_is_refused(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)                          # world-writable, no sticky bit: a folder could be swapped
    with pytest.raises(StoreError, match="lets other users rename what is in it"):
        NodeStore(str(root), "tok", str(tmp_path / "run")).open()


@AS_ROOT
def test_a_root_owned_by_another_user_is_refused_in_one_line(tmp_path):
    """A shared scratch folder made like /dev/shm (1777) but owned by nobody: its owner may rename this user's
    folder in it, sticky bit or not, and put a link in its place. Refused, one line, nothing made in it."""
    root = tmp_path / "scratch"
    root.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(root, nobody.pw_uid, nobody.pw_gid)
    os.chmod(root, 0o1777)
    with pytest.raises(StoreError) as e:
        NodeStore(str(root), "tok", str(tmp_path / "run"), SEG).open()
    assert str(e.value) == (f"checkpoint.memory_every: the snapshot folder {root} is owned by uid {nobody.pw_uid} "
                            "(nobody), who may rename what is in it: point HVD_PARTIALFC_MEMORY_DIR (or "
                            "checkpoint.memory_dir) at a folder of root's (as /dev/shm) or your own")
    assert os.listdir(root) == []


def _tree(top):
    return sorted((os.path.relpath(os.path.join(d, f), top), open(os.path.join(d, f), "rb").read())
                  for d, _, fs in os.walk(top) for f in fs) + sorted(d for d, _, _ in os.walk(top))


def test_a_folder_swapped_for_a_link_after_open_has_nothing_written_or_removed_through_it(tmp_path):
    """Whoever may rename in the root (root, on a root of root's) moves the open store folder away and puts a link
    to the user's home in its place, with folders named as the store's are. The store's writes, commits and
    removals act on the folder it opened (moved), never through the link (before: by path, keep_only removed
    every folder of the link's target)."""
    store = NodeStore(str(tmp_path / "shm"), "tok", str(tmp_path / "run"), SEG)
    os.makedirs(store.root)
    store.open()
    store.write(8, classifier_file(0, 2), b"rows of step 8")
    store.commit(8)
    home = tmp_path / "home"
    for d in ("thesis", f"step-00000008.{SEG}", f"step-00000012.{SEG}.partial", "recover-rank-00000"):
        (home / d).mkdir(parents=True)
        (home / d / "notes.txt").write_text("years of work")
    before = _tree(home)
    os.rename(store.path, tmp_path / "moved")
    os.symlink(home, store.path)
    store.write(12, classifier_file(0, 2), b"rows of step 12")
    store.commit(12)
    moved = tmp_path / "moved"
    assert (moved / f"step-00000012.{SEG}" / classifier_file(0, 2)).read_bytes() == b"rows of step 12"
    store.remove_folder("recover-rank-00000")
    store.keep_only(None)
    store.remove()
    assert _tree(home) == before and os.path.islink(store.path)
    assert os.listdir(moved) == []                     # what it opened was emptied, where it was moved to


def test_a_signed_get_is_refused_a_segment_that_names_a_path(tmp_path):
    """A rank of the job (the start's key) asks a segment that climbs out of the store (``..``, slashes): refused,
    nothing read (before: the file two folders above the store was served)."""
    store, link = _serving(tmp_path)
    store.write(8, classifier_file(0, 2), b"rank 0's rows")            # step-00000008.<SEG>.partial exists
    (tmp_path / "secret.txt").write_bytes(b"not a snapshot")
    climb = (f"{SEG}.partial/../../..", 8)                            # store/step-...partial/../../.. = tmp_path
    assert store.find(climb, "secret.txt") is None
    peer, got = _client(tmp_path, link.secret, rank=1), io.BytesIO()
    with pytest.raises(LinkError, match=r"a get needs a segment \(8 hex digits\)"):
        peer.get(link.address, climb, "secret.txt", got)
    assert got.getvalue() == b""
    peer.get(link.address, (SEG, 8), classifier_file(0, 2), got)         # the segment's own form: served
    assert got.getvalue() == b"rank 0's rows"
    for x in (peer, link):
        x.close()


def test_a_failed_first_start_leaves_nothing_that_refuses_the_next(tmp_path, monkeypatch):
    """A root without room for the snapshots: refused before anything is made in it. A root that fills up while
    owner.json is written (a 64 MB /dev/shm): what was made goes, and the next start opens. A folder a killed
    start left without owner.json: taken by the next start of the run (its name), swept once stale (another
    name) (before: each refused every later start, and no sweep removed it)."""
    root = tmp_path / "shm"
    root.mkdir()
    sizes = {"rank": 1 << 60, "backbone": 0, "limit": 0}
    comm = types.SimpleNamespace(rank=0, size=1, is_main=True)
    store = NodeStore(str(root), "tok", str(tmp_path / "run"), SEG)
    node = NodeMemory(4, comm, store, types.SimpleNamespace(close=lambda: None), Plan(["a"]),
                      [Peer("a", "", 0, sizes)], [SEG])
    assert "this node's snapshots need" in node._open_folder(str(root), "a")
    assert os.listdir(root) == []
    node.close(keep=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(atomic, "_create_temporary", full)
        with pytest.raises(OSError, match="No space left"):
            NodeStore(str(root), "tok", str(tmp_path / "run"), SEG).open()
    assert os.listdir(root) == []
    killed = NodeStore(str(root), "tok", str(tmp_path / "run"), SEG)
    os.mkdir(killed.path, 0o700)                                  # killed between its mkdir and its owner.json
    killed.open()
    assert json.loads((root / killed.name / "owner.json").read_text())["token"] == "tok"
    other = [c for c in "0123456789abcdef" if c != killed.name[-1]]     # names that differ from the run's
    old, young = root / (killed.name[:-1] + other[0]), root / (killed.name[:-1] + other[1])
    for d in (old, young):
        d.mkdir(mode=0o700)
    os.utime(old, (time.time() - 120, time.time() - 120))
    assert killed.sweep_stale() == [str(old)] and sorted(os.listdir(root)) == sorted([killed.name, young.name])


@AS_ROOT
def test_a_folder_planted_by_another_user_is_refused_at_start_up_in_one_line_and_left_as_it_is(shm, tmp_path,
                                                                                             small_run_shards):
    """The stranger knows the run's token (a group-readable run folder of an older version) and plants the
    folder, with a forged committed snapshot and an owner.json naming the run: the start refuses, exit 2, one
    line; the forgery is neither restored from nor removed, and not one step is trained."""
    run = tmp_path / "run"
    token = run_token(str(run), keep=False)
    planted = os.path.join(shm, store_name(token, str(run)))
    forged = os.path.join(planted, f"step-00000090.{SEG}")
    assert as_nobody("mkdir", "-m", "0777", "-p", forged).returncode == 0
    owner = json.dumps({"run_dir": os.path.realpath(run), "token": token})
    assert as_nobody("sh", "-c", f"echo '{owner}' > {planted}/owner.json").returncode == 0
    env = dict(launch_env(), HVD_PARTIALFC_MEMORY_DIR=shm)
    p = subprocess.run([sys.executable, "-m", "hvd_partialfc.cli", "train", "--shards", str(small_run_shards),
                        "--out", str(run), "--steps", "4", *sum((["--set", s] for s in SMALL_RUN
                                                                  + ["checkpoint.memory_every=2"]), [])],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"[rank 0] error: checkpoint.memory_every: {planted} is there already and is not this run's snapshot "
        "folder: owned by uid 65534 (nobody). It was neither used nor changed; remove it if it is yours, or point "
        "HVD_PARTIALFC_MEMORY_DIR (or checkpoint.memory_dir) at a folder of your own"), p.stderr
    assert os.path.isdir(forged) and not (run / "metrics.jsonl").exists()


# --- the link ------------------------------------------------------------------------------------------------

def _serving(tmp_path, rank=0, authorize=None):
    store = NodeStore(str(tmp_path / "shm"), "tok", str(tmp_path / "run"), SEG)
    os.makedirs(store.root, exist_ok=True)
    store.open()
    return store, Link(store, new_secret(), rank, authorize)


def _client(tmp_path, secret, rank):
    """A process of this run on another node: same token and run folder (its own root), ``secret``."""
    store = NodeStore(str(tmp_path / "other"), "tok", str(tmp_path / "run"), SEG)
    return Link(store, secret, rank)


def test_a_process_with_the_token_but_not_the_start_s_secret_can_neither_get_put_nor_commit(tmp_path):
    store, link = _serving(tmp_path)
    notes = []
    link.on_note = notes.append
    store.write(8, classifier_file(0, 2), b"rank 0's rows")
    payload = tmp_path / "forged.pt"
    payload.write_bytes(b"forged rows" * 1000)
    for who, secret in (("stranger", new_secret()), ("rank", link.secret)):
        peer = _client(tmp_path, secret, rank=1)
        got = io.BytesIO()
        requests = (lambda: peer.get(link.address, (SEG, 8), classifier_file(0, 2), got),
                    lambda: peer.put(link.address, 12, classifier_file(1, 2), str(payload)),
                    lambda: peer.note(link.address, what="commit", step=8))
        if who == "stranger":
            for request in requests:
                with pytest.raises(LinkError, match="not a request of this start of the job"):
                    request()
            assert got.getvalue() == b"" and notes == []
            assert store.listing() == {(SEG, 8): (False, [classifier_file(0, 2)])}
        else:                                  # the same requests with the key: served (the key is what refuses)
            for request in requests:
                request()
            assert got.getvalue() == b"rank 0's rows" and [n["what"] for n in notes] == ["commit"]
            assert store.listing() == {(SEG, 12): (False, [classifier_file(1, 2)]),
                                       (SEG, 8): (False, [classifier_file(0, 2)])}
        peer.close()
    link.close()


def test_a_rank_of_the_job_is_refused_what_is_not_its_own_to_send(tmp_path):
    """Rank 1 of 3 nodes (buddies 0 -> 1 -> 2 -> 0), snapshots every 4 steps, none taken yet: it takes rank 0's
    own file of a due step at its size only, and a commit only from rank 0."""
    store, link = _serving(tmp_path, rank=1)
    comm = types.SimpleNamespace(rank=1, size=3, is_main=False)
    sizes = {"rank": 1000, "backbone": 0, "limit": 4096}
    node = NodeMemory(4, comm, store, link, Plan(["a", "b", "c"]), [Peer("a", "", 0, sizes)] * 3, [SEG])
    snaps = MemorySnapshots(node, start_step=0)
    small, large = tmp_path / "small.pt", tmp_path / "large.pt"
    small.write_bytes(b"x" * 100)
    large.write_bytes(b"x" * 5000)
    rank0, rank2 = _client(tmp_path, link.secret, 0), _client(tmp_path, link.secret, 2)
    refused = {
        "rank 2's copies go to rank 0, not to rank 1": lambda: rank2.put(link.address, 4, classifier_file(2, 3),
                                                                          str(small)),
        f"rank 0 sends {classifier_file(0, 3)} of segment {SEG} only": lambda: rank0.put(
            link.address, 4, classifier_file(1, 3), str(small)),
        "step 6 is no snapshot due here": lambda: rank0.put(link.address, 6, classifier_file(0, 3), str(small)),
        "step 12 is no snapshot due here": lambda: rank0.put(link.address, 12, classifier_file(0, 3), str(small)),
        "5000 bytes is more than rank 0's slice can take": lambda: rank0.put(link.address, 4, classifier_file(0, 3),
                                                                             str(large)),
        "only rank 0 commits a snapshot": lambda: rank2.note(link.address, what="commit", step=4),
        "landings are told to rank 0": lambda: rank2.note(link.address, what="landed", step=4, rank=2),
    }
    for why, request in refused.items():
        with pytest.raises(LinkError, match=why):
            request()
    assert store.listing() == {}
    rank0.put(link.address, 4, classifier_file(0, 3), str(small))       # its own: taken
    assert store.listing() == {(SEG, 4): (False, [classifier_file(0, 3)])}
    for peer in (rank0, rank2):
        peer.close()
    snaps.close(keep=True)


def _impostor(secret=None, data=b"forged rows", claimed=None):
    """A process that took a rank's port: it greets, reads a request and answers "yes" with ``data``; with the
    start's ``secret`` (which a stranger never has) its answer is signed, claiming the SHA-256 of ``claimed``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    served = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                nonce = os.urandom(16)
                conn.sendall(nonce.hex().encode() + b"\n")
                conn.makefile("rb").readline()
                body = {"ok": True, "size": len(data), "sha256": hashlib.sha256(claimed or data).hexdigest()}
                mac = answer_mac(secret, nonce, 0, body) if secret else "00" * 32
                served.append(1)     # before the answer: the requester may have read it and returned already
                conn.sendall(json.dumps({"body": body, "mac": mac}).encode() + b"\n" + data)
    threading.Thread(target=serve, daemon=True).start()
    return server, served


def test_a_process_on_a_dead_ranks_port_can_serve_nothing(tmp_path):
    """A rank died and another process took its port; a rank that asks the address (it retries) gets an answer
    that says yes and bytes. Unsigned: refused at once, nothing written, not tried again (before: the forged
    bytes were taken as the snapshot). Signed but the bytes not the ones signed for (a key holder's bug, or a
    path rewritten): refused, as a put's whose bytes differ, which leaves no file."""
    peer = _client(tmp_path, new_secret(), rank=1)
    server, served = _impostor()
    got = io.BytesIO()
    with pytest.raises(LinkError, match="not signed by this start of the job"):
        peer.get(server.getsockname(), (SEG, 8), classifier_file(0, 2), got)
    assert got.getvalue() == b"" and served == [1]
    server.close()
    server, _ = _impostor(peer.secret, data=b"other bytes", claimed=b"rank 0's rows")
    with pytest.raises(LinkError, match="not the ones signed for"):
        peer.get(server.getsockname(), (SEG, 8), classifier_file(0, 2), io.BytesIO())
    server.close()
    store, link = _serving(tmp_path / "buddy")
    rank1 = _client(tmp_path, link.secret, rank=1)
    payload = tmp_path / "rows.pt"
    payload.write_bytes(b"rank 1's rows")
    real = memory_link.file_sha256
    try:       # the header signs another file's digest than the bytes that follow it
        memory_link.file_sha256 = lambda path: hashlib.sha256(b"rank 1's other rows").hexdigest()
        with pytest.raises(LinkError, match="not the ones signed for"):
            rank1.put(link.address, 12, classifier_file(1, 2), str(payload))
    finally:
        memory_link.file_sha256 = real
    assert all(files == [] for _, files in store.listing().values())      # its landing folder, nothing in it
    assert [f for _, _, fs in os.walk(store.path) for f in fs] == ["owner.json"]
    rank1.put(link.address, 12, classifier_file(1, 2), str(payload))
    assert store.listing() == {(SEG, 12): (False, [classifier_file(1, 2)])}
    for x in (peer, rank1, link):
        x.close()


def _garbage(address, n):
    """``n`` connections that each send something that is not a request, and the ones that send nothing."""
    socks = []
    junk = [b"[]\n", b"{}\n", b"\x00" * 64, b"x" * 5000, b'{"body": [], "mac": 1}\n', b"not json\n",
            json.dumps({"body": {"op": "get"}, "mac": "00"}).encode() + b"\n"]
    for i in range(n):
        s = socket.create_connection(address, timeout=5)
        if i % 2:
            try:
                s.sendall(junk[i % len(junk)])
            except OSError:
                pass
        socks.append(s)
    return socks


def test_a_flood_of_idle_and_garbage_connections_costs_a_put_no_wait_and_no_traceback(tmp_path, capfd):
    store, link = _serving(tmp_path, rank=1)
    payload = tmp_path / "rows.pt"
    payload.write_bytes(b"r" * 100_000)
    flood = _garbage(link.address, 200)
    peer = _client(tmp_path, link.secret, 0)
    t0 = time.monotonic()
    peer.put(link.address, 4, classifier_file(0, 2), str(payload))
    took = time.monotonic() - t0
    for s in flood:
        s.close()
    assert took < HANDSHAKE_S, took        # measured 0.07 s; a put queued behind the flood's handshakes: 5 s
    assert store.listing() == {(SEG, 4): (False, [classifier_file(0, 2)])}
    assert "Traceback" not in capfd.readouterr().err
    peer.close()
    link.close()


def test_the_server_survives_a_flood_that_uses_up_its_file_descriptors(tmp_path):
    """A server allowed 40 more open files than it has: 300 connections run it out (EMFILE in accept, which
    ended the first version's loop for good). Once they close, a rank's request is served; no traceback."""
    (tmp_path / "shm").mkdir()
    secret = new_secret()
    server = subprocess.Popen([sys.executable, os.path.join(MR, "link_server.py"), str(tmp_path / "shm"),
                               str(tmp_path / "run"), secret, "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=launch_env())
    try:
        _, host, port = server.stdout.readline().split()
        address = (host, int(port))
        flood = []

        def open_flood():
            for _ in range(150):
                try:
                    flood.append(socket.create_connection(address, timeout=2))
                except OSError:
                    pass
        opener = threading.Thread(target=open_flood)
        opener.start()
        opener.join(60)
        time.sleep(0.5)                              # the server meets EMFILE while these are open
        for s in flood:
            s.close()
        payload = tmp_path / "rows.pt"
        payload.write_bytes(b"r" * 1000)
        peer = _client(tmp_path, secret, 1)
        peer.put(address, 4, classifier_file(1, 2), str(payload))
        peer.close()
    finally:
        server.stdin.close()
        server.wait(30)
    assert len(flood) > 100                          # the flood was real (40 files more were allowed)
    assert "Traceback" not in server.stderr.read()
