"""``hvd-partialfc train`` and ``simulate``: the config they share, and the one place a trainer is started and
everything it holds outside the process is let go on every way out (memory snapshots kept or removed, the run
folder's lock, the heartbeat's goodbye). cli.py parses and calls these.
"""
from __future__ import annotations

import os
import sys

from .cli_support import debug_requested, rank_error, report


def train_config(args):
    """The config of ``train`` and ``simulate``: the YAML, the --set overrides, then the named options."""
    from .config_io import load_config
    extra = {}
    if args.shards:
        extra.setdefault("data", {})["shards"] = args.shards
    if args.out:
        extra["out"] = args.out
    if args.steps is not None:
        extra.setdefault("train", {})["steps"] = args.steps
    if args.resume:
        extra.setdefault("checkpoint", {})["resume"] = args.resume
    if args.classifier:
        extra.setdefault("head", {})["mode"] = args.classifier
    if args.init_backbone:
        extra.setdefault("model", {})["init_backbone"] = args.init_backbone
    if args.sample_rate is not None:
        extra.setdefault("head", {})["sample_rate"] = args.sample_rate
    return load_config(args.config, args.set or [], extra)


def done_line(ckpt: str, final_eval_error) -> str:
    """The run's last line: its checkpoint, and a final evaluation that failed (eval.on_error=log) said there."""
    if final_eval_error is None:
        return f"done: {ckpt}"
    return (f"done: {ckpt}; but the final {final_eval_error} (in eval.jsonl; `hvd-partialfc eval --backbone "
            f"{ckpt} --pairs ...` runs it again)")


def run_train(args) -> int:
    cfg = train_config(args)
    from .run.ckpt.resume import check_restarts_resume
    check_restarts_resume(cfg.checkpoint.resume, os.environ)   # a ConfigError: one line, exit 2
    _prepare_if_joining(cfg)
    from .engine.select import start_engine
    from .config import ConfigError
    try:
        comm = start_engine(cfg.train.engine, os.environ, cfg.train.device, share_gpu=cfg.train.share_gpu,
                            collective_timeout_s=cfg.train.collective_timeout,
                            allow_host_allreduce=cfg.train.allow_host_allreduce)
    except ConfigError as e:   # before any work: the engine does not fit the launcher, is not installed,
        # (Horovod) has no NCCL for a CUDA run, or a rank has no GPU of its own (engine/device.py)
        return report("hvd-partialfc train", e, debug_requested(args))
    while True:
        code = _train_once(cfg, comm, args)
        if code is not REFORM and code is not REGROUP:
            return code
        comm = _reform(comm, failed=code is REFORM)
        if comm is None:          # this worker's host left the job: the others go on without it
            return 0
        cfg.checkpoint.resume = "auto"    # the run's newest state: a memory snapshot, else its latest checkpoint


def _prepare_if_joining(cfg) -> None:
    """A process started to join a running job (the torch engine's ``HVD_PARTIALFC_GEN_JOIN=1``) first does, while
    the members train, what does not depend on the group it joins (run/prejoin.py), and only then asks to join
    (in ``start_engine``): the members' pause is then the re-form and the new layout's work only."""
    if os.environ.get("HVD_PARTIALFC_GEN_JOIN") != "1":
        return
    from .run.prejoin import prepare_to_join
    print(f"[rank {os.environ.get('RANK', '?')}] before asking to join: {prepare_to_join(cfg)}", file=sys.stderr,
          flush=True)


REFORM = object()   # _train_once: the group failed under this rank; the survivors re-form it in their processes
REGROUP = object()  # _train_once: the launcher changed the hosts; every rank checkpointed and leaves the group


def _reform(comm, failed: bool):
    """The group re-formed by the survivors (``comm.reform``, engine/base.py), in this process: everything the
    failed attempt held is let go first (its loader's workers with it), then the engine re-forms. None when this
    process is no longer part of the job."""
    import gc
    import time
    gc.collect()
    t0, pid, old = time.monotonic(), os.getpid(), (comm.rank, comm.size)
    comm = comm.reform(failed)
    from .run.watch import faults
    faults.note_reformed()          # an injected fault fires in the first attempt only
    if comm is not None:
        print(f"[rank {comm.rank}] went on in this process (pid {pid}): the group re-formed at {comm.size} ranks "
              f"(was rank {old[0]} of {old[1]}) in {time.monotonic() - t0:.2f} s; resuming the run's newest state",
              file=sys.stderr, flush=True)
    return comm


def _train_once(cfg, comm, args):
    """One start of the run in this process on ``comm``: its exit code, REGROUP (``_ended``), or REFORM when the
    group failed under it (a lost peer, a collective that failed with it) and the engine can re-form it
    (``comm.reformable``)."""
    from .engine.heartbeat import Heartbeat
    from .run.startup import start_trainer
    from .run.snapshots.memory import close_snapshots
    from .run.watch.run_lock import release
    heartbeat = Heartbeat.start(comm, cfg.train.heartbeat_timeout,
                                on_lost=comm.abort if comm.reformable() else None)
    error, ended, leave, reform = None, False, None, False
    try:
        trainer = start_trainer(cfg, comm)
        ckpt = trainer.fit()
        leave = trainer.eviction   # a straggler's node evicted (run/watch/stragglers.py): its ranks stop their agent
        if leave:
            leave.part(comm)
        ended = True
    except Exception as e:
        reform = comm.reformable() and (bool(heartbeat and heartbeat.lost) or comm.broken(e))
        if reform:
            return REFORM
        # An error of this rank's own: every rank reports it with its rank number; an agreed one: rank 0.
        # The non-zero exit makes the launcher stop the others.
        error = e
        return rank_error(e, comm.rank, comm.size, args, reporter=comm.rank == 0)
    finally:
        # First a goodbye after a normal end or an agreed error; none after this rank's own error (or when the
        # group re-forms), so that its neighbour ends (or re-forms) now, naming it, instead of waiting for it in a
        # collective. First: a rank still letting go of its snapshots (a landing thread joined) while its
        # neighbour had left would find the neighbour's end a lost peer, and exit 1 after an agreed stop.
        if heartbeat:
            heartbeat.abandon() if reform else heartbeat.end(error)
        # Memory snapshots go when the run ends (its last step; a stop, whose checkpoint is as new) and stay
        # after anything else (an error, Ctrl-C, SystemExit, the group re-forming), and on the nodes an eviction
        # leaves: a restart (or --resume auto, or the re-formed group) takes them.
        close_snapshots(keep=not ended or bool(leave and not leave.mine))
        release()                  # the run folder's lock (run/watch/run_lock.py)
    return _ended(comm, trainer, ckpt, leave)


def _ended(comm, trainer, ckpt, leave) -> int:
    """The exit code of a run that ended in this process: an eviction's, a stop's (75), or done (0); REGROUP after
    the launcher changed the hosts (every rank checkpointed: the group re-forms from there)."""
    if trainer.regroup:
        return REGROUP
    if leave:
        return leave.exit_code(comm.rank)
    if trainer.stopped_by:
        from .run.watch.preempt import EXIT_PREEMPTED
        print(f"[rank {comm.rank}] stopped by {trainer.stopped_by} after checkpoint {ckpt}; exit "
              f"{EXIT_PREEMPTED} (resume with --resume auto)", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    if comm.is_main:
        print(done_line(ckpt, trainer.final_evaluation_failed()))
    comm.shutdown()
    return 0


def run_simulate(args) -> int:
    """``train``'s run for ``--ranks`` virtual ranks in this process (simulate.py); the same exit codes."""
    cfg = train_config(args)
    from .run.simulate import SimFailure, simulate
    try:
        result = simulate(cfg, args.ranks)
    except SimFailure as f:
        return rank_error(f.error, f.rank, args.ranks, args, reporter=True)
    if result.stopped_by:
        from .run.watch.preempt import EXIT_PREEMPTED
        print(f"stopped by {result.stopped_by} after checkpoint {result.checkpoint}; exit {EXIT_PREEMPTED} "
              "(resume with --resume auto)", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    print(done_line(result.checkpoint, result.final_eval_error))
    return 0
