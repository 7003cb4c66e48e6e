"""Two ranks of the torch engine with the ring heartbeat (tests/test_heartbeat.py starts them by hand, with
torchrun's variables, so that the test, not a launcher, sees each rank end).

    python heartbeat_job.py freeze TIMEOUT   # rank 1 freezes (SIGSTOP: no beat, no FIN, as after a cut);
                                             # rank 0 waits in a collective until its heartbeat ends it
    python heartbeat_job.py busy TIMEOUT     # rank 0's main thread computes for 3 x TIMEOUT while rank 1
                                             # waits in a collective: both must finish normally
    python heartbeat_job.py forked TIMEOUT   # rank 1 forks a child that lingers (as a DataLoader worker does
                                             # until it notices), then is SIGKILLed: rank 0 must end at once
    python heartbeat_job.py crash TIMEOUT    # rank 1 fails on its own and lingers (a slow exit): it leaves
                                             # the ring without a goodbye, rank 0 ends at once naming it
    python heartbeat_job.py agreed TIMEOUT   # an error every rank raises (an agreement): goodbyes, no alarm
    python heartbeat_job.py stray TIMEOUT    # a stray connection and a flood of 200 reach rank 0 before rank 1
                                             # does: they are refused, and the ring forms with rank 1; as root,
                                             # another user (nobody) floods both ranks' ports all the while
    python heartbeat_job.py stray,busy,agreed TIMEOUT   # modes one after the other in one job (one start-up of two
                                             # ranks); a mode that does not end the job ends in an all-reduce,
                                             # after which each rank prints "[rank R] MODE: done"
"""
import json
import os
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.cli_support import freeze_at_exit  # noqa: E402
from hvd_partialfc.engine.base import RankFailure  # noqa: E402
from hvd_partialfc.engine.heartbeat import Heartbeat  # noqa: E402
from hvd_partialfc.engine.select import start_engine  # noqa: E402
from scripts.faults import flooder  # noqa: E402

modes, timeout = sys.argv[1].split(","), float(sys.argv[2])
stranger = None                                     # another user's flood (stray, as root)
comm = start_engine("torch", os.environ)
if "stray" in modes and comm.rank == 1:
    connect = Heartbeat._connect

    def stray_first(self, peer):
        """A stranger reaches rank 0's heartbeat port first: one connection says something else and leaves after
        1 s, then a flood of 200 more, idle or saying garbage, stays open for 5 s (each had 5 s to say its
        hello, one after the other: 1,000 s in all). As root, a flood from another user (scripts/faults/flooder.py
        run as nobody) goes on at both ranks' ports while the ring forms, and for 2.5 s in all."""
        global stranger
        if flooder.can_flood_as("nobody"):
            stranger = flooder.start_as("nobody", [(p.address, p.port) for p in self.peers], 2.5, inflight=300)
        s = socket.create_connection(peer[1:3], timeout=5)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40)
        threading.Timer(1.0, s.close).start()
        flood = [socket.create_connection(peer[1:3], timeout=5) for _ in range(200)]
        for f in flood[::2]:
            try:
                f.sendall(b"\x00" * 20)
            except OSError:                       # closed already: a source's own oldest go first
                pass
        closer = threading.Timer(5.0, lambda: [f.close() for f in flood])
        closer.daemon = True                      # the job's end does not wait for it
        closer.start()
        time.sleep(0.3)
        return connect(self, peer)
    Heartbeat._connect = stray_first
hb = Heartbeat.start(comm, timeout)
print(f"[rank {comm.rank}] ring up at {time.time():.3f}", flush=True)
for mode in modes:
    if mode == "freeze" and comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "busy" and comm.rank == 0:
        t0, n = time.time(), 0
        while time.time() - t0 < 3 * timeout:       # pure Python: holds the GIL but for the switch interval
            n += sum(range(1000))
    if mode == "forked" and comm.rank == 1:
        if os.fork() == 0:                          # the child holds whatever the fork left it, for 20 s
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1), os.dup2(devnull, 2)  # but not the test's pipes
            time.sleep(20)
            os._exit(0)
        time.sleep(0.5)
        print(f"[rank 1] killed at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "crash" and comm.rank == 1:
        print(f"[rank 1] failed at {time.time():.3f}", flush=True)
        hb.end(RuntimeError("this rank's own error"))
        time.sleep(30)
        sys.exit(1)
    if mode == "agreed":
        try:
            comm.agree("a bad shard on rank 1" if comm.rank == 1 else None, name="agreed")
        except RankFailure as e:
            hb.end(e)
            time.sleep(2 * timeout)                 # no alarm while both linger
            print(f"[rank {comm.rank}] agreed: {e}", flush=True)
            sys.exit(2)
    if mode == "stray":
        time.sleep(1.5)                             # past the stranger's leaving
        if stranger is not None:
            print(f"[rank {comm.rank}] flood: {json.dumps(flooder.finish(stranger))}", flush=True)
    comm.allreduce_scalar(1.0, "sum", name=f"after {mode}")
    print(f"[rank {comm.rank}] {mode}: done", flush=True)
hb.stop()
print(f"[rank {comm.rank}] done", flush=True)
comm.shutdown()
freeze_at_exit()          # the exit skips the shutdown's collections over torch's objects (cli_support.py)
