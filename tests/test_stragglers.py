"""The straggler watch's logic (run/watch/stragglers.py) and the ``slow`` fault (run/watch/faults.py), in one process. The
real path (elastic torchrun agents, the slow node named, evicted, the job on without it from memory, ``info``)
is tests/test_stragglers_run.py."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, launch_env, require_horovod
from hvd_partialfc.config import ConfigError
from hvd_partialfc.config_io import load_config
from hvd_partialfc.engine.local import LocalComm
from hvd_partialfc.engine.vote import Agreed, Ballot, StepVote
from hvd_partialfc.run.watch import cpu_clock, faults
from hvd_partialfc.run.watch.device_clock import DeviceClock
from hvd_partialfc.run.watch.eviction import Eviction, off_the_store
from hvd_partialfc.run.watch.preempt import StopSignals
from hvd_partialfc.run.watch.stragglers import EVENTS, Detector, Finding, Stragglers, node_names, read_events

FAST, MID, SLOW = 0.010, 0.012, 0.024     # the lower median of (FAST, MID, SLOW) is MID: SLOW is 2.0x it


def test_a_rank_slow_in_M_counted_steps_in_a_row_is_named_once_with_its_time_since_and_then_cleared():
    """Named after M = 4 counted slow steps: warm-up steps and a held step (after a checkpoint) are not counted
    and do not break the run; M - 1 slow steps are noise; M quiet steps clear it."""
    det = Detector(["node1", "node2", "node3"], ratio=1.5, steps=4, start=0)
    det.hold(8)                                                   # a checkpoint after step 7
    seen = {}
    for step in range(1, 25):
        t = [FAST, MID, FAST]
        if step <= 4:
            t[0] = SLOW                           # slow in the warm-up (steps 1-3, not counted) and step 4 only
        if 6 <= step <= 7 or 9 <= step <= 15:
            t[2] = SLOW                           # rank 2 from step 6 (step 8, held, is fast)
        if 17 <= step <= 19:
            t[1] = 2 * SLOW                       # rank 1: three slow steps, then fast again
        seen[step] = det.observe(step, t)
    named = [(s, f) for s, (new, _) in seen.items() for f in new]
    assert [(s, f.rank, f.node, f.since) for s, f in named] == [(10, 2, "node3", 6)]
    f = named[0][1]
    assert f.own_s == pytest.approx(SLOW) and f.median_s == pytest.approx(MID)
    assert "rank 2 on node3 takes 24.0 ms a step against the median 12.0 ms (2.00x) since step 6" in f.line()
    cleared = [(s, c.rank) for s, (_, gone) in seen.items() for c in gone]
    assert cleared == [(19, 2)]                                   # quiet at steps 16-19


def test_with_two_nodes_the_slow_half_is_named():
    """The lower median: of two ranks, the faster; the mean of the two would make a 2x rank 1.33x."""
    det = Detector(["node1", "node2"], ratio=1.5, steps=3, start=0)
    named = [f for step in range(1, 10) for f in det.observe(step, [FAST, 2 * FAST])[0]]
    assert [(f.rank, f.step, f.since) for f in named] == [(1, 6, 4)]


# Recorded: the chaos run's seed 6262 under horovodrun (2 ranks, 2 shared cores), 12 steps, each rank's main thread:
# (CPU ms of the step, of them inside the engine's waits). No fault: rank 0 waited for rank 1, spinning.
SPUN = [((11.8, 4.4), (10.1, 2.7)), ((31.1, 24.1), (9.5, 0.2)), ((25.5, 14.6), (10.9, 2.5)), ((21.5, 11.8), (9.2, 0.9)),
        ((21.5, 12.0), (11.0, 3.0)), ((16.6, 6.2), (8.8, 1.2)), ((25.2, 15.1), (8.9, 0.5)), ((23.8, 13.6), (11.4, 1.9)),
        ((23.0, 10.9), (8.8, 1.2)), ((30.7, 20.1), (13.2, 4.7)), ((18.3, 7.9), (8.2, 0.6)), ((18.4, 6.7), (9.3, 1.7))]


def test_cpu_time_spent_waiting_for_the_other_ranks_is_not_own_time():
    """Horovod's wait spins (sched_yield until the collective is done), so the rank that waits burns CPU time
    there: with it counted (the recorded steps above), the waiting rank 0 was named at 2.37x; its own time leaves
    the engine's waits out (CpuClock's ``inside``: the engine's ``wait_used``), and no rank is named. The engine
    sums its wait clock over every wait (``CommBase.waiting``)."""
    def named(leave_out: bool):
        ran, inside = [0.0, 0.0], [0.0, 0.0]
        clocks = [cpu_clock.CpuClock(read=lambda r=r: (ran[r], 0.0),
                                     inside=lambda r=r: (inside[r] if leave_out else 0.0, 0.0)) for r in (0, 1)]
        det, found = Detector(["node1", "node2"], ratio=1.5, steps=10, start=-10), []
        for step, ranks in enumerate(SPUN):
            for clock, r, (cpu, waiting) in zip(clocks, (0, 1), ranks):
                clock.start()
                ran[r] += cpu / 1e3
                inside[r] += waiting / 1e3
            found += det.observe(step, [clock.step()[0] for clock in clocks])[0]
        return [(f.rank, f.step, round(f.own_s / f.median_s, 2)) for f in found]
    assert named(leave_out=False) == [(0, 10, 2.37)]
    assert named(leave_out=True) == []
    comm, clock = LocalComm(0, 1), iter([(1.0, 2.0), (1.5, 2.25), (3.0, 3.0), (3.25, 4.0)])
    comm.wait_clock = lambda: next(clock)
    comm.allreduce_tensor(torch.ones(2), "sum", "a")
    comm.allgather_tensor(torch.ones(2), "b")
    assert comm.wait_used == (0.75, 1.25) and comm.wait_s > 0


def test_node_names_are_hosts_or_torchrun_agents():
    assert node_names([("node1", "0"), ("node2", "1"), ("node2", "1")]) == (["node1", "node2", "node2"], [0, 1, 1])
    assert node_names([("vm", "0"), ("vm", "1")]) == (["vm/agent0", "vm/agent1"], [0, 1])
    assert node_names([("a", None), ("b", None)]) == (["a", "b"], [0, 1])


def _watch(tmp_path, nodes, start=0, refusal=None, **sets):
    cfg = load_config(None, ["data.shards=x", f"out={tmp_path}", "train.stragglers=evict", "train.straggler_steps=3",
                             *(f"train.{k}={v}" for k, v in sets.items())])
    lines = []
    os.makedirs(tmp_path, exist_ok=True)
    names, node_of = node_names([(n, None) for n in nodes])
    return Stragglers(cfg, LocalComm(0, len(nodes)), start, lines.append, False, names, node_of, refusal), lines


def _cast(watch):
    """This rank's entries of the loop's next vote (engine/vote.py), read back by name."""
    vote = StepVote(watch.comm, [watch])
    ballot = Ballot(vote.places, vote.length, watch.comm.rank)
    watch.cast(ballot, 0)
    return Agreed(vote.places, ballot.values)


def _until_named(watch, start):
    """Steps with the last rank at 2x until it is named; the step read after it."""
    for done in range(start + 2, start + 40):
        times = [FAST] * (len(watch.nodes) - 1) + [2 * FAST]
        watch.read(done, 0.0, times)
        if watch.detector.named:
            return done + 1
    raise AssertionError("never named")


def test_evict_decides_once_in_the_vote_not_below_min_nodes_nor_within_the_cooldown(tmp_path):
    watch, lines = _watch(tmp_path / "a", ["n1", "n2", "n3"], straggler_min_nodes=2)
    done = _until_named(watch, 0)
    assert _cast(watch).value("evict") == 3.0               # node 2 (index) + 1, for every rank to read
    out = watch.read(done, 3.0, [FAST] * 3)
    assert (out.node, out.ranks, out.mine, out.nodes_left, out.step) == ("n3", [2], False, 2, done)
    assert [e["event"] for e in read_events(str(tmp_path / "a"))] == ["named"]   # "evicted": once its snapshot is
    # taken (test_the_eviction_is_recorded_only_once_its_snapshot_is_taken)
    # two nodes and a minimum of two: named, not evicted, said
    watch, lines = _watch(tmp_path / "b", ["n1", "n2"], straggler_min_nodes=2)
    _until_named(watch, 0)
    assert _cast(watch).value("evict") == 0.0 and "n2 not evicted: 2 nodes, and train.straggler_min_nodes is 2" in lines[-1]
    # an eviction at step 150 (before this start, at 200) and a cool-down of 100 steps
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "c" / EVENTS, "w") as f:
        f.write(json.dumps({"event": "evicted", "step": 150, "node": "n9", "ranks": [3], "time": 0}) + "\n")
    watch, lines = _watch(tmp_path / "c", ["n1", "n2", "n3"], start=200, straggler_cooldown=100)
    _until_named(watch, 200)
    assert _cast(watch).value("evict") == 0.0 and "last eviction was at step 150" in lines[-1]
    # an engine that cannot go on without a node (horovodrun): named only
    watch, lines = _watch(tmp_path / "d", ["n1", "n2", "n3"], refusal="horovodrun cannot")
    _until_named(watch, 0)
    assert _cast(watch).value("evict") == 0.0


def test_own_time_is_work_not_waits(tmp_path):
    """On the CPU: this thread's time running or waiting for a core (a sleep, as a wait in a collective, costs
    none); on a GPU: the span less the data time and ``wait_s``."""
    def busy(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    span = []

    def step():                                  # 0.07 s waiting (0.02 for data, 0.05 in a collective), 0.03 working
        t0 = time.perf_counter()
        time.sleep(0.07)
        busy(0.03)
        watch.comm.wait_s += 0.05
        span.append(time.perf_counter() - t0)
        return {"data_time": 0.02}
    watch, _ = _watch(tmp_path, ["n1", "n2"])
    for cuda in (False, True):                  # the step watcher's hooks around the step (step.py)
        watch.cuda = cuda
        watch.begin(0)
        watch.end(0, step())
        assert (0.03 <= watch.own <= span[-1] - 0.07 + 0.005) if not cuda else \
            watch.own == pytest.approx(span[-1] - 0.07, abs=0.005)
    assert _cast(watch).per_rank("times") == [watch.own, 0.0]   # its own place in the vote, rank 0's


def test_own_time_on_the_cpu_counts_the_wait_for_a_core_another_process_holds(tmp_path):
    """A step of 0.1 CPU-s beside a busy process bound to the same core: never blocked, the thread was running or
    waiting for the core throughout, so its CPU time times (1 + its wait share) is its span on the wall clock."""
    if cpu_clock.fallback():
        pytest.skip(cpu_clock.fallback())
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}}); print(flush=True)\n"
                             "while True: pass"], stdout=subprocess.PIPE)
    try:
        busy.stdout.readline()
        os.sched_setaffinity(0, {core})                  # this thread only (pid 0: the caller)
        watch, _ = _watch(tmp_path, ["n1", "n2"])
        watch.cpu.settle = 0.0                           # its first second counts here (the test below)
        t0, c0 = time.perf_counter(), time.thread_time()
        watch.begin(0)
        while time.thread_time() < c0 + 0.1:
            pass
        watch.end(0, {"data_time": 0.0})
        span, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        os.sched_setaffinity(0, allowed)
        busy.kill()
        busy.wait()
    # within 15 %: the span also holds whatever wait for the core fell between the clock reads and the watch's
    # hooks (at nice 19 beside the suite's ranks, one time slice can be tens of ms; 5 % failed once at load 11),
    # and without the wait share the product would be the CPU time, at least a third short
    assert span > 1.5 * cpu and watch.own * (1 + watch.share) == pytest.approx(span, rel=0.15)


def test_the_wait_counts_as_a_share_over_seconds_against_the_median_and_without_schedstat_not_at_all(tmp_path,
                                                                                                   monkeypatch):
    """Steps of 10 ms run: in the first second no share; after it, an episode (one step that waited 30 ms after
    steps that did not) barely moves it, a steady wait reaches waited / ran within a few TAU. Against the ranks'
    lower median share: a rank that waits as the others do keeps its CPU time (the slow one, which waits least,
    too); one that waits beyond them is stretched by it. The file absent: no share, said once."""
    def shares(waits_ms):
        now = [0.0, 0.0, 0.0]                                  # ran, waited, the wall clock (seconds)
        clock = cpu_clock.CpuClock(tau=2.0, settle=1.0, read=lambda: (now[0], now[1]), now=lambda: now[2])
        out = []
        for wait_ms in waits_ms:
            clock.start()
            now[0], now[1], now[2] = now[0] + 0.010, now[1] + wait_ms / 1e3, now[2] + 0.010 + wait_ms / 1e3
            ran, share = clock.step()
            assert ran == pytest.approx(0.010)
            out.append(share)
        return out
    assert shares([30] * 20) == [0.0] * 20                     # 0.8 s: not yet counted
    kept = math.exp(-0.01 / 2.0)                               # the sums decay by e^(-span / TAU) a step
    history = 0.010 * (1 - kept ** 150) / (1 - kept)           # 1.5 s of steps that did not wait: CPU seconds, decayed
    got = shares([0] * 150 + [30] + [30] * 300)                # then one that waited 30 ms; then 12 s of them
    assert got[150] == pytest.approx(0.030 / (0.010 + history * kept ** 4), rel=1e-9)   # 0.06
    assert got[-1] == pytest.approx(3.0, rel=0.01) and got[152] < 1.0
    # 4 ranks: two alike (shares 1.0, 1.2), a slow one (2x the work, waiting least), one starved (share 3)
    assert cpu_clock.stretch([0.01, 0.01, 0.02, 0.01], [1.0, 1.2, 0.3, 3.0]) == pytest.approx(
        [0.01, 0.01 * 2.2 / 2.0, 0.02, 0.01 * 4.0 / 2.0])
    monkeypatch.setattr(cpu_clock, "PATH", str(tmp_path / "absent"))
    assert cpu_clock.fallback() == f"{tmp_path / 'absent'} is absent" and cpu_clock.read()[1] == 0.0
    lines = []
    cfg = load_config(None, ["data.shards=x", f"out={tmp_path}"])
    two = type("Two", (LocalComm,), {"allgather_object": lambda self, obj, name: [obj, obj]})(0, 2)
    Stragglers.start(cfg, two, 0, type("Log", (), {"say": lines.append, "record": print})())
    assert lines == [f"stragglers: ranks [0, 1] time their steps by CPU time alone ({tmp_path / 'absent'} is absent): a "
                     "rank slowed there by another process taking its CPU is not seen"]


class Stream:
    """A GPU stream on a simulated clock (seconds): the host queues work and events, the stream runs them in
    order, no sooner than the host queued them; ``stall_until``: the stream waits for another stream (NCCL)."""

    def __init__(self):
        self.host = self.busy = 0.0
        self.fail = False

    def run(self, seconds):
        self.busy = max(self.busy, self.host) + seconds

    def stall_until(self, t):
        self.busy = max(self.busy, self.host, t)

    def event(self):
        stream = self

        class Event:
            def record(self):
                if stream.fail:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                stream.busy = self.t = max(stream.busy, stream.host)

            def query(self):
                return self.t <= stream.host

            def elapsed_time(self, later):
                return 1e3 * (later.t - self.t)
        return Event()


def test_own_time_on_the_gpu_is_the_streams_work_not_its_stalls():
    """Two ranks under NCCL: the fast one's stream stalls at the all-reduce for the slow one, and its host spans
    are the slow one's; on the device clock each has its own work (forward, backward, optimizers), the loader's
    idle left out where the stream idled and nothing left out where it still had work queued."""
    ranks = {0: (Stream(), 0.020), 1: (Stream(), 0.040)}       # stream, forward + backward seconds
    clocks = {r: DeviceClock(s.event) for r, (s, _) in ranks.items()}
    spans, owns = {0: [], 1: []}, {0: [], 1: []}
    for step in range(4):
        for r, (s, work) in ranks.items():                     # up to the all-reduce's wait
            spans[r].append(s.host)
            clocks[r].begin()
            clocks[r].mark("wanted")
            s.host += 0.005 if step == 2 else 0.0               # the loader: the stream idles
            clocks[r].mark("arrived")
            s.run(work)
            clocks[r].mark("sync0")
        done = max(s.busy for s, _ in ranks.values()) + 0.001   # the all-reduce ends after the slow backward
        for r, (s, _) in ranks.items():
            s.stall_until(done)
            clocks[r].mark("sync1")
            s.host = s.busy                                      # read_norms: the step's host synchronisation
            s.run(0.002)                                         # both optimizers
            clocks[r].end()
            s.host = s.busy + 0.0005                             # the host finishes the step after the stream
            spans[r][-1] = s.host - spans[r][-1]
            owns[r].append(clocks[r].own())
    assert owns[0][1] == pytest.approx(0.022, abs=1e-9) and owns[1][1] == pytest.approx(0.042, abs=1e-9)
    assert owns[0][2] == pytest.approx(0.022, abs=1e-9)          # the loader's 5 ms: idle, left out
    assert spans[0][1] == pytest.approx(spans[1][1], abs=1e-9)   # the host's spans: alike
    # the host ahead of the stream: nothing is read until a step's last event completed, then the newest
    stream = Stream()
    c = DeviceClock(stream.event)
    for _ in range(3):
        c.begin()
        c.mark("wanted")
        stream.host += 0.004                                   # a loader wait while the stream is busy
        c.mark("arrived")
        stream.run(0.030)
        c.end()
    assert c.own() is None                                     # nothing finished: no read, no block
    stream.host = stream.busy
    assert c.own() == pytest.approx(0.030, abs=1e-9) and c.own() is None and not c.pending


def test_the_watch_on_a_gpu_uses_the_device_clock_and_falls_back_to_the_host(tmp_path):
    stream = Stream()
    watch, lines = _watch(tmp_path, ["n1", "n2"])
    watch.cuda, watch.clock = True, DeviceClock(stream.event)
    loader_waits = iter(range(10 ** 6))

    def gpu_step(step_no):                         # the marks the step makes (step.py), in its order
        watch.begin(step_no)
        watch.mark("wanted")
        next(loader_waits)
        stream.host += 0.010                       # each batch: a 10 ms wait on the host, the stream idle
        watch.mark("arrived")
        stream.run(0.025)
        watch.mark("sync0")
        stream.stall_until(stream.busy + 0.050)    # 50 ms stalled for the other ranks
        watch.mark("sync1")
        stream.host = stream.busy
        watch.end(step_no, {"data_time": 0.010})
    assert _cast(watch).per_rank("times") == [0.0, 0.0]   # no reading yet: unknown, a step the detector skips
    gpu_step(0)
    stream.host = stream.busy + 0.001
    gpu_step(1)                                    # step 0's events are done by now: its own time is read
    assert watch.own == pytest.approx(0.025, abs=1e-9) and not lines
    stream.fail = True                              # an error of the device's events: the host's reckoning
    watch.begin(2)
    watch.end(2, {"data_time": 0.0})
    assert watch.clock is None and len(lines) == 1 and "GPU's clock failed" in lines[0] and "illegal" in lines[0]
    watch.mark("sync0")                             # no clock: marks are nothing
    assert 0 <= watch.own < 0.05


def test_the_slow_fault_works_from_its_step_on_every_attempt_and_from_a_file(tmp_path, monkeypatch):
    def worked(step, rank, own=0.02):
        t0 = time.thread_time()
        faults.slow_work(step, rank, own)
        return time.thread_time() - t0
    monkeypatch.setenv(faults.ENV, "slow@5:1")
    monkeypatch.setenv(faults.SLOW_FACTOR, "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")     # a restarted job: a slow machine stays slow
    assert worked(4, 1) < 0.01 and worked(5, 0) < 0.01
    assert 0.04 <= worked(5, 1) < 0.1 and worked(9, 1) >= 0.04   # F - 1 = 2 times its 0.02 s
    monkeypatch.delenv(faults.ENV)
    path = tmp_path / "faults"
    monkeypatch.setenv(faults.FILE_ENV, str(path))
    assert worked(7, 0) < 0.01                                    # no file yet
    path.write_text("slow@0\n")
    assert worked(7, 0) >= 0.04
    path.unlink()
    assert worked(8, 0) < 0.01


def test_bad_straggler_settings_are_one_config_error():
    with pytest.raises(ConfigError, match="straggler_ratio=1.0"):
        load_config(None, ["data.shards=x", "train.straggler_ratio=1.0"])


def test_horovod_counts_its_synchronize_wait():
    """Horovod's DistributedOptimizer.synchronize counts its wait in ``wait_s``, as the torch engine's (a GPU
    rank's own time is its span less its waits), and the CPU time spent in it in ``wait_used`` (a CPU rank's own
    time leaves it out: Horovod's wait spins). In a process of its own: Horovod starts threads."""
    require_horovod()
    code = ("import torch; from hvd_partialfc.engine.horovod import init; from hvd_partialfc.run.watch import cpu_clock; "
            "c = init('cpu'); c.wait_clock = cpu_clock.read; "
            "m = torch.nn.Linear(4, 4); o = c.distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), m); "
            "m(torch.ones(2, 4)).sum().backward(); o.synchronize(); print(c.wait_s, c.wait_used[0])")
    p = subprocess.run([sys.executable, "-c", code], env=launch_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    wait_s, spent = map(float, p.stdout.split()[-2:])
    assert wait_s > 0 and 0 < spent <= wait_s + 0.01


def test_an_event_goes_to_metrics_jsonl_stragglers_jsonl_and_tensorboard_as_its_line(tmp_path):
    pytest.importorskip("tensorboard", reason="scripts/setup/install.sh installs tensorboard; this venv lacks it")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from hvd_partialfc.run.metrics_log import MetricsLog
    watch, lines = _watch(tmp_path, ["n1", "n2", "n3"])
    metrics = MetricsLog(str(tmp_path), tensorboard=True)
    watch.record_event = metrics.write               # rank 0's metrics.jsonl (train_log.TrainLog.record in a run)
    for done in range(2, 12):
        watch.read(done, 0.0, [FAST, FAST, 2 * FAST])
    metrics.close()
    (event,) = [r["straggler"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))]
    assert event == read_events(str(tmp_path))[0] and event["line"] == lines[0] and "rank 2 on n3" in lines[0]
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    (text,) = ea.Tensors("stragglers/text_summary")
    assert text.step == event["step"] and text.tensor_proto.string_val[0].decode() == lines[0]


def _named(watch, slow):
    """Counted steps at ``slow`` (rank: its factor over FAST) until every slow rank is named; the step read after."""
    for done in range(2, 40):
        watch.read(done, 0.0, [FAST * slow.get(r, 1.0) for r in range(len(watch.nodes))])
        if set(watch.detector.named) == set(slow):
            return done + 1
    raise AssertionError("never named")


def test_the_node_serving_the_rendezvous_store_is_never_evicted_the_next_slowest_is_in_one_line(tmp_path):
    """The store's node (``store_node``, from ``Comm.hosts_rendezvous``) named: not evicted, and the next slowest
    named rank's node is, said in one line; named alone: nothing is evicted. Another node named: evicted as
    before. The pure choice: the slowest off the store's node, by own time over median."""
    watch, lines = _watch(tmp_path / "a", ["n1", "n2", "n3", "n4"], straggler_min_nodes=2)
    watch.store_node = 1                                     # n2 serves torchrun's rendezvous store
    _named(watch, {1: 3.0, 2: 2.0})                          # both named at the same step, n2 the slower
    assert _cast(watch).value("evict") == 3.0                # n3 (index 2) + 1
    (said,) = [line for line in lines if "not evicted" in line]
    assert said.endswith("n2 not evicted: it serves torchrun's rendezvous store (the job ends without it); "
                         "evicting n3 instead, the next slowest (rank 2, 2.00x)")
    assert [e["event"] for e in read_events(str(tmp_path / "a"))] == ["named", "not evicted", "named"]
    watch, lines = _watch(tmp_path / "b", ["n1", "n2", "n3"], straggler_min_nodes=2)
    watch.store_node = 2
    _named(watch, {2: 2.0})                                  # the store's node alone named: none
    assert _cast(watch).value("evict") == 0.0 and lines[-1].endswith("no other straggler to evict")
    watch, lines = _watch(tmp_path / "c", ["n1", "n2", "n3"], straggler_min_nodes=2)
    watch.store_node = 0
    _named(watch, {2: 2.0})                                  # another node: evicted, no line about the store
    assert _cast(watch).value("evict") == 3.0 and not any("store" in line for line in lines)
    f = [Finding(9, r, f"n{r + 1}", own, 0.01, 5) for r, own in enumerate([0.03, 0.016, 0.02, 0.025])]
    node_of = [0, 1, 1, 2]                                   # ranks 1 and 2 share node 1, the store's
    assert off_the_store(f[3], f, node_of, 1) == (f[3], "")
    pick, line = off_the_store(f[1], f, node_of, 1)
    assert pick is f[0] and "evicting n1 instead, the next slowest (rank 0, 3.00x)" in line
    assert off_the_store(f[1], f[1:3], node_of, 1)[0] is None
    assert off_the_store(f[1], f, node_of, None) == (f[1], "")


class _LeaveComm:
    """The calls an evicted node's rank makes when it leaves, in order (``agree`` stands for the collective)."""

    def __init__(self, calls):
        self.calls = calls

    def agree(self, error, name):
        self.calls.append(("agree", name.split(".")[1]))

    def stop_agent(self):
        self.calls.append(("stop_agent",))


def test_every_rank_of_the_evicted_node_ignores_sigterm_and_all_agree_before_its_agent_is_stopped(monkeypatch):
    """The agent, stopped, sends SIGTERM to every rank of its node: each must already ignore it. With two ranks
    on the node, the one that signals (its first) must wait until the other ignores it too: an agreement of
    every rank between the ignoring and the stop, and one after (the others restart without the agent)."""
    calls = []
    monkeypatch.setattr(signal, "signal", lambda sig, handler: calls.append(("signal", sig, handler)))
    Eviction(7, "n2", [1, 2], True, 1).part(_LeaveComm(calls))
    ignore = ("signal", signal.SIGTERM, signal.SIG_IGN)
    assert calls == [ignore, ("agree", "ignore"), ("stop_agent",), ("agree", "leave")]
    calls.clear()
    Eviction(7, "n2", [1, 2], False, 1).part(_LeaveComm(calls))     # a rank of another node: the same agreements
    assert calls == [("agree", "ignore"), ("agree", "leave")]


class _Log:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)

    say = write

    def record(self, rec):
        pass


def _loop_with_an_agreed_eviction(tmp_path, done, total=10):
    """A loop (trainer.Trainer, its parts stubbed) whose vote agreed the eviction of n3 after step ``done``, with
    disk checkpoints only (no memory snapshots)."""
    from types import SimpleNamespace as NS
    from hvd_partialfc.run.trainer import BuiltRun, RunData, Trainer
    watch, _ = _watch(tmp_path, ["n1", "n2", "n3"], straggler_min_nodes=2)
    cfg, comm = watch.cfg, watch.comm
    data = RunData(NS(num_samples=100), NS(slices=[(0, 8)] * 3), None, None, 10)
    checkpointer = NS(scheduled=lambda d, final: False, due=lambda d, final: final)
    run = BuiltRun(None, NS(total_steps=total, length=None), data, None, checkpointer, NS(due=lambda d, final: False))
    loop = Trainer(cfg, comm, run)
    loop.log, loop.signals, loop.stragglers = _Log(), StopSignals(), watch
    watch.heard(NS(value=lambda slot: 3.0, per_rank=lambda slot: [FAST] * 3), done)   # the vote's eviction
    return loop


def test_the_eviction_is_recorded_only_once_its_snapshot_is_taken(tmp_path):
    """A stop at the same step, the last step, or the snapshot failing cancels the agreed eviction: no "evicted"
    record (it would start the cool-down at the next start). Uncancelled: recorded after its snapshot."""
    from hvd_partialfc.run_files import CheckpointError
    run = tmp_path / "stop"
    loop = _loop_with_an_agreed_eviction(run, 5)
    loop.signals.requested = True                                   # a stop signal in the same vote
    loop.save_checkpoint = lambda step, averaged=False: "ckpt-5"
    assert loop._side_work(5, False) and loop.stopped_by and loop.eviction is None
    run = tmp_path / "last"
    loop = _loop_with_an_agreed_eviction(run, 10)
    loop.save_checkpoint = lambda step, averaged=False: "ckpt-10"
    assert not loop._side_work(10, True) and loop.eviction is None
    run = tmp_path / "failed"
    loop = _loop_with_an_agreed_eviction(run, 5)

    def full_disk(step, averaged=False):
        raise CheckpointError("no space left on device")
    loop.save_checkpoint = full_disk
    with pytest.raises(CheckpointError):
        loop._side_work(5, False)
    for run in ("stop", "last", "failed"):
        assert "evicted" not in [e["event"] for e in read_events(str(tmp_path / run))], run
    run = tmp_path / "evicted"
    loop = _loop_with_an_agreed_eviction(run, 5)
    seen = []

    def snapshot(step, averaged=False):
        seen.append([e["event"] for e in read_events(str(run))])   # what was recorded while it was taken
        return "ckpt-5"
    loop.save_checkpoint = snapshot
    assert loop._side_work(5, False) and loop.eviction.where == "ckpt-5"
    assert seen == [[]]
    (event,) = read_events(str(run))
    assert (event["event"], event["step"], event["node"], event["ranks"]) == ("evicted", 5, "n3", [2])
    assert "(ckpt-5)" in event["line"]


def test_the_agent_serving_the_rendezvous_store_is_the_one_listening_on_its_endpoints_port():
    """torchrun_agent.py: the endpoint's port from the agent's command line (either spelling, ``=``, torchrun's
    ``PET_`` variables, torch's default ports; none for etcd), and a process's listening ports from /proc (here
    this process's own socket, against the port the OS gave it). Under real torchrun: test_stragglers_run.py."""
    import socket
    from hvd_partialfc.engine.torchrun_agent import listening_ports, rendezvous_port
    run = ["python", "/venv/bin/torchrun", "--nnodes", "1:2"]
    assert rendezvous_port(run + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29611", "x.py"], {}) == 29611
    assert rendezvous_port(run + ["--rdzv_backend=c10d", "--rdzv_endpoint=[::1]:7"], {}) == 7
    assert rendezvous_port(run + ["--rdzv-backend=c10d", "--rdzv-endpoint=node1"], {}) == 29400
    assert rendezvous_port(run, {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "node1:1234"}) == 1234
    assert rendezvous_port(run + ["--master-port", "4321"], {}) == 4321 and rendezvous_port(run, {}) == 29500
    assert rendezvous_port(run + ["--rdzv-backend", "etcd", "--rdzv-endpoint", "node1:2379"], {}) is None
    assert rendezvous_port(run + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"], {}) is None
    with socket.socket() as listening, socket.socket() as bound:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))                          # bound, not listening: not counted
        ports = listening_ports(os.getpid())
        assert listening.getsockname()[1] in ports and bound.getsockname()[1] not in ports
