"""An elastic Horovod worker that recovers in its own process, without ``hvd.elastic.run``'s decorator.

Started by ``horovodrun --gloo --host-discovery-script ... --min-np/--max-np`` (see ``study.py``). It shows that
the survivors of a lost rank or host, and the workers of a job a host joins, keep their processes: the loop
catches ``HorovodInternalError`` (a peer died inside a collective) and its own "hosts updated" flag, then does
what ``hvd.elastic.run`` does between attempts (``hvd.shutdown(); hvd.init()``) and goes on at the new size.

What the decorator does and this loop does itself (horovod/common/elastic.py, horovod/torch/elastic/__init__.py):
* ``notification_manager.init()`` once per process: a small server whose address goes to the driver; the driver
  tells **rank 0 only** (the coordinator) when discovery sees hosts added or removed.
* a listener (any object with ``on_hosts_updated(timestamp, res)``). ``State.check_host_updates`` turns it into
  a collective with a ``broadcast_object`` from rank 0; here rank 0 adds a flag to the step's allreduce instead
  (the project's per-step vote could carry it): every rank sees it in the same step, at no extra collective.
* reset: ``hvd.shutdown(); hvd.init()``. The second ``init`` asks the driver for this slot's new rank/size
  (host:local_rank as key); that request waits until every current worker has asked, or has exited.
* after a reset: one ``allgather_object`` of (old rank, pid, host, step), from which each worker learns which
  old rank each new rank was, and the newcomers the step.

Each event is one JSON line on stdout (``ev``, wall time ``t``, ``pid``, ``host``, ...): ``study.py`` reads them.
"""
import json
import os
import sys
import threading
import time

T_PROCESS = time.time()          # before torch's import: a newcomer's start-up is measured from here

import psutil                    # noqa: E402
import torch                     # noqa: E402
import horovod.torch as hvd      # noqa: E402
from horovod.common.elastic import notification_manager   # noqa: E402
from horovod.common.exceptions import HorovodInternalError  # noqa: E402

T_IMPORTED = time.time()
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
# Two Gloo timeouts (optional): every (re)init uses STUDY_JOIN_TIMEOUT, long enough for a newcomer to start; right
# after it, one more reset under the short HOROVOD_GLOO_TIMEOUT_SECONDS, which then bounds the collectives.
SHORT_TIMEOUT = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30")
JOIN_TIMEOUT = os.environ.get("STUDY_JOIN_TIMEOUT")


def emit(ev, **kw):
    print(json.dumps(dict(ev=ev, t=time.time(), pid=os.getpid(), host=HOST, **kw)), flush=True)


def resources():
    p = psutil.Process()
    return dict(rss_mb=round(p.memory_info().rss / 2**20, 1), threads=p.num_threads(), fds=p.num_fds())


class HostUpdates:
    """The driver's notifications (rank 0's process gets them); ``take()`` reads and clears the pending flag."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = 0

    def on_hosts_updated(self, timestamp, res):        # called on the notification server's thread
        with self._lock:
            self._pending |= int(res)                  # 1 removed, 2 added (HostUpdateResult)
        emit("notified", driver_ts=timestamp, res=int(res))

    def take(self):
        with self._lock:
            res, self._pending = self._pending, 0
        return res


class HostsUpdated(Exception):
    pass


def reset(timeout=None):
    """What hvd.elastic.run does between attempts. Returns False when this slot is no longer in the job."""
    old_rank, t0 = hvd.rank(), time.time()
    hvd.shutdown()
    if timeout:                                        # read by each hvd.init (GlooContext::Initialize)
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = timeout
    t1 = time.time()
    try:
        hvd.init()
    except Exception as e:                             # a removed host: "... has been removed from elastic job"
        emit("removed", old_rank=old_rank, error=f"{type(e).__name__}: {e}")
        return False
    emit("reinit", old_rank=old_rank, rank=hvd.rank(), size=hvd.size(), init_s=round(time.time() - t0, 3),
         shutdown_s=round(t1 - t0, 3), gloo_timeout=os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS"))
    return True


def main():
    duration = float(os.environ.get("STUDY_DURATION", "60"))     # rank 0 ends the job after this many seconds
    step_sleep = float(os.environ.get("STUDY_STEP_SLEEP", "0.02"))
    n = int(os.environ.get("STUDY_NUMEL", "1024"))

    if HOST == os.environ.get("STUDY_SLOW_HOST"):          # a newcomer slower to start than the Gloo timeout
        time.sleep(float(os.environ.get("STUDY_START_DELAY", "0")))
    if JOIN_TIMEOUT:
        os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] = JOIN_TIMEOUT
    hvd.init()
    listener = HostUpdates()
    notification_manager.init()                        # no-op outside elastic horovodrun
    notification_manager.register_listener(listener)
    emit("start", rank=hvd.rank(), size=hvd.size(), import_s=round(T_IMPORTED - T_PROCESS, 3),
         init_s=round(time.time() - T_IMPORTED, 3), t_process=T_PROCESS)

    t_begin, step, old_rank, synced, first_after_reset = time.time(), 0, None, False, True
    while True:
        try:
            if not synced:                             # after start and after each reset: who was who
                members = hvd.allgather_object(dict(old_rank=old_rank, pid=os.getpid(), host=HOST, step=step),
                                               name="study.members")
                step = max(m["step"] for m in members)
                emit("members", rank=hvd.rank(), size=hvd.size(), members=members, step=step, **resources())
                synced = True
                if JOIN_TIMEOUT and os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"] != SHORT_TIMEOUT:
                    old_rank = hvd.rank()                  # every rank takes this branch: same context, same env
                    if not reset(SHORT_TIMEOUT):
                        return 0
                    synced, first_after_reset = False, True
                    continue
            flag = listener.take() if hvd.rank() == 0 else 0
            stop = 1.0 if hvd.rank() == 0 and time.time() - t_begin > duration else 0.0
            header = torch.tensor([float(flag), stop])
            out = hvd.allreduce(torch.cat([header, torch.ones(n)]), op=hvd.Sum, name="study.step")
            assert float(out[2]) == hvd.size() and float(out[-1]) == hvd.size(), (out[2], hvd.size())
            step += 1
            if first_after_reset:
                emit("first_allreduce", rank=hvd.rank(), size=hvd.size(), step=step)
                first_after_reset = False
            if out[0] > 0:
                raise HostsUpdated(int(out[0]))
            if out[1] > 0:
                emit("done", rank=hvd.rank(), size=hvd.size(), step=step, **resources())
                return 0
            time.sleep(step_sleep)
        except (HorovodInternalError, HostsUpdated) as e:
            emit("interrupted", kind=type(e).__name__, detail=str(e)[:200], rank=hvd.rank(), size=hvd.size(),
                 step=step)
            old_rank = hvd.rank()
            if not reset(JOIN_TIMEOUT):
                return 0
            synced, first_after_reset = False, True


if __name__ == "__main__":
    sys.exit(main())
