"""scripts/gpu/gpu_speed_check.py's bookkeeping around the GPU's cells, on CPU with stand-ins for the steps: what
a device call brings back when the stage is cut, what stays allocated between contenders, and the count
that says whether reduce-overhead ran CUDA graphs. tests/test_gpu_check.py runs the real cells at toy sizes."""
from __future__ import annotations

import gc
import weakref

import pytest

from scripts.gpu import gpu_speed_check as gsc


class _Parts:
    """A built step's stand-in: its objects refer to each other, as the real parts do (only gc frees them)."""

    def __init__(self):
        self.me = self


@pytest.fixture
def no_automatic_gc():
    """The collector runs only when asked: whether memory is freed between contenders is then deterministic."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_each_contender_alone_finds_the_last_ones_freed(monkeypatch, no_automatic_gc):
    alive = []

    def run(a):
        assert all(ref() is None for ref in alive), "the previous contender's parts are still allocated"
        parts = _Parts()
        alive.append(weakref.ref(parts))
        return {"contenders": {a.contenders: {"median_ms": 2.0 if a.contenders == "arcface" else 1.0}}}
    monkeypatch.setattr(gsc.cmp, "run", run)
    s = gsc.sizes(tiny=True, arcface="")
    out = gsc.compare_alone(gsc.compare_args(s, "somewhere", "resnet", 50, 2))
    assert len(alive) == 3 and out["contenders"]["local"]["speed_vs_arcface"] == 2.0


def test_a_stage_cut_inside_a_cell_keeps_the_table(monkeypatch, tmp_path):
    def cut():
        raise SystemExit(-15)       # as the stage's timeout ends the process: no code after the cell runs
    monkeypatch.setattr(gsc, "plan", lambda s, work, out, arcface: [("switches", 1, lambda: {"cells": {}}),
                                                                      ("profile-r50", 1, cut)])
    with pytest.raises(SystemExit):
        gsc.main([str(tmp_path), str(tmp_path / "out"), "--tiny"])
    table = (tmp_path / "out" / "speed_table.md").read_text()
    assert "| iresnet50, 125k-class local head: samples/s |" in table and "profile-r50: not run" in table


def test_reduce_overhead_says_when_it_ran_without_cuda_graphs(monkeypatch):
    from torch._dynamo.utils import counters

    def step(a, mode, device, total):
        fn = lambda batches: None   # noqa: E731
        fn.compiled = {"compile": "model"}
        return fn

    def measure(a, device, contenders):
        if "compiled" in contenders:
            counters["inductor"]["cudagraph_skips"] += 2       # as inductor counts a skip
        return {name: {"median_ms": 1.0, "samples_per_s": 2.0} for name in contenders}
    monkeypatch.setattr(gsc.cmp, "our_step", step)
    monkeypatch.setattr(gsc.cmp, "device_batches", lambda a, device, classes: iter(()))
    monkeypatch.setattr(gsc.cmp, "measure", measure)
    s = gsc.sizes(tiny=True, arcface="")
    graphs = gsc.switches(s, {"defaults": [], "compiled": gsc.COMPILES["compile-cudagraphs"]}, "resnet")
    assert graphs["cudagraph_skips"] == 2
    assert "cudagraph_skips" not in gsc.switches(s, {"defaults": [], "compiled": gsc.COMPILES["compile-model"]},
                                                 "resnet")
