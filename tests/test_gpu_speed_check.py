"""scripts/gpu/gpu_speed_check.py's bookkeeping around the GPU's cells, on CPU with stand-ins for the steps: what
a GPU call brings back when the stage is cut, what stays allocated between contenders, and the count
that says whether reduce-overhead ran CUDA graphs. tests/test_gpu_check.py runs the real cells at toy sizes."""
from __future__ import annotations

import gc
import json
import tarfile
import time
import weakref

import pytest
import torch

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
    monkeypatch.setattr(gsc, "plan", lambda s, work, out, arcface, left: [("switches", 1, lambda: {"cells": {}}),
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


def test_each_cell_reaches_the_calls_out_before_the_next_starts(monkeypatch, tmp_path):
    """The GPU call brings back what its $OUT holds when it is cut: speed.json, the table and gpu_check.tgz
    are there after each cell (they used to be packed at the call's end only). The first cell runs out of
    device memory: recorded as such, and the next cell goes on."""
    call_out, work = tmp_path / "call_out", tmp_path / "work"
    call_out.mkdir()
    seen = {}

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def look():
        seen["speed"] = json.loads((call_out / "speed.json").read_text())
        seen["table"] = (call_out / "speed_table.md").read_text()
        with tarfile.open(call_out / "gpu_check.tgz") as tar:
            seen["packed"] = tar.getnames()
        return {"cells": {}}
    monkeypatch.setattr(gsc, "plan", lambda *args: [("largest-r50", 1, oom), ("switches", 1, look)])
    monkeypatch.setenv("GPU_PUBLISH_FROM", str(work))
    monkeypatch.setenv("GPU_PUBLISH_TO", str(call_out))
    assert gsc.main([str(work), str(work / "gpu_check")]) == 0
    assert [(c["name"], c["status"]) for c in seen["speed"]["cells"]] == [("largest-r50", "oom")]
    assert "largest-r50: oom (out of memory: CUDA out of memory" in seen["table"]
    assert "gpu_check/speed.json" in seen["packed"]
    final = json.loads((call_out / "speed.json").read_text())
    assert [(c["name"], c["status"]) for c in final["cells"]] == [("largest-r50", "oom"), ("switches", "ok")]


def test_a_cell_is_cut_at_its_limit_and_none_starts_past_the_deadline(monkeypatch, tmp_path):
    """A cell that hangs is cut at its limit (here 0.3 s) and the next one runs; one whose estimate does not fit
    the call's deadline is skipped, saying so. The old loop had no limit inside the stage: a hang took the
    stage's whole timeout with it."""
    from scripts.gpu import speed_cells
    monkeypatch.setattr(speed_cells, "CELL_FLOOR_S", 0.3)
    monkeypatch.setattr(gsc, "plan", lambda *args: [
        ("gpu-tests", 0, lambda: time.sleep(20)), ("switches", 0, lambda: {"cells": {}}),
        ("compile-model", 90, lambda: {"cells": {}})])
    t0 = time.monotonic()
    gsc.main([str(tmp_path), str(tmp_path / "out"), "--budget", "1000", "--deadline", str(time.time() + 30)])
    assert time.monotonic() - t0 < 10
    cells = json.loads((tmp_path / "out" / "speed.json").read_text())["cells"]
    assert [c["status"] for c in cells] == ["timeout", "ok", "skipped"]
    assert cells[0]["seconds"] < 5 and cells[2]["reason"].startswith("deadline:")
