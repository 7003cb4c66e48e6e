"""Two ranks of the torch engine with the ring heartbeat (tests/test_heartbeat.py starts them by hand, with
torchrun's variables, so that the test, not a launcher, sees each rank end).

    python heartbeat_job.py freeze TIMEOUT   # rank 1 freezes (SIGSTOP: no beat, no FIN, as after a cut);
                                             # rank 0 waits in a collective until its heartbeat ends it
    python heartbeat_job.py busy TIMEOUT     # rank 0's main thread computes for 3 x TIMEOUT while rank 1
                                             # waits in a collective: both must finish normally
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_partialfc.engine.heartbeat import Heartbeat  # noqa: E402
from hvd_partialfc.engine.select import start_engine  # noqa: E402

mode, timeout = sys.argv[1], float(sys.argv[2])
comm = start_engine("torch", os.environ)
hb = Heartbeat.start(comm, timeout)
print(f"[rank {comm.rank}] ring up at {time.time():.3f}", flush=True)
if mode == "freeze" and comm.rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
if mode == "busy" and comm.rank == 0:
    t0, n = time.time(), 0
    while time.time() - t0 < 3 * timeout:       # pure Python: holds the GIL but for the switch interval
        n += sum(range(1000))
comm.allreduce_scalar(1.0, "sum", name="after")
hb.stop()
print(f"[rank {comm.rank}] done", flush=True)
comm.shutdown()
