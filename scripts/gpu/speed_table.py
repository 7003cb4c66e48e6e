"""The GPU speed table (docs/gpu.md, "The one call") from the speed stage's results
(scripts/gpu/gpu_speed_check.py writes speed.json; the prepare stage writes gpu_decode.json beside it).
``table(result, out)`` returns the markdown; a figure whose cell did not run says so, with the cell's reason."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

GOALS = [("iresnet50, 125k-class local head: samples/s", "2,027–2,150", "≥ 4,000"),
         ("iresnet100, same: samples/s", "not measured", "≥ 2,200"),
         ("ours / arcface_torch's own step, same GPU, same backbone and batch, 125k classes", "not measured", "≥ 1.3×"),
         ("the same at 1.25M classes", "not measured", "≥ 1.5×"),
         ("head + both optimizers, share of the step at 125k classes", "not measured", "≤ 5%"),
         ("loader (nvJPEG path), at most 8 workers", "4,352/s (PIL, 12 workers)", "≥ 1.2× the step's rate")]
HEAD_PHASES = ("head forward", "head backward", "backbone optimizer", "books", "head optimizer")


def _cell(result: Dict[str, Any], name: str):
    return next((c for c in result["cells"] if c["name"] == name), None)


def _why(result, name) -> str:
    c = _cell(result, name)
    if c is None:
        return f"{name}: not run"
    if c["status"] == "ok":
        return ""
    return f"{name} {c['status']}: {c.get('reason') or c.get('error', '')[:160]}"


def _ok(result, name) -> Optional[Dict[str, Any]]:
    c = _cell(result, name)
    return c["result"] if c and c["status"] == "ok" else None


def _sps(cmp, who) -> str:
    r = (cmp or {}).get("contenders", {}).get(who, {})
    return f"{r['samples_per_s']:,.0f}" if "samples_per_s" in r else r.get("error", "—")


def _ratio(cmp) -> str:
    c = (cmp or {}).get("contenders", {})
    got = [f"{who} {c[who]['speed_vs_arcface']:.2f}×" for who in ("local", "global") if "speed_vs_arcface" in c.get(who, {})]
    return ", ".join(got) or (cmp or {}).get("note", "arcface not measured")


def figures(result: Dict[str, Any], out: str) -> Dict[int, str]:
    f: Dict[int, str] = {}
    c125, c100, c1250 = (_ok(result, n) for n in ("compare-r50-125k", "compare-r100-125k", "compare-r50-1250k"))
    sw = _ok(result, "switches")
    parts = []
    if c125:
        parts.append(f"local {_sps(c125, 'local')} with the defaults (arcface_torch {_sps(c125, 'arcface')})")
    if sw:
        cells = {k: v for k, v in sw["cells"].items() if "samples_per_s" in v}
        if "defaults" in cells and not c125:
            parts.append(f"local {cells['defaults']['samples_per_s']:,.0f} with the defaults (switches)")
        top = max(cells, key=lambda k: cells[k]["samples_per_s"]) if cells else None
        if top:
            parts.append(f"best keys: {top}, {cells[top]['samples_per_s']:,.0f}")
    if parts:
        f[0] = "; ".join(parts)
    if c100:
        f[1] = f"local {_sps(c100, 'local')} (arcface_torch {_sps(c100, 'arcface')})"
    if c125:
        f[2] = _ratio(c125)
    if c1250:
        f[3] = _ratio(c1250)
    prof = _ok(result, "profile-r50")
    if prof:
        rows = {r["phase"]: r for r in prof["phases"]}
        key = "gpu_share" if any(r.get("gpu_share") for r in rows.values()) else "host_share"
        share = sum(rows[p][key] or 0 for p in HEAD_PHASES if p in rows)
        f[4] = f"{share:.1%} ({'GPU' if key == 'gpu_share' else 'host'} time: {', '.join(HEAD_PHASES)})"
    decode = os.path.join(out, "gpu_decode.json")
    if os.path.exists(decode) and prof:
        with open(decode) as fh:
            rates = [r for r in json.load(fh).get("rates", []) if r["decode"] == "gpu" and r["workers"] <= 8]
        if rates:
            best = max(r["samples_per_s"] for r in rates)
            f[5] = f"{best:,.0f}/s with nvJPEG (bench_loader) = {best / prof['samples_per_s']:.2f}× the profiled step"
    nv = _ok(result, "profile-r50-nvjpeg")
    if nv:
        wait = next((r["host_share"] for r in nv["phases"] if r["phase"] == "loader"), None)
        f[5] = f.get(5, "") + (f"; the trainer with data.decode=gpu: {nv['samples_per_s']:,.0f} samples/s, loader wait "
                               f"{wait:.1%} of the step" if wait is not None else "")
    return f


REASONS = {0: ("compare-r50-125k", "switches"), 1: ("compare-r100-125k",), 2: ("compare-r50-125k",),
           3: ("compare-r50-1250k",), 4: ("profile-r50",), 5: ("profile-r50", "profile-r50-nvjpeg")}


def table(result: Dict[str, Any], out: str) -> str:
    f = figures(result, out)
    lines = [f"Measured {result['date']} on {result['device']} (torch {result['torch']}); "
             "scripts/gpu/gpu_speed_check.py",
             "", "| figure | before | goal | measured |", "|---|---|---|---|"]
    for i, (name, before, goal) in enumerate(GOALS):
        why = "; ".join(w for w in (_why(result, n) for n in REASONS[i]) if w)
        lines.append(f"| {name} | {before} | {goal} | {f.get(i) or 'not measured: ' + (why or 'no result')} |")
    said = notes(result)
    return "\n".join(lines + ([""] + [f"- {n}" for n in said] if said else [])) + "\n"


def notes(result: Dict[str, Any]) -> List[str]:
    """What a reader of the figures must know: how arcface_torch's step was run (DDP or not, the scheduler
    arguments this torch dropped), fp16 steps skipped in the timed rounds, the cells that ended without a
    result (out of memory, cut at their limit, failed)."""
    out = []
    for c in result["cells"]:
        if c["status"] not in ("ok", "skipped"):
            out.append(f"{c['name']}: {c['status']} ({(c.get('error') or '')[:160]})")
        if c["status"] != "ok" or not c["name"].startswith("compare-"):
            continue
        who = c["result"].get("contenders", {})
        arc = who.get("arcface", {})
        said = []
        if "ddp" in arc:
            said.append("arcface_torch " + ("in DDP as train_v2 wraps it (at one rank: an all-reduce ours does not "
                                            "pay)" if arc["ddp"] else "without DDP (one rank: no all-reduce, as ours)"))
        if arc.get("scheduler_dropped"):
            said.append(f"its scheduler built without {', '.join(arc['scheduler_dropped'])} (this torch takes none)")
        skips = [f"{n} {r['skipped_steps']}/{r['timed_steps']}" for n, r in who.items() if "skipped_steps" in r]
        if skips:
            said.append(f"fp16 steps skipped in the timed rounds: {', '.join(skips)}")
        errors = [f"{n}: {r['error']}" for n, r in who.items() if "error" in r]
        if errors:
            said.append("; ".join(errors))
        if said:
            out.append(f"{c['name']}: " + "; ".join(said))
    return out
