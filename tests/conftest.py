"""Shared fixtures: small synthetic shard sets, and running scripts under real horovodrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

# The tests run on the CPU, in this process and in the jobs they launch (which inherit this environment):
# the bitwise checks and pinned digests are CPU figures, and a GPU node's ranks would share its GPUs. CUDA
# reads the variable when torch first starts it, after this line. HVD_PARTIALFC_TEST_GPU=1 shows the GPUs:
# then the GPU tests (marked gpu) run and the others are skipped (docs/gpu.md).
TEST_GPU = os.environ.get("HVD_PARTIALFC_TEST_GPU") == "1"
if not TEST_GPU:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Every launched rank imports this package afresh. Where PYTHONDONTWRITEBYTECODE=1 is set (this project's CI
# and dev machines), no rank ever kept its .pyc files and each one compiled the package again: 0.3-0.4 s of
# every process start (1.5-1.9 s against 1.9-2.6 s for `import torch` and the package here). Bytecode is
# written again (into the ignored __pycache__ folders) by this process and the jobs it launches.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# OpenMP threads that wait between parallel regions sleep instead of spinning (libgomp spins by default): a
# launched rank with two torch threads spent 2.5 of its 9 CPU-s spinning beside the suite's other work (the GPU
# call's dry run, 2026-12-07). Waiting changes no number; set before anything here imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
HOROVOD_BUILT = "HVD_PARTIALFC_TEST_HOROVOD_BUILT"    # read by tests/mr/horovodrun.py
TORCHRUN = os.path.join(BIN, "torchrun")
MR = os.path.join(ROOT, "tests", "mr")


# Files whose tests share one launch or run (tests/helpers_np2.py's two-rank launch; conftest.np4_run, asked by
# test_simulate and test_twonode): with ``-n N --dist loadfile`` (make test's multi-rank tests, two at a time) one
# work unit, so that one worker runs them all and starts the launch once (xdist's loadgroup would do it with marks,
# but it names the group in the test id, which pytest 9.2 no longer lets a plugin change).
SHARED_LAUNCH = {"test_faces_e2e.py", "test_modes.py", "test_negatives.py", "test_simulate.py",
                 "test_train_multirank.py", "test_twonode.py"}


@pytest.hookimpl(optionalhook=True)      # a hook of pytest-xdist: without it, never called
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, a file's tests on one worker (its module fixtures run once), SHARED_LAUNCH's together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "shared-launch" if os.path.basename(path) in SHARED_LAUNCH else path
    return SharedLaunchScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """With the GPUs shown (HVD_PARTIALFC_TEST_GPU=1) only the tests marked gpu run: the others are CPU tests."""
    if not TEST_GPU:
        return
    skip = pytest.mark.skip(reason="a CPU test: HVD_PARTIALFC_TEST_GPU=1 shows the GPUs to this session")
    for item in items:
        if item.get_closest_marker("gpu") is None:
            item.add_marker(skip)


def make_feature_npz(path, class_counts, dim=16, seed=0, noise=0.5):
    """Gaussian clusters: one centre per class, ``class_counts[c]`` samples of class c."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(len(class_counts), dim)).astype(np.float32)
    y = np.repeat(np.arange(len(class_counts)), class_counts)
    x = centers[y] + noise * rng.normal(size=(len(y), dim)).astype(np.float32)
    np.savez(path, features=x, labels=y)
    return path


def make_image_npz(path, num_classes, per_class, size=32, seed=0):
    """Random class templates plus per-sample noise (uint8 images)."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(num_classes, size, size))
    y = np.repeat(np.arange(num_classes), per_class)
    x = np.clip(templates[y] + rng.integers(-40, 40, size=(len(y), size, size)), 0, 255).astype(np.uint8)
    np.savez(path, images=x, labels=y)
    return path


def build_shards(npz, out, num_shards):
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    build_shard_set(get_importer("npz")(str(npz)), str(out), num_shards)
    return str(out)


@pytest.fixture(scope="session")
def feature_shards(tmp_path_factory):
    """40 classes x 24 samples, 16-d features, 2 shards."""
    d = tmp_path_factory.mktemp("feat")
    return build_shards(make_feature_npz(d / "f.npz", [24] * 40), d / "shards", 2)


@pytest.fixture(scope="session")
def image_shards(tmp_path_factory):
    """12 classes x 16 images of 32x32, 2 shards (for the resnet backbone, BatchNorm included)."""
    d = tmp_path_factory.mktemp("img")
    return build_shards(make_image_npz(d / "i.npz", 12, 16), d / "shards", 2)


# A small MLP job on 4 feature shards of 24 classes (30 samples each): the elastic and two-node runs. It
# resumes its run folder's latest checkpoint (elastic restarts) and hears a lost peer within 5 s.
SMALL_RUN = ["model.name=mlp", "model.embedding_dim=16", "model.kwargs={hidden_dim: 16}", "data.batch_size=8",
             "train.log_every=5", "train.threads=1", "data.workers=0", "checkpoint.resume=auto", "checkpoint.keep=3",
             "train.heartbeat_timeout=5", "head.negatives_every=0"]


@pytest.fixture(scope="session")
def small_run_shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_run")
    return build_shards(make_feature_npz(d / "f.npz", [30] * 24), d / "shards4", 4)


def small_run_argv(shards, out, steps, sets=()):
    """``-m hvd_partialfc.cli train ...`` of the small job (after a launcher, or ``python``)."""
    argv = ["-m", "hvd_partialfc.cli", "train", "--shards", str(shards), "--out", str(out), "--steps", str(steps)]
    for s in SMALL_RUN + list(sets):
        argv += ["--set", s]
    return argv


def simulate_here(cfg, ranks, timeout=120):
    """``simulate(cfg, ranks)`` (N virtual ranks) in this process, in a thread with a deadline (a hang fails);
    torch's thread count and the torch, numpy and Python random streams are put back after. Returns the
    SimResult or raises the run's error (``SimFailure``: ``.error`` is the rank's exception)."""
    import random
    import threading
    import torch
    from hvd_partialfc.run.simulate import simulate
    threads, rng = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    box = {}

    def target():
        try:
            box["result"] = simulate(cfg, ranks)
        except Exception as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            box["error"] = e
    try:
        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), "simulate did not finish (deadlock?)"
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0]), np.random.set_state(rng[1]), random.setstate(rng[2])
    if "error" in box:
        raise box["error"]
    return box["result"]


def simulate_cli(capsys, ranks, shards, out, sets=(), steps=20):
    """``hvd-partialfc simulate --ranks N`` through the CLI in this process (start-up, resume and loop on N
    virtual ranks; no launch): exit code and output (``capsys`` None: output not kept). Torch's threads and
    the torch, numpy and Python random streams are put back."""
    import random
    import torch
    from hvd_partialfc.cli import main
    saved = (torch.get_num_threads(), torch.get_rng_state(), np.random.get_state(), random.getstate())
    if capsys:
        capsys.readouterr()
    argv = ["simulate", "--ranks", str(ranks), "--shards", str(shards), "--out", str(out), "--steps", str(steps)]
    for s in sets:
        argv += ["--set", s]
    try:
        rc = main(argv)
    finally:
        torch.set_num_threads(saved[0])
        torch.set_rng_state(saved[1])
        np.random.set_state(saved[2])
        random.setstate(saved[3])
    text = capsys.readouterr() if capsys else None
    return rc, text.out + text.err if text else ""


NO_HOROVOD = ("Horovod is not installed (a torch-only install: scripts/setup/install.sh --no-horovod, or pip install .): "
              "the tests of the Horovod engine and horovodrun skip")


def require_horovod():
    """Skip the calling test (or fixture) where Horovod is not installed: every use of horovodrun goes through
    here, so a torch-only install skips them with this one reason instead of erroring."""
    from hvd_partialfc.engine.select import horovod_installed
    if not horovod_installed():
        pytest.skip(NO_HOROVOD)


def horovodrun():
    """The start of a ``horovodrun`` command: tests/mr/horovodrun.py, Horovod's launcher with its Gloo/MPI build
    check answered once per session (1.45 s saved per launch); the answers are asked here, once, and set in
    this process's environment, which every launched job inherits."""
    require_horovod()
    if HOROVOD_BUILT not in os.environ:
        from horovod.common.util import gloo_built, mpi_built
        os.environ[HOROVOD_BUILT] = f"gloo={int(bool(gloo_built()))},mpi={int(bool(mpi_built()))}"
    return [sys.executable, os.path.join(MR, "horovodrun.py")]


def horovodrun_env():
    """The environment for a tool that starts horovodrun itself (``hvd-partialfc bench``): its
    ``HVD_PARTIALFC_HOROVODRUN`` set to horovodrun() and the build answers with it."""
    import shlex
    return dict(os.environ, HVD_PARTIALFC_HOROVODRUN=shlex.join(horovodrun()))


# The first lines of a script run as ``python -c``: every import of horovod fails, as on an install without it
# (``scripts/setup/install.sh --no-horovod``).
BLOCK_HOROVOD = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ImportError("horovod is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def launch_cmd(launcher, np_):
    """The start of a command that runs ``-m MODULE ...`` or ``SCRIPT ...`` on ``np_`` ranks: ``torchrun`` (on
    this host), or ``horovodrun`` with ``gloo`` (the default) or ``mpi``."""
    if launcher == "torchrun":
        return [TORCHRUN, "--nproc-per-node", str(np_), "--standalone"]
    return [*horovodrun(), "-np", str(np_), f"--{launcher if launcher in ('gloo', 'mpi') else 'gloo'}", sys.executable]


def launch_env(fault=None):
    """The environment of a launched job: this checkout first on the path, Open MPI as root allowed, the
    torch engine's check of collective names on, and ``HVD_PARTIALFC_FAULT`` set to ``fault`` (or unset)."""
    e = dict(os.environ, PYTHONPATH=ROOT, PATH=BIN + os.pathsep + os.environ.get("PATH", ""),
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", HVD_PARTIALFC_CHECK_COLLECTIVES="1")
    e.pop("HVD_PARTIALFC_FAULT", None)
    if fault:
        e["HVD_PARTIALFC_FAULT"] = fault
    return e


def free_port():
    """A TCP port the OS says is free now (a fixed range such as 29000 + pid % 1000 met torchrun's default
    29500 and other jobs' ports)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def signal_rank_1_once_checkpointing(proc, run, sig, rank_var, wait_s, kill):
    """The stop-signal tests' launch (tests/test_checkpoints.py under Horovod, tests/test_launchers.py through
    launch/torchrun.sh): once ``run`` has two time-based checkpoints, ``sig`` to rank 1 (the one process under
    ``proc`` running the CLI whose ``rank_var`` is "1"); the launch's output once it ended. Where it has not (a
    failed wait or check), ``kill(proc)`` ends the launch and its ranks."""
    import time
    import psutil
    from hvd_partialfc.run_files import list_checkpoints
    try:
        deadline = time.time() + wait_s
        while len(list_checkpoints(str(run))) < 2:  # time-based checkpoints appear without checkpoint.every
            assert proc.poll() is None and time.time() < deadline, "no time-based checkpoints"
            time.sleep(0.2)
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "hvd_partialfc.cli" in " ".join(c.cmdline()) and c.environ().get(rank_var) == "1"]
        assert len(ranks) == 1
        ranks[0].send_signal(sig)
        return proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            kill(proc)
            proc.communicate()


def run_job(cmd, env, timeout, cwd=ROOT):
    """``subprocess.run`` for launched jobs: on a timeout the whole process group goes (the launcher *and*
    its ranks; killing only the launcher leaves ranks spinning in a collective, slowing every later test)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_hvd(np_, args, backend="gloo", timeout=180, env=None, check=True):
    """Run ``python args...`` under ``horovodrun -np np_ --backend``; return the CompletedProcess."""
    cmd = [*horovodrun(), "-np", str(np_), f"--{backend}", sys.executable, *map(str, args)]
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e["PYTHONPATH"] = ROOT
    e.update(env or {})
    proc = run_job(cmd, e, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def read_json_lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def in_threads(n, fn):
    """Run ``fn(comm)`` on ``n`` virtual ranks (simcomm alone, no trainer); every rank's result or error."""
    import threading
    from hvd_partialfc.engine.sim import SimComm, SimWorld
    world, out = SimWorld(n), [None] * n

    def target(r):
        try:
            world.enter(r)
            out[r] = fn(SimComm(world, r))
        except Exception as e:
            out[r] = e
            world.fail(r, e)
            return
        world.leave(r)
    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    world.begin()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


# --- the 4-rank run of tests/test_simulate.py and tests/test_twonode.py ------------------------------------

# test_simulate.py's job: a tiny resnet with BatchNorm and dropout (per-rank RNG), local mode with the negatives
# exchanged every 5 steps (10 steps: two exchanges, before steps 1 and 6); the cosface settings keep training
# smooth (round-off is not blown up)
SIM_SETS = ["model.name=resnet", "model.kwargs={width: 4, dropout: 0.2}", "data.batch_size=8",
            "train.log_every=5", "optim.warmup_steps=5", "optim.clip_grad_norm=5.0", "head.loss=cosface",
            "head.scale=16", "head.margin=0.2", "optim.backbone_lr=0.05", "optim.classifier_lr=0.05",
            "head.negatives_every=5", "head.negatives_share=2"]
# lr 0.01, not SIM_SETS' 0.05 (tests/test_simulate.py::test_np4_simulated_within_roundoff_of_horovodrun says why)
NP4_SETS = ["optim.backbone_lr=0.01", "optim.classifier_lr=0.01"]
NP4_STEPS = 10


def sim_train_args(shards, out, steps, sets=()):
    """``hvd-partialfc train``'s arguments of test_simulate.py's job (SIM_SETS, then ``sets``)."""
    args = ["--shards", str(shards), "--out", str(out), "--steps", str(steps)]
    for s in SIM_SETS + list(sets):
        args += ["--set", s]
    return args


@pytest.fixture(scope="session")
def shards8(tmp_path_factory):
    """16 classes x 16 images of 32x32 in 8 shards (runs on 2, 4 or 8 ranks)."""
    d = tmp_path_factory.mktemp("sim")
    return build_shards(make_image_npz(d / "i.npz", 16, 16), d / "shards", 8)


@pytest.fixture(scope="session")
def np4_run(shards8, tmp_path_factory):
    """ONE real 4-rank Horovod run (Gloo) of test_simulate.py's job with NP4_SETS for NP4_STEPS steps, and the
    same run simulated (``simulate --ranks 4``, in this process), for both tests that compare them:
    test_simulate.py's (simulated N = 4 within round-off of horovodrun -np 4) and test_twonode.py's (horovodrun
    trains 4 ranks across two nodes and agrees with the simulator). Where network-namespace nodes work, the real
    run is ``horovodrun -np 4 -H node1:2,node2:2`` across two of them (scripts/faults/twonode.py, the real
    ``horovodrun`` script, ``ssh`` = the launch agent); elsewhere ``horovodrun -np 4`` on this host, and the
    two-node test skips (as it did). Before, each test launched its own 4 ranks (25 s and 20 s here).

    Without fusion every gradient is its own allreduce, so Gloo's order of addition does not depend on which
    tensors a cycle happened to fuse (timing): with the default fusion, 1 run in ~8 here ended ~1e-2 away after
    50 steps, the round-off of another grouping amplified. Returns {"sim", "real": run folders, "nodes": whether
    the real run was across two nodes, "output"}."""
    import time
    base = tmp_path_factory.mktemp("np4")
    sim, real = base / "sim", base / "real"
    code, _ = simulate_cli(None, 4, shards8, sim, SIM_SETS + NP4_SETS, NP4_STEPS)
    assert code == 0, f"simulate --ranks 4 exited {code}"
    argv = [sys.executable, "-m", "hvd_partialfc.cli", "train", *sim_train_args(shards8, real, NP4_STEPS, NP4_SETS)]
    from scripts.faults import twonode
    nodes = None
    if twonode.tried_reason() is None:
        # names of their own (test_twonode.py's pair may be up meanwhile: its names would be torn down)
        nodes = twonode.TwoNodes(suffix=twonode.owner_suffix(), prefix="hpfc4")
        try:
            nodes.setup()
        except twonode.Unavailable:
            nodes = None
    t0 = time.time()
    if nodes is None:
        p = run_hvd(4, argv[1:], timeout=150, env={"HOROVOD_FUSION_THRESHOLD": "0"})
        out = p.stdout + p.stderr
    else:
        try:
            env = dict(nodes.launch_env(1), PYTHONPATH=ROOT, HVD_PARTIALFC_CHECK_COLLECTIVES="1",
                       HOROVOD_FUSION_THRESHOLD="0")
            p = nodes.popen(1, nodes.horovodrun_argv(argv), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
            try:
                out = p.communicate(timeout=200)[0]
            except subprocess.TimeoutExpired:
                nodes.kill_node(1), nodes.kill_node(2)
                raise AssertionError("the 4-rank run across two nodes timed out after 200 s")
            assert p.returncode == 0, out[-3000:]
        finally:
            nodes.teardown()
    print(f"np4 run: {time.time() - t0:.1f} s, " + ("across two nodes" if nodes else "on this host"))
    return {"sim": sim, "real": real, "nodes": nodes is not None, "output": out}
