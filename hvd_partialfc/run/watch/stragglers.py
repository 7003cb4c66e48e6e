"""Stragglers (``train.stragglers: off | warn | evict``, docs/reliability.md "Stragglers"): the rank that slows
every rank, named; with ``evict`` under elastic torchrun, the job goes on without its node.

The step is synchronous: every rank waits for the slowest at the gradient all-reduce, so one slow rank (a
throttled GPU, a degraded link, a noisy neighbour) costs the whole job while every health check passes. The
ranks' step times are all alike (the fast ones wait); what tells the slow one apart is its *own* time a step,
its work and not its waits (``own_time``):

* on a GPU, the step's time on the GPU's own clock less the stream's stalls for the loader and for the
  gradient averaging (device_clock.py, CUDA events, no host synchronisation). The host's clock cannot tell:
  under NCCL the host blocks at the step's read of the norms on a stream stalled for the slowest rank, so
  every rank's span is the slowest's (a host span less host waits named no one under the torch engine);
* on the CPU, the CPU time of the rank's main thread over the step, stretched where it has lately waited for a
  CPU (runnable, not running) more than the ranks' median (cpu_clock.py, its share in the vote's ``waits``):
  more work (a slower core, the ``slow`` fault) and less CPU (another process on its cores, a cgroup's quota)
  both show; a wait (for a collective, for the data workers) blocks and costs neither, and what the thread spends
  inside the engine's waits is left out (Horovod's wait spins: ``CommBase.wait_used``). The span less the waits
  was measured first and named healthy ranks: 2 ranks on 2 shared cores (a 200-step MLP run, no fault), rank
  0's span less waits had a 10-step median of 2.5x rank 1's, its extra 5 ms a step spent in the backward pass
  without CPU time (its CPU time: 4.2 ms, rank 1's 4.1).
  Where the kernel gives no run-queue delay, the CPU time alone (said in one line at start): a rank slowed by
  less CPU is not seen there.

* **Gathered in the vote, every step.** Each rank puts its time of step S at its own place of the loop's per-step
  vote (engine/vote.py: the per-rank slots ``times`` and ``waits``, read a step later): the vote is an
  elementwise max, so every rank reads every rank's time with no collective of its own: 2N float64 more in an
  all-reduce that runs anyway (8 KB at 512 ranks), overlapped with the next step.
* **Named by rank 0** (``Detector``): a rank whose time is at least ``train.straggler_ratio`` times the step's
  median in ``train.straggler_steps`` counted steps in a row. The lower median: with two nodes a whole slow
  node is half the ranks, and the mean of the two middle times would hide it. One line (rank, node, its time
  against the median, since which step), an event record in metrics.jsonl (TensorBoard: the line as text) and
  ``RUN/stragglers.jsonl`` (which ``hvd-partialfc info`` lists); every training record carries the slowest
  rank's ratio and the count named (TensorBoard's scalars), the progress line the named rank. Not counted, so
  never a reason: the first ``WARMUP`` steps after a (re)start, alike on every rank, and the step after a
  checkpoint, an evaluation or a memory snapshot (``hold``): a rank slow only while it writes or evaluates is not
  a straggler. A held step neither extends nor breaks a run of slow steps.
* **Evicted** (``evict``): rank 0 puts the node in the next vote; at the step that reads it every rank takes an
  agreed snapshot (a memory snapshot, committed, or a disk checkpoint without them: trainer.py), and only then
  is the eviction recorded (a stop, the last step or an error at that step cancels it); the node's ranks all
  ignore SIGTERM before its first rank stops their torchrun agent (eviction.py) and exit ``EXIT_EVICTED``, and
  the others exit 75, so that their agents restart them without it, re-sharded, from that snapshot: no step is
  lost. Never below ``train.straggler_min_nodes``, never within ``train.straggler_cooldown`` steps of the run's
  last eviction (``RUN/stragglers.jsonl``, read at each start), never where the engine cannot go on without a
  node (``Comm.regroup_refusal``: horovodrun, the simulator; said once at start, and the run warns instead),
  never the node serving torchrun's rendezvous store (``Comm.hosts_rendezvous``: the job ends without it; the
  next slowest named node instead, or none, in one line). The node may join again later, as any node may
  (torchrun's ``--nnodes MIN:MAX``).
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import cpu_clock, faults
from .device_clock import DeviceClock
from .eviction import Eviction, nodes_text, off_the_store
from ...engine.vote import Slot

EVENTS = "stragglers.jsonl"
WARMUP = 3             # steps after a (re)start that are not counted: start-up work, alike on every rank


@dataclass
class Finding:
    """A rank named at ``step`` (the step whose times named it): its mean time over the run of slow steps that
    began at ``since``, against the mean of those steps' medians (seconds)."""

    step: int
    rank: int
    node: str
    own_s: float
    median_s: float
    since: int

    def line(self) -> str:
        return (f"step {self.step}: straggler: rank {self.rank} on {self.node} takes {1e3 * self.own_s:.1f} ms a step "
                f"against the median {1e3 * self.median_s:.1f} ms ({self.own_s / self.median_s:.2f}x) since step "
                f"{self.since}")


class Detector:
    """Rank 0's reading of every rank's times (see the module's docstring). Pure: times in, findings out."""

    def __init__(self, nodes: Sequence[str], ratio: float, steps: int, start: int):
        self.nodes, self.ratio, self.steps, self.start = list(nodes), ratio, steps, start
        n = len(self.nodes)
        self.run, self.quiet, self.since = [0] * n, [0] * n, [0] * n   # slow steps in a row, quiet ones, first
        self.sums = [[0.0, 0.0] for _ in range(n)]                     # its times, the medians, over the run
        self.named: Dict[int, Finding] = {}
        self.held: set = set()
        self.worst: List[float] = []       # the slowest rank's ratio of each counted step since the last take

    def hold(self, step: int) -> None:
        """Step ``step`` is not counted (it follows a checkpoint, an evaluation or a snapshot)."""
        self.held.add(step)

    def observe(self, step: int, times: Sequence[float]) -> Tuple[List[Finding], List[Finding]]:
        """Every rank's own time of ``step`` (seconds, in rank order): the ranks named at it, and the named ones
        that have been below the ratio for ``steps`` counted steps."""
        if step in self.held or step <= self.start + WARMUP or len(times) != len(self.nodes) or min(times) <= 0:
            self.held = {s for s in self.held if s > step}
            return [], []
        median = sorted(times)[(len(times) - 1) // 2]                  # the lower median
        self.worst.append(max(times) / median)
        new, cleared = [], []
        for r, t in enumerate(times):
            if t >= self.ratio * median:
                self.since[r] = step if self.run[r] == 0 else self.since[r]
                self.run[r] += 1
                self.quiet[r] = 0
                self.sums[r][0] += t
                self.sums[r][1] += median
                if self.run[r] == self.steps and r not in self.named:
                    self.named[r] = Finding(step, r, self.nodes[r], self.sums[r][0] / self.steps,
                                            self.sums[r][1] / self.steps, self.since[r])
                    new.append(self.named[r])
            else:
                self.run[r], self.sums[r] = 0, [0.0, 0.0]
                self.quiet[r] += 1
                if self.quiet[r] == self.steps and r in self.named:
                    cleared.append(self.named.pop(r))
        return new, cleared

    def take_worst(self) -> Optional[float]:
        """The mean, over the counted steps since the last call, of the slowest rank's ratio (None: none)."""
        worst, self.worst = self.worst, []
        return sum(worst) / len(worst) if worst else None


def node_names(idents: Sequence[Tuple[str, Optional[str]]]) -> Tuple[List[str], List[int]]:
    """Every rank's node name and node index from its (host name, torchrun agent) pair: a torchrun agent is a
    node (several agents on one host: ``host/agentG``); without torchrun, the host."""
    keys: Dict[Tuple[str, Optional[str]], int] = {}
    for ident in idents:
        keys.setdefault(tuple(ident), len(keys))
    shared = {h for h, _ in keys if sum(1 for k in keys if k[0] == h) > 1}
    names = [f"{h}/agent{g}" if h in shared else h for h, g in idents]
    return names, [keys[tuple(i)] for i in idents]


def read_events(run_dir: str) -> List[Dict[str, Any]]:
    """``RUN/stragglers.jsonl``: every straggler named, cleared or evicted in the run (none: [])."""
    try:
        with open(os.path.join(run_dir, EVENTS)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def event_line(e: Dict[str, Any]) -> str:
    """One event of ``RUN/stragglers.jsonl`` as ``hvd-partialfc info`` lists it."""
    if e.get("event") == "named":
        return (f"step {e['step']}: rank {e['rank']} on {e['node']} named: {1e3 * e['own_s']:.1f} ms a step against "
                f"{1e3 * e['median_s']:.1f} ms ({e['own_s'] / e['median_s']:.2f}x) since step {e['since']}")
    if e.get("event") == "evicted":
        return f"step {e['step']}: {e['node']} evicted (ranks {e['ranks']})"
    return f"step {e.get('step')}: {e.get('node')} {e.get('event')}"


class Stragglers:
    """This rank's side: its own time a step (a step watcher, step.py), its part of the loop's vote (engine/vote.py),
    and on rank 0 the detector and the decision. ``start`` is a collective unless the watch is off (the same on
    every rank: the config and the engine). ``say``: rank 0's lines; ``record``: rank 0's metrics.jsonl."""

    def __init__(self, cfg, comm, start_step: int, say: Callable[[str], None], cuda: bool = False,
                 nodes: Sequence[str] = (), node_of: Sequence[int] = (), refusal: Optional[str] = None,
                 record: Optional[Callable[[Dict[str, Any]], None]] = None, store_node: Optional[int] = None):
        t = cfg.train
        self.comm, self.cfg, self.say, self.cuda = comm, cfg, say, cuda
        self.record_event = record or (lambda rec: None)
        self.active = bool(nodes)
        self.slots = (Slot("evict"), Slot("times", per_rank=True), Slot("waits", per_rank=True)) \
            if self.active else ()
        self.nodes, self.node_of, self.refusal = list(nodes), list(node_of), refusal
        self.store_node = store_node   # the node serving torchrun's rendezvous store: never evicted (None: none)
        self.own = self.share = 0.0   # this rank's own time of its last step; on the CPU its wait share (cpu_clock)
        self._start: Tuple[float, float] = (0.0, 0.0)
        self.clock = DeviceClock() if cuda and self.active else None   # the GPU's clock (device_clock.py)
        self.cpu = cpu_clock.CpuClock(inside=lambda: comm.wait_used)      # the CPU's (cpu_clock.py)
        if self.active and not cuda:   # its seconds inside the engine's waits, left out of the own time
            comm.wait_clock = cpu_clock.read
        self.evict_flag = 0.0        # rank 0: the node (index + 1) the next vote evicts
        self.eviction: Optional[Eviction] = None   # the eviction the vote agreed
        self.detector = Detector(nodes, t.straggler_ratio, t.straggler_steps, start_step) \
            if self.active and comm.is_main else None
        self.last_eviction = None
        if self.detector:
            past = [e["step"] for e in read_events(cfg.out) if e.get("event") == "evicted" and e["step"] <= start_step]
            self.last_eviction = max(past, default=None)

    @classmethod
    def start(cls, cfg, comm, start_step: int, log, cuda: bool = False) -> "Stragglers":
        """``log``: where rank 0 says and records (train_log.TrainLog); ``cuda``: the step runs on a GPU (its own
        time is measured so)."""
        mode = cfg.train.stragglers
        if mode == "off" or comm.size == 1 or not comm.times_ranks:
            return cls(cfg, comm, start_step, log.say, cuda)
        idents = comm.allgather_object((socket.gethostname(), os.environ.get("GROUP_RANK"),
                                        None if cuda else cpu_clock.fallback()), name="stragglers.nodes")
        nodes, node_of = node_names([i[:2] for i in idents])
        blind = [r for r, i in enumerate(idents) if i[2]]
        if blind:
            log.say(f"stragglers: ranks {blind} time their steps by CPU time alone ({idents[blind[0]][2]}): a rank "
                    "slowed there by another process taking its CPU is not seen")
        refusal = comm.regroup_refusal() if mode == "evict" else None
        if refusal:
            log.say(f"train.stragglers=evict: {refusal}; stragglers are named, not evicted")
        store = None
        if mode == "evict" and not refusal:   # the same on every rank: the config and the engine
            hosts = comm.allgather_object(comm.hosts_rendezvous(), name="stragglers.store")
            if any(hosts):
                store = node_of[hosts.index(True)]
                log.say(f"train.stragglers=evict: {nodes[hosts.index(True)]} serves torchrun's rendezvous store: "
                        "never evicted (the job ends without it)")
        return cls(cfg, comm, start_step, log.say, cuda, nodes, node_of, refusal, record=log.record,
                   store_node=store)

    # --- a step watcher (step.py): this rank's own time ----------------------------------------------------

    def begin(self, step: int) -> None:
        self._start = (time.perf_counter(), self.comm.wait_s)
        self.cpu.start()
        self._on_clock(DeviceClock.begin)

    def mark(self, name: str) -> None:
        """``wanted`` / ``arrived`` around each wait for a batch, ``sync0`` / ``sync1`` around the gradient
        average: marked on the device clock (nothing without one)."""
        self._on_clock(DeviceClock.mark, name)

    def end(self, step: int, figures) -> None:
        """The step's own time (``own_time``, or on a GPU the device clock's: the newest step the GPU has
        finished); the ``slow`` fault's work (faults.py) is part of it."""
        if self.clock is None and not self.cuda:   # the CPU: a slower core multiplies the CPU time
            faults.slow_work(step, self.comm.rank, self.cpu.ran())
            self.own, self.share = self.cpu.step()
            return
        if self.clock is None:
            faults.slow_work(step, self.comm.rank, self.own_time(self._start, figures["data_time"]))
            self.own = self.own_time(self._start, figures["data_time"])
            return
        faults.slow_work(step, self.comm.rank, self.own)
        self._on_clock(DeviceClock.end)
        own = self._on_clock(DeviceClock.own)
        if own is not None:
            self.own = own

    def _on_clock(self, method, *args):
        """``method(clock, *args)``; an error of the device's events turns the clock off for the run (one line):
        the host's reckoning (``own_time``) takes over."""
        if self.clock is None:
            return None
        try:
            return method(self.clock, *args)
        except RuntimeError as e:
            self.clock = None
            self.say(f"stragglers: the GPU's clock failed ({' '.join(str(e).split())[:200]}); own times are "
                     "the host's from here")
            return None

    def own_time(self, start: Tuple[float, float], data_time: float) -> float:
        """Seconds of a GPU rank's own work since ``start`` (wall clock, ``wait_s``) when its clock failed:
        the span less the data and collective waits (right where the host blocks in the collectives: Horovod's
        ``synchronize``). On the CPU: ``self.cpu`` (cpu_clock.py)."""
        return time.perf_counter() - start[0] - data_time - (self.comm.wait_s - start[1])

    # --- a part of the loop's vote (engine/vote.py) --------------------------------------------------------

    def cast(self, ballot, done: int) -> None:
        """The eviction rank 0 decided, and this rank's own time and (on the CPU) its wait share at its place (the
        device clock's 0 until its first reading: unknown, a step the detector does not count)."""
        ballot.put("evict", self.evict_flag)
        ballot.put("times", self.own if self.clock is not None else max(self.own, 1e-9))
        ballot.put("waits", self.share)

    def heard(self, agreed, done: int) -> None:
        """Read after step ``done`` (the times of step ``done - 1``): rank 0 names and decides; every rank learns
        the eviction the vote agreed, if any."""
        self.eviction = self.read(done, agreed.value("evict"), agreed.per_rank("times"), agreed.per_rank("waits"))

    def due(self, done: int, final: bool) -> bool:
        """An agreed eviction: the loop takes its snapshot and leaves (not at the last step: nothing is left)."""
        return self.eviction is not None and not final

    def hold(self, step: int) -> None:
        """Side work (a checkpoint, an evaluation, a snapshot) came after step ``step``: the next is not counted."""
        if self.detector:
            self.detector.hold(step + 1)

    def read(self, done: int, evict: float, times: Sequence[float], waits: Sequence[float] = ()) -> Optional[Eviction]:
        """Every rank's times of step ``done - 1`` (on the CPU stretched by their wait shares ``waits``:
        cpu_clock.stretch) and the eviction flag, as the vote agreed them: rank 0 names and decides; every rank
        returns the agreed eviction, if any."""
        if not self.active:
            return None
        if self.detector:
            new, cleared = self.detector.observe(done - 1, cpu_clock.stretch(times, waits) if waits else list(times))
            for f in new:
                self._event(f.line(), "named", f.step, **{k: v for k, v in asdict(f).items() if k != "step"})
                self._decide(f)
            for f in cleared:
                self._event(f"step {done - 1}: rank {f.rank} on {f.node} is no longer a straggler (named at step "
                            f"{f.step})", "cleared", done - 1, rank=f.rank, node=f.node)
        node = int(evict) - 1
        if node < 0:
            return None
        ranks = [r for r, n in enumerate(self.node_of) if n == node]
        return Eviction(done, self.nodes[ranks[0]], ranks, self.comm.rank in ranks, len(set(self.node_of)) - 1)

    def evicting(self, out: Eviction) -> None:
        """Rank 0, once the eviction is certain (its snapshot taken: trainer.py): its line and its record. Not at
        the vote that agreed it: a stop, the last step or an error at that step still cancels it, and a record
        of an eviction that never happened would start the cool-down (read from ``RUN/stragglers.jsonl``)."""
        if self.detector:
            self._event(f"step {out.step}: evicting {out.node} (ranks {out.ranks}) after this step's snapshot "
                        f"({out.where}); the job goes on with {nodes_text(out.nodes_left)}", "evicted", out.step,
                        node=out.node, ranks=out.ranks)

    def _decide(self, f: Finding) -> None:
        """Rank 0, on a new finding under ``evict``: the eviction of its node in the next vote, or why not."""
        t = self.cfg.train
        if t.stragglers != "evict" or self.refusal or self.evict_flag:
            return
        left = len(set(self.node_of)) - 1
        if left < t.straggler_min_nodes:
            why = f"{nodes_text(left + 1)}, and train.straggler_min_nodes is {t.straggler_min_nodes}"
        elif self.last_eviction is not None and f.step - self.last_eviction < t.straggler_cooldown:
            why = (f"the last eviction was at step {self.last_eviction}, within train.straggler_cooldown="
                   f"{t.straggler_cooldown} steps")
        else:
            pick, line = off_the_store(f, list(self.detector.named.values()), self.node_of, self.store_node)
            if line:
                self._event(line, "not evicted", f.step, node=f.node)
            if pick:
                self.evict_flag = float(self.node_of[pick.rank] + 1)   # read by every rank with the next vote
            return
        self._event(f"step {f.step}: {f.node} not evicted: {why}", "not evicted", f.step, node=f.node)

    def _event(self, line: str, event: str, step: int, **fields) -> None:
        """Rank 0: the line, and the event in metrics.jsonl and RUN/stragglers.jsonl."""
        self.say(line)
        rec = dict(event=event, step=step, **fields, line=line, time=time.time())
        self.record_event({"step": step, "straggler": rec, "time": rec["time"]})
        try:
            with open(os.path.join(self.cfg.out, EVENTS), "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:   # the line and metrics.jsonl have it; the cool-down then counts from the start
            self.say(f"stragglers: cannot append to {os.path.join(self.cfg.out, EVENTS)}: {e.strerror}")

    # --- the log line ------------------------------------------------------------------------------------

    def record(self) -> Dict[str, float]:
        """Rank 0's figures for a training record: the slowest rank's ratio to the median (mean over the counted
        steps since the last record) and how many ranks are named now."""
        if not self.detector:
            return {}
        worst = self.detector.take_worst()
        return ({"straggler_ratio": worst} if worst is not None else {}) | {"stragglers": len(self.detector.named)}

    def postfix(self) -> Dict[str, str]:
        """The progress line's part: the named ranks, while any is."""
        named = self.detector.named if self.detector else {}
        return {"slow": ",".join(f"r{r}@{f.node}" for r, f in sorted(named.items()))} if named else {}
