"""`hvd-partialfc simulate --ranks N` against real `horovodrun -np N` runs, and its run folder.

At N = 2 the simulated run must be the real run bitwise (backbone, its optimizer state, every rank's
classifier, its optimizer state and RNG streams, the logged losses): per-rank BatchNorm statistics, per-rank
RNG streams (dropout draws from them), the averaged gradient and the negatives exchange all enter these
numbers. At N = 4 Gloo's ring sums in another order: the difference is round-off grown by 10 steps, as
large as between two real runs with different Horovod fusion settings (docs/simulate.md, measured over 50).
Both use their default intra-op thread count, cores // N per rank (the count changes the rounding).
"""
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import helpers_np2
from conftest import (NP4_STEPS, SIM_SETS as SETS, in_threads, launch_env, read_json_lines, sim_train_args,
                      simulate_cli)

pytestmark = pytest.mark.multirank

# SETS (conftest.SIM_SETS): a tiny resnet with BatchNorm and dropout (per-rank RNG), local mode with the negatives
# exchanged every 5 steps (10 steps: two exchanges, before steps 1 and 6); the cosface settings keep training
# smooth (round-off is not blown up). shards8 (conftest): 16 classes x 16 images of 32x32 in 8 shards.


def simulate(ranks, shards, out, steps, *sets):
    """The command line a user runs (``hvd-partialfc simulate ...``), through the CLI in this process (a
    separate process cost 2-3 s more for its imports; the runs' numbers are the same: they are compared
    bitwise with horovodrun's)."""
    code, text = simulate_cli(None, ranks, shards, out, SETS + list(sets), steps)
    if code != 0:
        raise AssertionError(f"simulate exited {code}")


NP2_CASES = [("local", 10, 5, False), ("global", 4, 2, True)]


def np2_sets(mode, log_every, sync):
    return [f"head.mode={mode}", "checkpoint.every=10", f"train.log_every={log_every}",
            f"model.sync_batchnorm={str(sync).lower()}"]


def _np2_items(request, folder):
    """The real runs of both NP2_CASES, items of the shared ``horovodrun -np 2`` (Gloo) launch
    (tests/helpers_np2.py): ``hvd-partialfc train`` for each, one after the other in one process (the console
    script's code, one Horovod start-up; test_engines.py compares its runs bitwise the same way). Each run's
    numbers are its own: the simulated runs they are compared with bitwise run in this process, after
    whatever ran before them. Each run's folder: ``folder(mode)/run``."""
    shards8 = request.getfixturevalue("shards8")
    return [{"train": mode, "args": sim_train_args(shards8, os.path.join(folder(mode), "run"), steps,
                                                   np2_sets(mode, log_every, sync))}
            for mode, steps, log_every, sync in NP2_CASES]


NP2_PART = helpers_np2.Part("simulate", fixture="np2_real", build=_np2_items, timeout=200)


@pytest.fixture(scope="module")
def np2_real(request):
    """{mode: the real run's folder} of NP2_CASES (``_np2_items``), once both ranks ended it."""
    launch = helpers_np2.shared(request)
    return {mode: os.path.join(launch.done(mode), "run") for mode, *_ in NP2_CASES}


def latest(run):
    base = os.path.join(run, "checkpoints")
    return os.path.join(base, open(os.path.join(base, "latest")).read().strip())


def load_run(run):
    ck = latest(run)
    meta = json.load(open(os.path.join(ck, "meta.json")))
    bb = torch.load(os.path.join(ck, "backbone.pt"), weights_only=True)
    cls = [torch.load(os.path.join(ck, f), weights_only=True) for f in meta["classifier_files"]]
    losses = {m["step"]: m["loss"] for m in read_json_lines(os.path.join(run, "metrics.jsonl")) if "loss" in m}
    return meta, bb, cls, losses


def _tensors(obj, prefix=""):
    """Every tensor of a nested dict/list, by path (optimizer states, RNG states)."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def assert_bitwise(a, b):
    """Bitwise the same run: backbone (BatchNorm statistics included), optimizers, classifiers, streams."""
    (ma, ba, ca, la), (mb, bb, cb, lb) = load_run(a), load_run(b)
    assert ma["step"] == mb["step"] and ma["world_size"] == mb["world_size"]
    assert ma["digests"] == mb["digests"]
    for part in ("state_dict", "optimizer"):
        ta, tb = _tensors(ba[part]), _tensors(bb[part])
        assert ta.keys() == tb.keys() and ta
        assert all(torch.equal(ta[k], tb[k]) for k in ta), part
    for x, y in zip(ca, cb):
        # the torch stream (numpy's and Python's are seeded from the OS in every process: never equal)
        for part in ("weight", "optimizer", "head_state", ("rng", "torch")):
            ta, tb = (_tensors(x[part]), _tensors(y[part])) if isinstance(part, str) else \
                (_tensors(x[part[0]][part[1]]), _tensors(y[part[0]][part[1]]))
            assert ta.keys() == tb.keys()
            assert all(torch.equal(ta[k], tb[k]) for k in ta), (x["rank"], part)
    assert la == lb and len(la) >= 2


def max_param_diff(a, b):
    (_, ba, ca, _), (_, bb, cb, _) = load_run(a), load_run(b)
    d = max((ba["state_dict"][k] - bb["state_dict"][k]).abs().max().item()
            for k, v in ba["state_dict"].items() if v.is_floating_point() and "running" not in k)
    return max(d, max((x["weight"] - y["weight"]).abs().max().item() for x, y in zip(ca, cb)))


@pytest.mark.parametrize("mode,steps,log_every,sync", NP2_CASES)
def test_np2_simulated_equals_horovodrun_bitwise(shards8, np2_real, tmp_path, in_process, mode, steps, log_every,
                                                 sync):
    """Bitwise, every feature at least twice, two logged losses. ``local``, 10 steps: per-rank BatchNorm
    statistics, dropout from per-rank RNG streams, the averaged gradient and two negatives exchanges (before
    steps 1 and 6). ``global`` with ``model.sync_batchnorm``, 4 steps (each costs Horovod ~1.3 CPU-seconds
    here): the gather in the forward and the reduce in the backward, and a collective per BatchNorm layer
    inside autograd's forward and backward (tests/test_syncbn.py checks its numbers; here that Horovod runs
    it as the simulator does). ``global`` with per-rank BatchNorm is no separate case: it is these two paths
    together."""
    sim, hvd = tmp_path / "sim", np2_real[mode]
    sets = np2_sets(mode, log_every, sync)
    simulate(2, shards8, sim, steps, *sets)
    assert_bitwise(sim, hvd)
    if sync:   # and the option reaches the trainer: with per-rank BatchNorm the same run ends elsewhere
        plain = tmp_path / "plain"
        _simulate_here(2, shards8, plain, steps, *sets[:-1])     # in this process: no bitwise claim on it
        d = max_param_diff(sim, plain)
        print("sync vs plain", d)
        assert d > 1e-4, d


def test_np4_simulated_within_roundoff_of_horovodrun(np4_run):
    """Simulated N = 4 against ``horovodrun -np 4`` over 10 steps (two negatives exchanges): round-off, not
    bitwise. Measured on this 2-core machine at lr 0.01: 10 steps 7.1e-8 apart (20 steps: 1.9e-7; 50: 9.9e-6,
    and 1.1e-6 on another machine); with the simulator's gradient average mutated by 1% (x 1.01 in
    ``SimComm.average_gradients``): 2.2e-4 (5 steps: 3.0e-5; 20: 5.2e-4; 50: 3.0e-3). The bound 2e-5 sits
    x280 above the first and x11 below the second (at 50 steps, with 2e-4: x20 and x15).

    The real run is conftest.np4_run's, which test_twonode.py's horovodrun test checks too: across two
    network-namespace nodes where they work (2 ranks each; 1.2e-7 from the simulator there, 2026-12-07), else on
    this host; without Horovod's fusion (HOROVOD_FUSION_THRESHOLD=0: conftest says why)."""
    # lr 0.01 (conftest.NP4_SETS), not SETS' 0.05: at 0.05 the step-1 difference is round-off (7e-9) on every
    # machine, but where 50 steps take it depends on the CPU's kernels: 2e-5 on one machine, and on another
    # (2026-12-01) a jump x100 at step 6 (the end of the warm-up) grew it to 1e-2, the same figure in every
    # repetition. At 0.01 the same pair of runs ends 1.1e-6 apart there after 50 steps.
    sim, hvd = np4_run["sim"], np4_run["real"]
    assert load_run(hvd)[0]["world_size"] == 4 and load_run(hvd)[0]["step"] == NP4_STEPS
    diff = max_param_diff(sim, hvd)
    print("np4 diff", diff, "across two nodes" if np4_run["nodes"] else "on this host")
    # not bitwise (Gloo's ring adds in another order), but round-off; pooled BatchNorm or a shared RNG
    # give ~1e-1 at lr 0.05
    assert 0 < diff < 2e-5, diff
    la, lb = load_run(sim)[3], load_run(hvd)[3]
    assert la.keys() == lb.keys() and max(abs(la[k] - lb[k]) / lb[k] for k in la) < 1e-3


@pytest.fixture
def in_process():
    """``simulate()`` in this process: the torch thread count and the random streams are put back after."""
    import random
    import numpy as np
    threads, state = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    yield
    torch.set_num_threads(threads)
    torch.set_rng_state(state[0]), np.random.set_state(state[1]), random.setstate(state[2])


def _simulate_here(ranks, shards, out, steps, *sets):
    """``simulate`` through its API, in a thread with a deadline (a deadlock fails instead of hanging)."""
    from hvd_partialfc.config_io import load_config
    from hvd_partialfc.run.simulate import simulate as run
    cfg = load_config(None, SETS + list(sets), {"data": {"shards": shards}, "out": str(out),
                                               "train": {"steps": steps}})
    box = {}

    def target():
        try:
            box["result"] = run(cfg, ranks)
        except Exception as e:
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(90)
    assert not t.is_alive(), "simulate did not finish (deadlock?)"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_resume_failure_info_export(shards8, tmp_path, in_process, monkeypatch):
    from hvd_partialfc.tools.export import export_backbone, run_summary
    from hvd_partialfc.run.simulate import SimFailure
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    sets = ("checkpoint.every=4", "checkpoint.keep=5")
    _simulate_here(2, shards8, whole, 10, *sets)
    # rank 1 raises before step 7, outside any collective: rank 0 must not wait forever for it
    monkeypatch.setenv("HVD_PARTIALFC_FAULT", "raise@6:1")
    with pytest.raises(SimFailure) as failed:
        _simulate_here(2, shards8, broken, 10, *sets)
    assert failed.value.rank == 1 and type(failed.value.error).__name__ == "InjectedFault"
    assert os.path.basename(latest(broken)) == "step-00000004"
    monkeypatch.delenv("HVD_PARTIALFC_FAULT")
    _simulate_here(2, shards8, broken, 10, *sets, "checkpoint.resume=auto")
    assert_bitwise(broken, whole)
    # a stop signal to the process (here: received before the start) stops every virtual rank at the same
    # step, with a checkpoint; the resumed run is the uninterrupted one, BatchNorm statistics included (the
    # extra checkpoint's rank files keep each rank's own: trainer.save_checkpoint; before, they differed)
    from hvd_partialfc.run.watch.preempt import StopSignals
    stopped = tmp_path / "stopped"
    with StopSignals() as main:
        os.kill(os.getpid(), signal.SIGTERM)
        result = _simulate_here(2, shards8, stopped, 10, *sets)
    assert main.received == "SIGTERM" and result.stopped_by == "SIGTERM"
    assert os.path.basename(latest(stopped)) == "step-00000002"
    _simulate_here(2, shards8, stopped, 10, *sets, "checkpoint.resume=auto")
    assert_bitwise(stopped, whole)
    s = run_summary(str(whole))
    assert s["world_size"] == 2 and s["digests_agree"] and s["step"] == 10
    assert [(r["label_start"], r["label_end"]) for r in s["ranks"]] == [(0, 8), (8, 16)]
    info = export_backbone(str(whole), str(tmp_path / "bb.pt"), rank=1)
    assert info["digest"] == load_run(whole)[0]["digests"][1]
    monkeypatch.chdir(tmp_path)              # what info and export print names the paths as given, never
    s, info = run_summary("whole"), export_backbone("whole", "bb2.pt")   # an absolute machine path
    assert not os.path.isabs(s["checkpoint"]) and s["checkpoint"].startswith("whole") and info["out"] == "bb2.pt"


def test_stop_signal_reaches_threads():
    """The main thread's StopSignals is what a virtual rank's StopSignals reports (no handler in threads)."""
    from hvd_partialfc.run.watch.preempt import StopSignals
    seen = []

    def rank():
        with StopSignals() as s:
            seen.append(s.received)
            ready.set()
            go.wait(10)
            seen.append(s.received)

    ready, go = threading.Event(), threading.Event()
    with StopSignals() as main:
        t = threading.Thread(target=rank)
        t.start()
        ready.wait(10)
        os.kill(os.getpid(), signal.SIGUSR1)
        go.set()
        t.join(10)
        assert main.received == "SIGUSR1"
    assert seen == [None, "SIGUSR1"]


def test_collectives_mismatch_and_the_average():
    from hvd_partialfc.engine.base import RankFailure
    # rank 1 calls another collective than rank 0: both stop with the names, neither waits forever
    out = in_threads(2, lambda c: c.allreduce_scalar(c.rank, "sum", name=f"step{c.rank}"))
    assert all(isinstance(e, RankFailure) for e in out) and "step0" in str(out[0]) + str(out[1])
    # the average is the sum over ranks in rank order times 1/N (Horovod's Average), out of place per rank
    vals = [torch.randn(1000) for _ in range(3)]
    out = in_threads(3, lambda c: c.grouped_average([vals[c.rank]], name="g")[0])
    expect = ((vals[0] + vals[1]) + vals[2]) * (1.0 / 3)
    assert all(torch.equal(o, expect) for o in out) and out[0] is not out[1]
    # the all-gather's backward: this rank's rows of the SUM over ranks of the gradients, x grad_scale
    def gather(c):
        x = torch.full((c.rank + 1, 2), float(c.rank), requires_grad=True)
        y = c.allgather_with_grad(x, "f", grad_scale=3.0)                          # (1 + 2 + 3, 2)
        (y * (c.rank + 1)).sum().backward()
        return y.detach(), x.grad
    out = in_threads(3, gather)
    assert torch.equal(out[0][0], torch.tensor([[0.0] * 2, [1.0] * 2, [1.0] * 2, [2.0] * 2, [2.0] * 2, [2.0] * 2]))
    for r, (_, g) in enumerate(out):
        assert torch.equal(g, torch.full((r + 1, 2), (1 + 2 + 3) * 3.0))


def test_simcomm_imports_no_horovod():
    code = "import sys, hvd_partialfc.engine.sim, hvd_partialfc.engine.base; assert 'horovod' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launch_env())
    assert r.returncode == 0, r.stderr


def test_each_virtual_rank_has_its_own_random_streams(in_process):
    """Draws of the process-global generators (torch, numpy, Python) between collectives are each rank's own
    streams, as in a process per rank: compared with each rank's draws made alone, in one thread. Covers
    numpy's skipped save/restore when unchanged (``simcomm._Streams``), including a Gaussian cached by
    ``np.random.randn`` and consumed after the baton went round, and ranks whose numpy stream is untouched."""
    import random

    import numpy as np

    def draws(rank, comm=None):
        torch.manual_seed(10 + rank)
        random.seed(20 + rank)
        if rank != 1:                      # rank 1 never seeds numpy: it keeps the process's start state
            np.random.seed(30 + rank)
        out = []
        for step in range(4):
            out += [torch.rand(2).tolist(), random.random(), np.random.randn(1).tolist()]   # odd: one cached
            if comm is not None:
                comm.allreduce_scalar(1.0, "sum", name=f"s{step}")
            out += [np.random.randn(1).tolist()]                                       # the cached one
            if rank == 2 and step == 1:
                out += [np.random.rand(3).tolist()]
            if comm is not None:
                comm.allreduce_scalar(1.0, "sum", name=f"t{step}")
        return out

    def same_key_other_cache(rank, comm=None):
        # both ranks unseeded: after their first draws their Mersenne Twister states are equal, but rank 1's
        # holds a cached Gaussian and rank 0's does not; rank 0's next draw must not take rank 1's
        out = [np.random.randn(2 if rank == 0 else 1).tolist()]
        if comm is not None:
            comm.allreduce_scalar(1.0, "sum", name="u")
        return out + [np.random.randn(1).tolist()]

    start = np.random.get_state()          # every run below starts here (in_process puts all streams back)
    alone, alone2 = [], []
    for r in range(3):
        np.random.set_state(start)
        alone.append(draws(r))
    for r in range(2):
        np.random.set_state(start)
        alone2.append(same_key_other_cache(r))
    np.random.set_state(start)
    sim = in_threads(3, lambda c: draws(c.rank, c))
    np.random.set_state(start)
    sim2 = in_threads(2, lambda c: same_key_other_cache(c.rank, c))
    assert not any(isinstance(o, Exception) for o in sim + sim2), (sim, sim2)
    assert sim == alone and sim2 == alone2
    assert alone[0] != alone[2] and alone[1][2] != alone[0][2]     # the ranks' streams differ: it can tell


def test_run_start_prints_the_exchange_and_the_sampling_warning_once(shards8, tmp_path, in_process, capsys):
    """What fit() prints before the first step (Trainer.startup_notes), on rank 0 only (both virtual ranks
    print to this process's stdout: once means rank 0 alone): the negatives' exchange and its cost, and, for
    sampled local scoring int(0.25 x 8) = 2 rows of a slice, the warning. One step each, in this process."""
    capsys.readouterr()
    _simulate_here(2, shards8, tmp_path / "run", 1, "head.sample_rate=0.25")
    printed = capsys.readouterr().out
    assert printed.count("cross-shard negatives: every 5 steps, 2 of 8 centres shared per rank") == 1
    assert printed.count("warning: head.sample_rate=0.25 scores 2 of this rank's 8 classifier rows") == 1
    _simulate_here(2, shards8, tmp_path / "quiet", 1, "head.negatives_every=0")
    quiet = capsys.readouterr().out
    assert "cross-shard negatives:" not in quiet and "warning: head.sample_rate" not in quiet
