"""What a pending ``hvd.allreduce_async_`` does when its peer is lost: which exception, after how long, and
whether the process still ends (``study.py async`` starts two of these under elastic horovodrun, so that the
launcher does not end rank 0 itself when rank 1 dies, and kills or stops rank 1).

Rank 1 never submits the tensor: rank 0's allreduce stays pending until the peer is lost. Rank 0 then times
``hvd.synchronize`` raising, ``hvd.shutdown()`` and a second ``allreduce`` after it. A watchdog thread reports a
hang after ``STUDY_WATCHDOG`` seconds and ends the process.
"""
import json
import os
import sys
import threading
import time

import torch
import horovod.torch as hvd


def emit(ev, **kw):
    print(json.dumps(dict(ev=ev, t=time.time(), pid=os.getpid(), **kw)), flush=True)


def watchdog(seconds):
    time.sleep(seconds)
    emit("hang", after_s=seconds)
    os._exit(3)


def main():
    hvd.init()
    emit("start", rank=hvd.rank(), size=hvd.size())
    hvd.allreduce(torch.ones(4), name="warmup")          # both ranks connected and cycling
    if hvd.rank() != 0:
        emit("idle", rank=hvd.rank())
        while True:                                       # waits to be killed or stopped; submits nothing
            time.sleep(1)
    threading.Thread(target=watchdog, args=(float(os.environ.get("STUDY_WATCHDOG", "90")),), daemon=True).start()
    t = torch.ones(1 << 16)
    handle = hvd.allreduce_async_(t, name="pending")
    emit("submitted", rank=0)
    try:
        hvd.synchronize(handle)
        emit("completed")
    except Exception as e:
        emit("raised", kind=f"{type(e).__module__}.{type(e).__name__}", msg=str(e)[:300])
    t0 = time.time()
    try:
        hvd.shutdown()
        emit("shutdown", took_s=round(time.time() - t0, 3))
    except Exception as e:
        emit("shutdown_raised", kind=type(e).__name__, msg=str(e)[:200])
    try:
        hvd.allreduce(torch.ones(4), name="after")
        emit("after_allreduce_ok")
    except Exception as e:
        emit("after_allreduce_raised", kind=f"{type(e).__module__}.{type(e).__name__}", msg=str(e)[:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())
