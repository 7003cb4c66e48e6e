"""The chaos run's report (scripts/faults/chaos.py): a fault's row, a run's table, the logs' last lines."""
from __future__ import annotations

import os
from typing import Dict, List


def tails(log_dir: str, n: int = 15) -> Dict[str, List[str]]:
    out = {}
    for name in sorted(os.listdir(log_dir))[-6:]:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            out[name] = [x for x in f.read().replace("\r", "\n").splitlines() if x.strip() and "it/s]" not in x][-n:]
    return out


def row_line(r: Dict) -> str:
    return (f"{r['kind']:<16} {r['step']:>6} {r.get('seconds', ''):>8} {r.get('lost', ''):>6} {r.get('source', ''):>6} "
            f"{str(r.get('world_before', '')):>6} -> {str(r.get('world_after', '')):<8} "
            f"{'ok' if r.get('latest_ok') else 'BAD'} {r.get('latest', '')}  {r.get('detail', '')}")


def table(report: Dict) -> str:
    memory = f", memory snapshots every {report['memory_every']} steps" if report.get("memory_every") else ""
    head = (f"{report['run']}, seed {report['seed']}, {report['steps']} steps at the first world size, "
            f"{len(report['rows'])} faults, {report.get('seconds', 0):.0f} s{memory}\n"
            f"{'fault':<16} {'step':>6} {'went on':>8} {'lost':>6} {'from':>6} {'world':>6}    {'':<8} latest\n")
    lines = [row_line(r) for r in report["rows"]]
    checks = [f"  {k[3:]}: {'yes' if v else 'NO'}" for k, v in report["checks"].items() if k.startswith("ok_")]
    extra = report["checks"]
    info = []
    if "samples" in extra:
        info.append(f"  samples consumed {extra['samples']:,} of a budget of {extra['budget']:,} (one global batch "
                    f"now: {extra['last_global_batch']}); world sizes {extra['worlds']}")
    if "stragglers_named" in extra:
        info.append(f"  stragglers named {extra['stragglers_named']}, by no slow fault {len(extra['false_stragglers'])}"
                    + "".join(f"; {x}" for x in extra["false_stragglers"]))
    if extra.get("error"):
        info.append(f"  error: {extra['error']}")
    return head + "\n".join(lines) + "\n" + "\n".join(info + checks) + \
        f"\n{'PASSED' if report['passed'] else 'FAILED'}\n"


def unexplained_stragglers(named: List[Dict], rows: List[Dict]) -> List[str]:
    """The stragglers named (RUN/stragglers.jsonl's "named" events) that no ``slow`` fault explains: one names
    that fault's node between the fault and its eviction."""
    slow = [(r["slow_host"], r["slow_from"], r.get("slow_until", float("inf"))) for r in rows if r.get("slow_host")]
    return [f"step {e['step']}: rank {e['rank']} on {e['node']}" for e in named
            if not any(host == e["node"] and start <= e["time"] <= end for host, start, end in slow)]


def found_damaged(run) -> List[str]:
    """Which damaged samples the ranks named (``data.on_bad_sample: skip``)."""
    run.watch.poll()
    return [d for d in run.damaged if run.watch.said(d)]
