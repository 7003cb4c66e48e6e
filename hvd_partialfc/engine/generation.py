"""The torch engine's generations: a group whose survivors re-form it in their own processes after a lost rank,
under launch/torch_inprocess.py (docs/evidence/reliability.md, "Going on in the same processes").

Why not torchrun: its agent ends every local worker when one fails, and every agent restarts its workers when a
node joins (scripts/studies/elastic_torch/FINDINGS.md, "4"). So the launcher only starts the ranks and a store
process (engine/gen_store.py) that trains nothing and outlives them, and the group is the engine's own:

* generation g is ``init_process_group`` on ``PrefixStore("gen{g}/pg/", store)``: fresh keys every time, so no
  key of a failed generation is read again (1-9 ms to form in the study);
* a lost peer surfaces as a Gloo error in the next collective (a killed peer: ~25 ms) or through the heartbeat
  ring (a hung one, a cut link), which calls ``abort``: this rank's Gloo sockets are cut, so every collective of
  the group fails at once, here and in the peers blocked on this rank (Gloo has no abort of its own);
* who is left is agreed through the store: each survivor writes ``gen{g}/join/ID`` (ID: its launcher rank, for
  the process's life), waits until every member of the last generation has joined or is known dead (the store
  process's death watch writes ``dead/ID`` when a member's connection closes without a goodbye; a member that
  is neither is left out after ``JOIN_DEADLINE_S``), and the first to see that commits the list with one
  ``compare_set``: every survivor takes the same list, the new ranks are the survivors in their old order, and a
  member not in it (too late) is fenced: it leaves the job;
* the old group is destroyed by ``reform``, called after the failed attempt's ``except`` clause has ended
  (cli_train.py): a traceback holding the failed collective's frames keeps the group's sockets open, and a peer
  blocked on this rank then waited for them (the study's 10 s).

Where the store is lost there is no new generation: the rank says so in one line and exits for a relaunch
(``EXIT_RELAUNCH``), resuming then from the run's newest state as any restart does.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .device import agreed_device, uses_cuda
from .fd_sockets import cut, open_sockets, opened_since
from .gen_store import BYE, ENV, WATCH_KEY, dead_key
from .torchdist import CHECK_ENV, TorchComm, _allgather_host

JOINERS = "joiners/count"           # processes that asked to join so far (``Generations.join``)
DONE = "job/done"                   # the run ended (its last group's ``shutdown``)
# a member neither joined nor known dead by then is left out: a hung one, but also one busy alone that long (rank 0
# evaluating while a peer dies): it is fenced when it comes. A lease thread would tell the two apart (not built).
JOIN_DEADLINE_S = 10.0
JOIN_ENV = "HVD_PARTIALFC_GEN_JOIN"   # "1": this process joins a running job (launch/torch_inprocess.py, REJOIN)
STORE_TIMEOUT_S = 60.0              # the longest a store call waits (a key not there yet, the store's connection)
FORM_TRIES = 5                      # generations tried in a row (each failed to form: one more member lost)
EXIT_FENCED = 3                     # this process was left out of the group (``reform``)
EXIT_RELAUNCH = 1                   # the store is lost: no generation can form; a relaunch resumes the run
Member = Tuple[int, str]            # (launcher rank, host name)


class StoreLost(RuntimeError):
    """The store process cannot be reached: no new generation can form."""


def _lost(address: str, error: BaseException) -> str:
    return f"its store ({address}) is lost ({type(error).__name__}: {str(error).splitlines()[0][:160]})"


class Generations:
    """This process's link to the store process: its store connection, its death-watch connection, the
    generation it is in and that generation's members."""

    def __init__(self, address: str, member: int, members: List[Member], timeout_s: float):
        host, _, port = address.rpartition(":")
        self.member, self.members, self.g, self.gloo, self.seen = member, members, 0, {}, 0
        self.store_address, self.lost = address, False
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        self.watch = socket.create_connection((host, int(self.store.get(WATCH_KEY))), timeout=30)
        self.watch.sendall(f"{member}\n".encode())

    def form(self, backend: str, timeout: timedelta) -> int:
        """``init_process_group`` of generation ``g`` among ``members`` (a collective of them); this rank in it.
        The sockets it opens are noted: ``abort`` cuts them."""
        rank = [m for m, _ in self.members].index(self.member)
        before = open_sockets()
        dist.init_process_group(backend, store=dist.PrefixStore(f"gen{self.g}/pg/", self.store), rank=rank,
                                world_size=len(self.members), timeout=timeout)
        self.gloo = opened_since(before)
        return rank

    def agree(self) -> Optional[List[Member]]:
        """The members of generation g + 1 (see the module's docstring): the old members that joined it, then the
        processes that asked to join the job since (``join``), this process now in it; None when it was left out
        (fenced). Raises StoreLost when the store cannot be reached."""
        g, old, host = self.g + 1, [m for m, _ in self.members], socket.gethostname()
        key = f"gen{g}/members"
        try:
            self.store.set(f"gen{g}/join/{self.member}", host)
            deadline = time.monotonic() + JOIN_DEADLINE_S
            while not self.store.check([key]):
                joined = [m for m in old if self.store.check([f"gen{g}/join/{m}"])]
                known = len(joined) + sum(self.store.check([dead_key(m)]) for m in old if m not in joined)
                if known == len(old) or time.monotonic() > deadline:
                    members = [[m, self.store.get(f"gen{g}/join/{m}").decode()] for m in joined]
                    upto = self.joiners()
                    members += [json.loads(self.store.get(f"joiners/{n}")) for n in range(self.seen + 1, upto + 1)]
                    self.store.compare_set(key, "", json.dumps({"members": members, "joiners": upto}))
                    break
                time.sleep(0.005)
            commit = json.loads(self.store.get(key))
            for n in range(self.seen + 1, commit["joiners"] + 1):    # tell the newcomers (the same on every member)
                self.store.set(f"joiners/{n}/gen", str(g))
        except (RuntimeError, OSError) as e:      # torch's DistNetworkError / DistStoreError are RuntimeErrors
            raise StoreLost(_lost(self.store_address, e)) from None
        members = [(int(m), str(h)) for m, h in commit["members"]]
        if self.member not in [m for m, _ in members]:
            return None
        self.g, self.members, self.seen = g, members, commit["joiners"]
        return members

    def joiners(self) -> int:
        """How many processes have asked to join the job so far (``join``). Not a collective."""
        return int(self.store.add(JOINERS, 0))

    def join(self, timeout_s: float) -> None:
        """This process, started while the job runs (a restarted rank), asks to join: the members notice at their
        next step (``GenComm.hosts_changed``), checkpoint it and re-form with this process last; returns once
        it is a member of that generation. Not a collective."""
        n = int(self.store.add(JOINERS, 1))
        self.store.set(f"joiners/{n}", json.dumps([self.member, socket.gethostname()]))
        self.store.delete_key(dead_key(self.member))          # an earlier process of the same rank's death
        deadline = time.monotonic() + timeout_s
        while not self.store.check([f"joiners/{n}/gen"]):
            if self.store.check([DONE]) or time.monotonic() > deadline:
                print(f"[rank {self.member}] the job ended before this process could join it", file=sys.stderr,
                      flush=True)
                self.close()
                raise SystemExit(0)
            time.sleep(0.05)
        self.g = int(self.store.get(f"joiners/{n}/gen"))
        commit = json.loads(self.store.get(f"gen{self.g}/members"))
        self.members, self.seen = [(int(m), str(h)) for m, h in commit["members"]], commit["joiners"]

    def reachable(self) -> None:
        """Raise StoreLost unless the store answers. Not a collective."""
        try:
            self.store.check([WATCH_KEY])
        except (RuntimeError, OSError) as e:
            raise StoreLost(_lost(self.store_address, e)) from None

    def close(self) -> None:
        """Say goodbye to the death watch (a normal end: not dead). Not a collective."""
        try:
            self.watch.sendall(BYE)
            self.watch.close()
        except OSError:
            pass


class GenComm(TorchComm):
    """The torch engine's ``Comm`` in a generation; ``reform`` gives the next generation's."""

    gens: Generations
    request: Tuple[str, bool, float] = ("auto", False, 0.0)     # device, share_gpu, timeout_s: as ``init``'s
    aborted: bool = False
    gloo: dict = None       # the sockets of this generation's group (``Generations.form``): ``abort`` cuts them

    def reformable(self) -> bool:
        return True

    def hosts_changed(self) -> bool:
        """Rank 0: a process asked to join since this generation formed (one store round trip a step); the loop's
        vote tells every rank, which checkpoint at the same step and re-form with it (run/watch/hosts.py). A lost
        store says no: it matters at the next re-form only. Not a collective."""
        if self.rank != 0 or self.gens.lost:
            return False
        try:
            return self.gens.joiners() > self.gens.seen
        except (RuntimeError, OSError):
            self.gens.lost = True          # asked once: torch logs every failed store call
            return False

    def abort(self) -> None:
        """Cut this rank's Gloo connections: a collective this rank or a peer waits in fails at once. From any
        thread (the heartbeat's). Not a collective."""
        self.aborted = True
        cut(self.gloo)

    def broken(self, error: BaseException) -> bool:
        """A Gloo error (a peer lost, a connection cut) in ``error`` or its causes, or this rank aborted."""
        while error is not None:
            if self.aborted or isinstance(error, dist.DistError) or \
                    (isinstance(error, RuntimeError) and "gloo" in str(error).lower()):
                return True
            error = error.__cause__ or error.__context__
        return False

    def reform(self, failed: bool = True) -> Optional["GenComm"]:
        """Leave this generation (destroyed; a failed one's sockets cut first), agree on the next one's members
        and form it. SystemExit(EXIT_FENCED) when this process was left out, SystemExit(EXIT_RELAUNCH) when the
        store is lost."""
        if failed:
            self.abort()
        try:
            for _ in range(FORM_TRIES):
                if dist.is_initialized():
                    dist.destroy_process_group()
                if self.gens.agree() is None:
                    print(f"[rank {self.rank}] not part of the job any more: the others re-formed the group "
                          f"without this process (it came too late); exit {EXIT_FENCED}", file=sys.stderr,
                          flush=True)
                    self.gens.close()
                    raise SystemExit(EXIT_FENCED)    # not 0: the run is not done (the launcher may start it again)
                try:
                    return _form(self.gens, *self.request)
                except RuntimeError as e:       # another member lost while forming: the next generation
                    self.gens.reachable()
                    why = str(e).splitlines()[0][:160]
                    print(f"[rank {self.rank}] generation {self.gens.g} failed to form ({why}); agreeing on the next",
                          file=sys.stderr, flush=True)
            raise StoreLost(f"no generation formed in {FORM_TRIES} tries")
        except StoreLost as e:
            print(f"[rank {self.rank}] cannot re-form the group in this process: {e}; exit {EXIT_RELAUNCH} for a "
                  "relaunch, which resumes the run's newest state", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_RELAUNCH) from None

    def shutdown(self) -> None:
        """The group ends with the run: a process still waiting to join ends too (``Generations.join``)."""
        super().shutdown()
        try:
            self.gens.store.set(DONE, "1")
        except (RuntimeError, OSError):
            pass
        self.gens.close()


def _form(gens: Generations, device: str, share_gpu: bool, timeout_s: float) -> GenComm:
    """Generation ``gens.g``'s group and its Comm (the GPU agreed again, as ``torchdist.init`` does)."""
    backend = "cpu:gloo,cuda:nccl" if uses_cuda(device) else "gloo"
    rank = gens.form(backend, timedelta(seconds=timeout_s))
    size = len(gens.members)
    if gens.g == 0:
        local_rank, local_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    else:
        hosts = [h for _, h in gens.members]
        local_rank, local_size = hosts[:rank].count(hosts[rank]), hosts.count(hosts[rank])
    where, shared = agreed_device(device, rank, local_rank, size, share_gpu, _allgather_host)
    comm = GenComm(rank, size, local_rank, local_size, torch.device("cpu") if shared else where,
                   check_names=os.environ.get(CHECK_ENV, "") not in ("", "0"))
    comm.gens, comm.gloo, comm.request = gens, gens.gloo, (device, share_gpu, timeout_s)
    return comm


def init(device: str, share_gpu: bool, timeout_s: float) -> GenComm:
    """Generation 0: the launcher's ranks (``RANK``, ``WORLD_SIZE``), each linked to the store process at
    ``HVD_PARTIALFC_GEN_STORE``; with ``HVD_PARTIALFC_GEN_JOIN=1`` (a rank the launcher started again) the
    generation that takes this process in (``Generations.join``). A collective of the launched ranks."""
    member, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gens = Generations(os.environ[ENV], member, [(m, "") for m in range(size)], min(timeout_s, STORE_TIMEOUT_S))
    if os.environ.get(JOIN_ENV) == "1":
        t0 = time.monotonic()
        gens.join(timeout_s)
        print(f"[rank {member}] joined the running job as rank {[m for m, _ in gens.members].index(member)} of "
              f"{len(gens.members)} after {time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return _form(gens, device, share_gpu, timeout_s)
