"""Two-rank work of several test files under ONE ``horovodrun -np 2`` launch (tests/mr/np2_launch.py), and
their one-rank work (Horovod alone, size 1) in ONE process.

A launch costs a launcher and two rank start-ups (~10 CPU-s here, most of it ``import torch``), a process
~4 CPU-s, whatever they then run. The files whose two-rank work is only inspected afterwards (test_faces_e2e,
test_modes, test_negatives, test_simulate, test_train_multirank) each name their part at module level::

    NP2_PART = helpers_np2.Part("modes", fixture="np2", build=_items, timeout=180)

(``NP1_PART``, with ``np=1``: the one-rank work), and their module fixture asks for it with
``helpers_np2.shared(request)`` (``np=1``: the one-rank part). The first to ask starts ONE launch (Gloo) or
process holding the part of every file that has a selected test using its part's fixture (this session's
items: a file run alone launches its own part alone), cheapest part first, and the runs that must fail after
every other item (a part that fails ends the launch: the parts after it leave nothing, and their tests say
so). Each part's items are in their own folders, ``<launch>/<part>/<name>``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from conftest import MR, launch_env, run_hvd, run_job

LAUNCH = os.path.join(MR, "np2_launch.py")


@dataclass
class Part:
    """A file's part of the shared launch: ``build(request, folder)`` returns its items (tests/mr/np2_launch.py's,
    named relative to its part; ``folder(name)`` is where item ``name``'s files go), asking ``request`` for
    conftest's fixtures only (it may be another file's request: the first to ask); ``fixture``: the module
    fixture that asks for it; ``timeout``: its share of the launch's limit (seconds); ``np``: its ranks (2: the
    Gloo launch; 1: the one process)."""
    name: str
    fixture: str
    build: Callable
    timeout: int
    np: int = 2


class Launch:
    """A finished launch (``proc``: None where it timed out) seen from one part (``prefix``: its folder)."""

    def __init__(self, out, proc, prefix: str = "", np: int = 2):
        self.out, self.proc, self.prefix, self.np = out, proc, prefix, np

    def folder(self, name: str) -> str:
        """Item ``name``'s folder: what each rank printed (``rank-<r>.log``), its result, its files."""
        return os.path.join(self.out, self.prefix, name)

    def why(self) -> str:
        if self.proc is None:
            return "timed out"
        return (f"exited {self.proc.returncode}\n--- stdout\n{self.proc.stdout[-3000:]}\n--- stderr\n"
                f"{self.proc.stderr[-5000:]}")

    def done(self, name: str) -> str:
        """Item ``name``'s folder, once every rank ended it as expected; else AssertionError with the launch's
        end."""
        folder = self.folder(name)
        if not all(os.path.exists(os.path.join(folder, f"done-rank-{r}")) for r in range(self.np)):
            raise AssertionError(f"item {self.prefix}/{name} did not finish: the launch {self.why()}")
        return folder

    def results(self, name: str) -> List[Dict]:
        """Every rank's ``{"code", "seconds", "log"}`` of train item ``name``."""
        folder = self.folder(name)
        paths = [os.path.join(folder, f"rank-{r}") for r in range(self.np)]
        if not all(os.path.exists(f"{p}.result.json") for p in paths):
            raise AssertionError(f"item {self.prefix}/{name} left no result: the launch {self.why()}")
        return [dict(json.load(open(f"{p}.result.json")), log=open(f"{p}.log").read()) for p in paths]


def launch(out, items: List[Dict], backend: str = "gloo", timeout: int = 600, np: int = 2) -> Launch:
    """``items`` under one ``horovodrun -np 2 --BACKEND`` (tests/mr/np2_launch.py), or ``np=1``: in one process
    (no launcher: Horovod alone, size 1), in folder ``out``."""
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, "spec.json")
    with open(spec, "w") as f:
        json.dump({"out": str(out), "items": items}, f)
    try:
        if np == 1:
            proc = run_job([sys.executable, LAUNCH, spec], launch_env(), timeout=timeout)
        else:
            proc = run_hvd(2, [LAUNCH, spec], backend=backend, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc = None   # the items that ended before still have their files
    return Launch(str(out), proc, np=np)


_SHARED: Dict[tuple, Launch] = {}    # (np, part name) -> the launch that ran it


def _parts(request, np: int) -> List[Part]:
    """The parts of this session's selected tests (those using their part's fixture), and the asking one."""
    asking = getattr(request.module, f"NP{np}_PART")
    found: Dict[str, Part] = {asking.name: asking}
    for item in request.session.items:
        part: Optional[Part] = getattr(getattr(item, "module", None), f"NP{np}_PART", None)
        if part is not None and part.fixture in getattr(item, "fixturenames", ()):
            found.setdefault(part.name, part)
    return sorted(found.values(), key=lambda p: p.timeout)


def _named(part: Part, item: Dict) -> Dict:
    key = "scenario" if "scenario" in item else "train"
    return dict(item, **{key: f"{part.name}/{item[key]}"})


def _start(request, parts: List[Part], np: int) -> Launch:
    out = request.getfixturevalue("tmp_path_factory").mktemp(f"np{np}_shared")
    items = [_named(p, i) for p in parts
             for i in p.build(request, lambda name, p=p: os.path.join(out, p.name, name))]
    items = [i for i in items if not i.get("expect_error")] + [i for i in items if i.get("expect_error")]
    done = launch(out, items, timeout=sum(p.timeout for p in parts), np=np)
    for p in parts:
        _SHARED[np, p.name] = done
    return done


def shared(request, np: int = 2) -> Launch:
    """The shared Gloo launch (``np=1``: the one-rank process) as the asking module's part sees it: started at
    the first call this session, with every part found then; a part found by no test then (asked for from
    inside a test) gets its own."""
    part = getattr(request.module, f"NP{np}_PART")
    first = not any(key[0] == np for key in _SHARED)
    done = _SHARED.get((np, part.name)) or _start(request, _parts(request, np) if first else [part], np)
    return Launch(done.out, done.proc, part.name, np)
