"""The one module that touches Horovod: init, broadcast, the backbone's DistributedOptimizer, and the
small named collectives on which ``base.CommBase`` builds error agreement, digests, buffer averaging
and the all-gather with a summed backward (``engine/sim.py`` implements the same interface for virtual ranks
in one process, without Horovod).

Contract:
* every function here is a collective unless its docstring says otherwise: every rank calls it, in the
  same order (Horovod matches operations by name, so names are explicit and stable);
* nothing else in the package imports horovod, so the rest can be read, tested and reused without it;
* tensors may live on CPU (Gloo/MPI) or CUDA (NCCL, with ``HOROVOD_GPU_OPERATIONS=NCCL`` at build time);
  results come back on the device they were given on.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

import horovod.torch as hvd

from .base import CommBase, backbone_params
from .device import agreed_device
from .fd_sockets import cut, open_sockets, opened_since


class Comm(CommBase):
    """Rank/size of this process, and the Horovod primitives under the collectives of ``CommBase``
    (agreement, digests, buffer averaging, the all-gather with a summed backward)."""

    # --- small named collectives --------------------------------------------------------------------
    def allreduce_scalar(self, value: float, op: str, name: str) -> float:
        """min / max / sum / average of one number over ranks (float64 on CPU: exact for ints < 2^53)."""
        ops = {"min": hvd.Min, "max": hvd.Max, "sum": hvd.Sum, "average": hvd.Average}
        t = torch.tensor([float(value)], dtype=torch.float64)  # (1,)
        return float(_wait(hvd.allreduce_async(t, op=ops[op], name=f"scalar.{name}"))[0])

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (picklable, cloudpickle as Horovod's own), in rank order. Horovod's
        ``allgather_object`` waits in its spinning ``synchronize``; these waits go through ``_wait``, and the
        longest of them are here: a start-up's first agreement waits for the slowest rank's imports, a re-formed
        group's for a newcomer's whole start (measured: 0.9 of a core spun by each survivor meanwhile)."""
        import cloudpickle
        data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)  # (n,)
        sizes = _wait(hvd.allgather_async(torch.tensor([data.numel()], dtype=torch.int64), name=f"object.{name}.sz"))
        gathered, out, start = _wait(hvd.allgather_async(data, name=f"object.{name}.t")).numpy().tobytes(), [], 0
        for n in sizes.tolist():
            out.append(cloudpickle.loads(gathered[start:start + n]))
            start += n
        return out

    def vote_async(self, flags: List[float], name: str) -> "Vote":
        """Start an elementwise max of a few flags over ranks; ``.result()`` waits for it (a collective).

        The trainer starts one after each step and reads it after the next one (stop on SIGTERM, the
        time-based checkpoint): the allreduce rides in the same Horovod cycle as that step's gradients, so
        the agreement costs no round trip of its own, where a synchronous scalar allreduce per step would
        wait up to one cycle (HOROVOD_CYCLE_TIME, 10 ms on CPU here). Measured at np=2 (resnet width 16,
        batch 32, 300 steps, three interleaved runs each): 413 / 330 / 347 samples/s with the vote, 392 /
        363 / 338 without it: no difference above the run-to-run noise.
        """
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64)  # (K,)
        return Vote(hvd.allreduce_async(t, op=hvd.Max, name=f"vote.{name}"))

    # --- tensor collectives for the baselines (classifier modes `global` / `replicated`) -------------
    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """Elementwise max / sum of a tensor over ranks, out of place. No autograd (callers that need a
        gradient write their own backward, see ``modes.py``)."""
        ops = {"max": hvd.Max, "sum": hvd.Sum}
        return self._timed(tensor, lambda t: _wait(hvd.allreduce_async(t, op=ops[op], name=f"tensor.{name}")))

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order (row counts may differ).
        No autograd; see ``allgather_with_grad`` for features."""
        return self._timed(tensor, lambda t: _wait(hvd.allgather_async(t, name=f"gather.{name}")))

    # --- the backbone -------------------------------------------------------------------------------
    def broadcast_module(self, module: nn.Module, name: str, root_rank: int = 0) -> None:
        """Overwrite ``module``'s parameters *and* buffers with root's (identical starts: any rank's backbone is the model)."""
        state = {f"{name}.{k}": v for k, v in _named_state(module).items()}  # names match across ranks
        handles = [hvd.broadcast_async_(v, root_rank, name=k) for k, v in sorted(state.items())]
        for handle in handles:   # Horovod's broadcast_parameters, its waits through _wait
            _wait(handle)

    def distributed_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                              fp16_compression: bool = False,
                              backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
        """Wrap the *backbone's* optimizer: its gradients are averaged over ranks before each step.

        ``named_parameters`` are the backbone's only; the optimizer must hold nothing else (the local
        classifier has its own plain optimizer and is never communicated).
        """
        named = backbone_params(optimizer, module)
        compression = hvd.Compression.fp16 if fp16_compression else hvd.Compression.none
        opt = hvd.DistributedOptimizer(optimizer, named_parameters=[("backbone." + n, p) for n, p in named],
                                       compression=compression,
                                       backward_passes_per_step=backward_passes_per_step, op=hvd.Average)
        synchronize = opt.synchronize

        def timed_synchronize():   # its wait counted in wait_s, as the torch engine's (run/watch/stragglers.py)
            with self.waiting():
                for handle, _ in list(getattr(opt, "_handles", {}).values()):
                    if isinstance(handle, int):
                        _settle(handle)       # Horovod's own wait below then finds each one done
                synchronize()
        opt.synchronize = timed_synchronize
        return opt

    def regroup_refusal(self) -> Optional[str]:
        """horovodrun cannot go on without a host: docs/engines.md, "Stragglers under horovodrun"."""
        return ("horovodrun cannot drop a host from a running job yet (its elastic mode re-forms the group after a "
                "lost rank, but leaving on purpose is not built; docs/engines.md)")

    def grouped_average(self, tensors: List[torch.Tensor], name: str) -> List[torch.Tensor]:
        """Elementwise mean over ranks of each tensor (one fused allreduce), out of place."""
        return _wait(hvd.grouped_allreduce_async(tensors, op=hvd.Average, name=name))

    def shutdown(self) -> None:
        hvd.shutdown()

    def reformable(self) -> bool:
        """Under horovodrun's elastic mode (``--min-np/--max-np --host-discovery-script``: HOROVOD_ELASTIC=1),
        whose driver re-forms the group of the workers that call ``hvd.init`` again."""
        return _elastic()

    def abort(self) -> None:
        """Cut this rank's Gloo connections (the sockets its ``hvd.init`` opened: ``_GLOO``): a collective this
        rank or a peer waits in fails at once. ``hvd.shutdown`` alone does not: it waits for the background
        thread, and a survivor blocked in a receive from a rank that has left waits out
        HOROVOD_GLOO_TIMEOUT_SECONDS for it (measured: 5.0 s at 5 s, 30 s at the default), because Horovod keeps
        the old Gloo context, connections open, until the next init. Safe from any thread. Not a collective."""
        cut(_GLOO)

    def broken(self, error: BaseException) -> bool:
        from horovod.common.exceptions import HorovodInternalError
        while error is not None:
            if isinstance(error, HorovodInternalError):
                return True
            error = error.__cause__ or error.__context__
        return False

    def hosts_changed(self) -> bool:
        return _HOSTS.take()

    def reform(self, failed: bool = True) -> Optional["Comm"]:
        """Leave the group (a failed one: ``abort`` first) with ``hvd.shutdown`` and ``hvd.init`` again: the
        elastic driver gives the workers that asked again their new ranks (the survivors keep their order,
        renumbered without gaps; a host added comes last). None when this worker's host was removed from the
        job and its init raises (it may also end the process: Horovod aborts in C++ there)."""
        if failed:
            self.abort()
        hvd.shutdown()
        try:
            _init_counted()
        except Exception as e:   # noqa: BLE001 ("... has been removed from elastic job")
            print(f"[rank {self.rank}] not part of the job any more: {type(e).__name__}: {e}", flush=True)
            return None
        return _agreed_comm(*self.device_request)


class _HostUpdates:
    """The elastic driver's "hosts updated" notices (a host added, removed or back from its blacklist), heard by
    the notification service that ``hvd.init`` callers start under horovodrun's elastic mode; the driver sends
    them to the process of rank 0 only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = False

    def on_hosts_updated(self, timestamp, update_res) -> None:   # the service's thread
        with self._lock:
            self._pending = True

    def take(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, False
        return pending


_HOSTS = _HostUpdates()


def _listen_for_hosts() -> None:
    """Start the notification service (once a process; Horovod's own ``hvd.elastic.run`` does the same) and
    register ``_HOSTS`` with it."""
    from horovod.common.elastic import notification_manager
    notification_manager.init()
    notification_manager.register_listener(_HOSTS)     # a set: registering again changes nothing


_GLOO: Dict[int, str] = {}   # fd -> its socket's identity: the sockets the last hvd.init opened (Gloo's)


def _init_counted() -> None:
    """``hvd.init``, noting the sockets it opened (Gloo connects every pair during init): ``abort`` cuts them."""
    before = open_sockets()
    hvd.init()
    _GLOO.clear()
    _GLOO.update(opened_since(before))


# Horovod's background thread negotiates every HOROVOD_CYCLE_TIME ms (default 1). On a CPU-only host the
# ranks' compute threads share the cores with it, and a 1 ms cycle costs them: the demo model at np=2 on
# 2 cores trains at 645 samples/s with 1 ms and 917 with 10 ms (docs/evidence/benchmarks.md has the same
# finding for the classifier benchmark). GPU hosts keep Horovod's default (latency matters there, cores do not).
CPU_CYCLE_TIME_MS = "10"


# Horovod's wait for a collective (``synchronize``; WaitAndClear in its C++) does not block: it loops on
# sched_yield until the background thread marks the handle done, so a rank that waits for a slower one spins a
# core, in system time, for as long as it waits. Where ranks share the cores (a CPU host) that core is taken
# from the rank being waited for. Without CUDA the engine's waits poll the handle and sleep between polls
# (50 us, doubling to at most 1 ms: a wait ends at most 1 ms late, a tenth of the CPU cycle time) and call
# Horovod's wait only once the handle is done. Measured (2 ranks on 2 cores, 300 allreduces of 20,000 floats
# between small computations, HOROVOD_CYCLE_TIME=10, 2026-12-07): system time 1.5-2.6 CPU-s a rank spinning,
# 0.5-0.6 polling; the same numbers. GPU hosts keep Horovod's wait (their cores are not the bottleneck and its
# latency is lower).
_POLL = {"on": False}
POLL_FIRST_S, POLL_MAX_S = 5e-5, 1e-3


def _settle(handle: int) -> None:
    """Return once the collective ``handle`` is done (without taking its result), sleeping between polls when
    the engine waits quietly (CPU hosts), at once otherwise. Not a collective."""
    delay = POLL_FIRST_S
    while _POLL["on"] and not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)


def _wait(handle: int):
    """The result of the collective ``handle`` (Horovod's ``synchronize``), waited for by ``_settle``."""
    _settle(handle)
    return hvd.synchronize(handle)


def nccl_version() -> int:
    """NCCL's version code when this Horovod was built with GPU operations (NCCL), else 0. Not a collective."""
    return int(hvd.nccl_built())


def build_info() -> Dict[str, Any]:
    """What this Horovod was built with (``hvd-partialfc doctor``): its version, its controllers (Gloo, MPI)
    and NCCL's version code (0: no GPU operations). Not a collective; needs no init."""
    import horovod
    return {"version": horovod.__version__, "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built()),
            "nccl": nccl_version()}


def init(device: str = "auto", share_gpu: bool = False) -> Comm:
    """Start Horovod (once per process). Works under horovodrun/mpirun, and alone (size 1).

    ``train.collective_timeout`` has no counterpart here: Horovod has no timeout for a rank that is alive
    but late. A tensor some rank never submits is a *stall*, warned about every 60 s; neither
    ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (measured: a rank 12 s late with it at 5 s still all-reduced; it bounds
    Horovod's start-up) nor ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5`` (a 12 s wait was not ended) bounds it.
    A lost peer is the heartbeat's (engine/heartbeat.py) under both engines.

    Without CUDA, and unless the user set it, HOROVOD_CYCLE_TIME becomes ``CPU_CYCLE_TIME_MS``, and the waits
    for collectives sleep between polls instead of spinning (``_settle``). On a GPU
    (``device`` as ``train.device``; ``device.select_device`` picks it), ranks sharing one are refused on
    every rank unless ``share_gpu`` (``device.agreed_device``); the identities travel as host objects (Gloo
    or MPI), never through NCCL, which would fail on the shared GPU itself.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("HOROVOD_CYCLE_TIME", CPU_CYCLE_TIME_MS)
        _POLL["on"] = True
    _init_counted()
    if _elastic():
        _listen_for_hosts()
    return _agreed_comm(device, share_gpu)


def _elastic() -> bool:
    """horovodrun's elastic mode (``--min-np/--max-np --host-discovery-script``) started this process."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def _agreed_comm(device: str, share_gpu: bool) -> Comm:
    """The Comm of the group ``hvd.init`` just formed, every rank's GPU checked (``device.agreed_device``); it
    keeps ``device`` and ``share_gpu`` (``device_request``), which a re-formed group checks again."""
    comm = Comm(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size())
    comm.device_request = (device, share_gpu)
    agreed_device(device, comm.rank, comm.local_rank, comm.size, share_gpu,
                  lambda obj: comm.allgather_object(obj, name="device.gpus"))
    return comm


class Vote:
    """An allreduce in flight (``Comm.vote_async``)."""

    def __init__(self, handle):
        self.handle = handle

    def result(self) -> List[float]:
        return [float(v) for v in _wait(self.handle)]


def _named_state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Parameters and buffers by name (Horovod broadcasts them in place)."""
    out = dict(module.named_parameters())
    out.update({k: v for k, v in module.named_buffers()})
    return out
