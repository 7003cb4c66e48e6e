"""``horovodrun`` for the test suite: Horovod's own launcher (``horovod.runner.launch.run_commandline``, which
the ``horovodrun`` script runs), with its build pre-check answered once per test session.

Before it launches anything, horovodrun asks whether Horovod was built with Gloo (``--gloo``) or MPI
(``--mpi``) by forking a process that imports ``horovod.torch``, and so torch: 1.45 s of every launch on this
project's 2-core machine (``horovodrun -np 2 --gloo python -c pass``: 2.0 s, and 0.57 s with the answer
given), ~55 s over the suite's ~38 launches. tests/conftest.py asks Horovod's own functions once, in its
process (torch already loaded there, so the fork is quick), and passes the answers in
``HVD_PARTIALFC_TEST_HOROVOD_BUILT`` (``gloo=1,mpi=1``); without it this is horovodrun unchanged.

Everything else is horovodrun's: its arguments, its Gloo rendezvous or its mpirun, the ranks it starts, their
environment. The ``horovodrun`` script itself still launches the pinned run (tests/pins.py), the bench's jobs,
launch/horovod_restarts.py and the two-node tests.
"""
import os
import sys

from horovod.runner import launch

ANSWERS = "HVD_PARTIALFC_TEST_HOROVOD_BUILT"      # conftest.HOROVOD_BUILT


def main() -> int:
    answers = dict(kv.split("=", 1) for kv in os.environ.get(ANSWERS, "").split(",") if "=" in kv)
    for name in ("gloo", "mpi"):
        if name in answers:   # the launcher module's own names, which its run_controller calls
            built = answers[name] == "1"
            setattr(launch, f"{name}_built", lambda verbose=False, built=built: built)
    sys.argv[0] = "horovodrun"
    return launch.run_commandline()


if __name__ == "__main__":
    sys.exit(main())
