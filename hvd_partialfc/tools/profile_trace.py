"""The step profile's arithmetic and files (tools/profile_marks.py marks the phases): the phase table, the overlap
of gradient averaging with the backward, Horovod's timeline read, the GPU's kernel trace summarised, and a
Chrome trace (``chrome://tracing`` or ui.perfetto.dev open it) of the host phases, the GPU phases and every
all-reduce. Reads files and numbers only: no engine, no torch.distributed."""
from __future__ import annotations

import json
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

Interval = Tuple[float, float]


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, merged intervals."""
    out: List[List[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> List[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def overlap(windows: Dict[int, Dict[str, float]], comm: Sequence[Interval]) -> Dict[str, Any]:
    """Gradient averaging against the backward, per step then the medians (seconds): ``busy`` (the union of
    the all-reduces within the step), ``overlapped`` (busy during the last backward pass, from the head's
    backward to ``synchronize``), ``in_wait`` (busy during ``synchronize``'s wait), ``wait`` (that wait),
    ``share`` = overlapped / busy (per step, and its median). A check that needs no common clock: busy - wait is about ``overlapped``
    when the all-reduces end inside the wait."""
    rows = []
    for step, w in sorted(windows.items()):
        mine = union(clip(comm, w["start"], w["end"]))
        busy = length(mine)
        rows.append({"step": step, "busy": busy, "all_reduces": len(clip(comm, w["start"], w["end"])),
                     "overlapped": length(clip(mine, w["backward"], w["wait_start"])),
                     "in_wait": length(clip(mine, w["wait_start"], w["wait_end"])),
                     "wait": w["wait_end"] - w["wait_start"]})
    if not rows:
        return {}
    for r in rows:
        r["share"] = r["overlapped"] / r["busy"] if r["busy"] > 0 else None
    med = {k: statistics.median(r[k] for r in rows) for k in ("busy", "overlapped", "in_wait", "wait", "all_reduces")}
    shares = [r["share"] for r in rows if r["share"] is not None]
    med["share"] = statistics.median(shares) if shares else None
    return {"median_s": med, "steps": rows}


def horovod_allreduces(path: str, epoch_minus_perf: float) -> List[Interval]:
    """The ``ALLREDUCE`` activities of a Horovod timeline file (one process row per tensor, ``B``/``E``
    events, ``ts`` in micro-seconds from ``start_time_since_epoch_in_micros``), as host-clock intervals:
    ``perf_counter = epoch - epoch_minus_perf``. Negotiation (waiting for every rank to have the tensor) is
    left out: it is not traffic. The file ends with ``]`` only after Horovod's shutdown; read either way."""
    with open(path) as f:
        text = f.read().strip()
    text = text[:-1].rstrip() if text.endswith("]") else text      # the events, without the list's end
    events = json.loads(text.rstrip(",") + "]")
    start_us = next((e["args"]["start_time_since_epoch_in_micros"] for e in events
                     if e.get("ph") == "M" and "start_time_since_epoch_in_micros" in e.get("args", {})), None)
    if start_us is None:
        return []
    stacks: Dict[Any, List[Tuple[str, float]]] = {}
    out: List[Interval] = []
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "B":
            stacks.setdefault(pid, []).append((e.get("name", ""), e["ts"]))
        elif ph == "E" and stacks.get(pid):
            name, ts = stacks[pid].pop()
            if not stacks[pid] and name == "ALLREDUCE":
                out.append(((start_us + ts) / 1e6 - epoch_minus_perf, (start_us + e["ts"]) / 1e6 - epoch_minus_perf))
    return out


def gpu_summary(trace_path: str, top: int = 12) -> Dict[str, Any]:
    """From torch.profiler's exported trace: the GPU's busy share over the profiled span (the union of its
    kernels, copies and sets), its idle milli-seconds a step, the kernels taking the most time, and how much
    of the NCCL kernels' time other kernels ran beside (their overlap on the GPU). {} without GPU events."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not dev:
        return {}
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev]
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation"]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    busy = length(spans)
    by_name: Dict[str, float] = {}
    for e in dev:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e.get("dur", 0)
    nccl = [s for s, e in zip(spans, dev) if "nccl" in e["name"].lower()]
    other = union(s for s, e in zip(spans, dev) if "nccl" not in e["name"].lower())
    nccl_busy = length(nccl)
    beside = sum(length(clip(other, a, b)) for a, b in union(nccl))
    n = max(1, len(steps))
    return {"span_ms": (hi - lo) / 1e3, "busy_share": busy / (hi - lo) if hi > lo else None,
            "idle_ms_per_step": (hi - lo - busy) / 1e3 / n, "steps": len(steps),
            "top_kernels_ms_per_step": [(k, v / 1e3 / n) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
            "nccl_ms_per_step": nccl_busy / 1e3 / n,
            "nccl_beside_compute_share": beside / nccl_busy if nccl_busy else None}


def phase_table(phases: Dict[int, List[Tuple[str, float, float, Optional[float]]]]) -> List[Dict[str, Any]]:
    """Per phase, in the step's order: the mean over steps of its summed host seconds (and GPU seconds) and
    its share of the mean step (means add up, so the shares sum to 1), and the median, which a busy
    machine's outliers move less."""
    order: List[str] = []
    per: Dict[str, List[Tuple[float, Optional[float]]]] = {}
    for rows in phases.values():
        sums: Dict[str, List[Any]] = {}
        for name, _, host, gpu in rows:
            if name not in order:
                order.append(name)
            s = sums.setdefault(name, [0.0, None])
            s[0] += host
            if gpu is not None:
                s[1] = (s[1] or 0.0) + gpu
        for name in order:
            per.setdefault(name, []).append(tuple(sums.get(name, [0.0, None])))
    n = len(phases)
    total_host = sum(h for rows in per.values() for h, _ in rows) / n
    total_gpu = sum(g or 0.0 for rows in per.values() for _, g in rows) / n
    table = []
    for name in order:
        hosts = [h for h, _ in per[name]] + [0.0] * (n - len(per[name]))
        gpus = [g for _, g in per[name] if g is not None]
        gpu = sum(gpus) / n if gpus else None
        table.append({"phase": name, "host_ms": 1e3 * sum(hosts) / n, "host_median_ms": 1e3 * statistics.median(hosts),
                      "host_share": sum(hosts) / n / total_host if total_host else None,
                      "gpu_ms": None if gpu is None else 1e3 * gpu,
                      "gpu_share": gpu / total_gpu if gpu is not None and total_gpu else None})
    return table


def format_table(result: Dict[str, Any]) -> str:
    """The printed table: phases, then the step, the averaging's overlap and the GPU's summary."""
    lines = [f"{'phase (ms a step)':22} {'host':>9} {'share':>6} {'median':>9} {'GPU':>9} {'share':>6}"]
    for r in result["phases"]:
        g = "" if r["gpu_ms"] is None else f"{r['gpu_ms']:9.2f} {r['gpu_share'] or 0:6.1%}"
        lines.append(f"{r['phase']:22} {r['host_ms']:9.2f} {r['host_share'] or 0:6.1%} {r['host_median_ms']:9.2f} {g}")
    lines.append(f"step: {result['step_ms']['median']:.2f} ms median over {result['steps']} steps "
                 f"({result['samples_per_s']:,.0f} samples/s on this rank); first step {result['first_step_ms']:.0f} ms")
    a = result.get("averaging") or {}
    if a.get("median_s"):
        m = a["median_s"]
        share = "n/a" if m["share"] is None else f"{m['share']:.0%}"
        lines.append(f"gradient averaging ({a['source']}): busy {1e3 * m['busy']:.2f} ms a step in "
                     f"{m['all_reduces']:.0f} all-reduces, {1e3 * m['overlapped']:.2f} ms beside the backward "
                     f"({share}), {1e3 * m['in_wait']:.2f} ms in the wait of {1e3 * m['wait']:.2f} ms")
    elif a.get("note"):
        lines.append(f"gradient averaging: {a['note']}")
    g = result.get("gpu") or {}
    if g:
        lines.append(f"GPU: busy {g['busy_share']:.1%} of the profiled span, idle {g['idle_ms_per_step']:.2f} ms a step"
                     + (f"; NCCL {g['nccl_ms_per_step']:.2f} ms a step" if g["nccl_ms_per_step"] else ""))
    if result.get("host_syncs_per_step") is not None:
        lines.append(f"host synchronisations CUDA saw: {result['host_syncs_per_step']:.1f} a step")
    return "\n".join(lines)


def chrome_trace(phases, comm: Sequence[Interval], rank: int, origin: float) -> Dict[str, Any]:
    """Trace events: the host phases (thread 0), the GPU phases placed from the step's first host mark by
    the events' own spans (thread 1), every all-reduce (thread 2). Micro-seconds from ``origin``."""
    us = lambda t: round((t - origin) * 1e6, 3)   # noqa: E731
    ev: List[Dict[str, Any]] = [{"ph": "M", "name": "thread_name", "pid": rank, "tid": t, "args": {"name": n}}
                                for t, n in ((0, "host"), (1, "GPU (CUDA events)"), (2, "gradient all-reduces"))]
    for step, rows in sorted(phases.items()):
        gpu_t = rows[0][1]
        for name, t, host, gpu in rows:
            ev.append({"ph": "X", "name": name, "pid": rank, "tid": 0, "ts": us(t), "dur": round(host * 1e6, 3),
                       "args": {"step": step}})
            if gpu is not None:
                ev.append({"ph": "X", "name": name, "pid": rank, "tid": 1, "ts": us(gpu_t), "dur": round(gpu * 1e6, 3),
                           "args": {"step": step}})
                gpu_t += gpu
    for i, (a, b) in enumerate(comm):
        ev.append({"ph": "X", "name": "all-reduce", "pid": rank, "tid": 2, "ts": us(a), "dur": round((b - a) * 1e6, 3),
                   "args": {"index": i}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}
