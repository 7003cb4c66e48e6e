"""What every console script shares: a user's mistake is one line and exit 2 (a bug keeps its traceback),
``--debug``, and an ``Examples:`` epilog in every subcommand's ``--help``.

A user's mistake (a config typo, a bad value, a missing or wrong file, a launcher that does not fit the
engine) is raised on purpose with its explanation: it is printed as ``PROG CMD: error: WHAT; WHAT TO DO``
on stderr, and the process exits 2, argparse's status for a bad command line. Anything else is a bug and
keeps Python's traceback. ``--debug`` (every subcommand) or ``HVD_PARTIALFC_DEBUG=1`` prints the traceback
of a user's mistake as well. Before this, ``--set optim.backbone_lrr=1`` printed 20 lines of traceback
before its one useful line, and exited 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Dict, Optional, Sequence, Tuple, Type

EXIT_USER_ERROR = 2
DEBUG_ENV = "HVD_PARTIALFC_DEBUG"


def offline_user_errors() -> Tuple[Type[BaseException], ...]:
    """What the offline commands (everything but train and simulate) raise for bad input: their checks raise
    ValueError (ConfigError, ShardError, PairSetError, ... are ValueErrors), OSError for a missing or
    unreadable file, and the checkpoint and export errors. A generic RuntimeError, TypeError, ... is a bug."""
    from .run_files import CheckpointError
    from .tools.export import ExportError
    return ValueError, OSError, CheckpointError, ExportError


def trainer_user_errors() -> Tuple[Type[BaseException], ...]:
    """The errors the trainer raises on purpose, which carry their explanation (anything else also gets
    its traceback): a rank's agreed failure, the config, shard, checkpoint, non-finite and evaluation
    (eval.on_error=stop) errors, and a loader that sent no batch in data.batch_timeout."""
    from .config import ConfigError
    from .data.stalls import LoaderStalled
    from .data.shards import ShardError
    from .engine.base import RankFailure
    from .run_files import CheckpointError
    from .run.skips import NonFiniteError
    from .verification.evaluator import EvaluationError
    return RankFailure, ConfigError, ShardError, CheckpointError, NonFiniteError, EvaluationError, LoaderStalled


def debug_requested(args: Optional[argparse.Namespace] = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help=f"on an error, also print its traceback (or set {DEBUG_ENV}=1)")


def describe(err: BaseException) -> str:
    """The error's own text; an OSError as 'PATH: no such file or directory' instead of '[Errno 2] ...'."""
    plain = type(err).__str__ is OSError.__str__         # not a subclass with its own text
    if isinstance(err, OSError) and plain and err.strerror and err.filename is not None:
        return f"{err.filename}: {err.strerror[0].lower()}{err.strerror[1:]}"
    return str(err)


EXIT_DIR_ENV = "HVD_PARTIALFC_EXIT_DIR"


def record_exit(code: int, environ) -> None:
    """This rank's exit status, written into the folder a restart wrapper named (``HVD_PARTIALFC_EXIT_DIR``,
    launch/horovod_restarts.py) when this rank sees it. horovodrun turns any rank's non-zero exit into its
    own 1; from these files the wrapper tells a stop on a signal (75: every rank checkpointed) and a user's
    error (2) from a failure worth a restart. Both are agreed by every rank, so one rank's file is enough."""
    folder = environ.get(EXIT_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return
    from . import atomic
    from .engine.select import launcher_rank
    try:
        atomic.write_text(os.path.join(folder, f"rank-{launcher_rank(environ):05d}"), f"{code}\n")
    except OSError:
        pass


_FREEZE_REGISTERED = False


def freeze_at_exit() -> None:
    """Once per process, at the interpreter's exit (an ``atexit`` function): one cyclic collection of what is
    garbage then (every finalizer due still runs, while the interpreter is whole), then everything still alive
    frozen (``gc.freeze``), so that the collections of the interpreter's own shutdown skip it. Called when the
    command's work is done (``cli.main`` returning): atexit runs the last registered first, so the collections
    of the functions registered before (engine/torchdist.py's) find little left to walk. A rank holds ~300,000
    tracked objects, torch's most of them; its exit took 1.0-1.4 CPU-seconds after ``main`` returned, 0.3
    with this (``hvd-partialfc train`` of a small MLP, torch engine, 2026-12-07): on every rank of every job
    and restart. Nothing else changes: the atexit functions, module teardown and reference counting run as
    before; only cycles that become garbage after this point are left to the process's end."""
    global _FREEZE_REGISTERED
    if _FREEZE_REGISTERED:
        return
    import atexit
    import gc

    def collect_and_freeze() -> None:
        gc.collect()
        gc.freeze()
    atexit.register(collect_and_freeze)
    _FREEZE_REGISTERED = True


def report(prefix: str, err: BaseException, debug: bool) -> int:
    """``PREFIX: error: ...`` on stderr (after the traceback with --debug); returns the exit status, 2."""
    if debug:
        traceback.print_exception(type(err), err, err.__traceback__)
    print(f"{prefix}: error: {describe(err)}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def run_command(prog: str, args: argparse.Namespace, fn: Callable[[argparse.Namespace], int],
                user_errors: Sequence[Type[BaseException]], quiet: bool = False) -> int:
    """``fn(args)``; a user's mistake becomes one line and exit 2, anything else propagates (traceback).
    ``quiet``: exit 2 without the line (a launched rank other than 0, whose config error rank 0 prints: every
    rank reads the same config, so 64 ranks printed the same line 64 times)."""
    try:
        return fn(args)
    except BrokenPipeError:    # stdout closed early (`| head`): nothing wrong to report (Python's docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except tuple(user_errors) as err:
        if quiet and not debug_requested(args):
            return EXIT_USER_ERROR
        return report(f"{prog} {args.cmd}", err, debug_requested(args))


def rank_error(err: BaseException, rank: int, size: int, args: argparse.Namespace, reporter: bool) -> int:
    """A trainer's error on ``rank`` of ``size``: its line, the traceback of a bug; returns the exit status.

    An agreed failure (RankFailure from an agreement point) is held alike by every rank, so only the
    ``reporter`` (rank 0; simulate's one process) prints it: one report per job, not one per rank; when
    every rank failed with the same text (a missing shard set, one config for all) that text alone is the
    line. Every rank still exits non-zero. Exit 2 for a user's mistake found before training, 1 for a
    failure of the run itself (non-finite gradients, a mid-training error), whose launcher then ends the
    other ranks.
    """
    from .config import ConfigError
    from .data.shards import ShardError
    from .engine.base import RankFailure
    from .run_files import CheckpointError
    expected = isinstance(err, trainer_user_errors())
    if not expected or debug_requested(args):
        traceback.print_exception(type(err), err, err.__traceback__)
    agreed = isinstance(err, RankFailure) and bool(err.failures)
    if not agreed:
        print(f"[rank {rank}] error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    elif reporter:
        texts = {text for _, text in err.failures}
        alike = len(err.failures) == size and len(texts) == 1
        line = f"{texts.pop()}{f' (every one of the {size} ranks)' if size > 1 else ''}" if alike else \
            f"{type(err).__name__}: {err}"
        print(f"[rank {rank}] error: {line}", file=sys.stderr, flush=True)
    # an agreed failure of start-up's checks of the user's input (run/startup.py's ``checking_input``)
    mistake = isinstance(err, (ConfigError, ShardError, CheckpointError)) or (agreed and err.before_training)
    return EXIT_USER_ERROR if mistake else 1


def finish_subcommands(prog: str, subparsers: argparse._SubParsersAction, examples: Dict[str, Sequence[str]]) -> None:
    """Give every subcommand ``--debug`` and its ``Examples:`` epilog (kept as written, one command a line);
    a subcommand without examples is an error here, so none ships without them."""
    for name, parser in subparsers.choices.items():
        if not examples.get(name):
            raise KeyError(f"{prog} {name}: no examples for its --help")
        parser.epilog = "Examples:\n" + "\n".join(f"  {line}" for line in examples[name])
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        add_debug(parser)
