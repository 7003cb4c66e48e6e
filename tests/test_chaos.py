"""The chaos run's short version (scripts/faults/chaos.py --short): elastic torchrun over three network-namespace nodes,
three faults at seeded random steps: a node lost, the node joining back, a sample made undecodable (the rest
of the kinds and the Horovod wrapper are the long runs'; the preemption and the full disk also have tests of
their own in test_elastic.py, test_checkpoints.py and test_full_disk.py), recovered by torchrun's restarts;
the run ends with its budget of samples consumed to within one global batch, ``latest`` valid after every
fault, every checkpoint loadable, the damaged sample named. It is also the three-node test of a lost node:
the other two go on (a checkpoint of 2 ranks is written, re-sharded) and take the node back. Memory snapshots
are on (every 5 steps): the lost node's slice comes back from its buddy's copy, not from the disk checkpoint
(every 20 steps). About 50 s.
The long runs (12 faults under torchrun, 6 under the Horovod wrapper, compared bitwise with a fault-free
run) and their tables: docs/evidence/reliability.md."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, launch_env
from scripts.faults import twonode

pytestmark = [pytest.mark.multirank, pytest.mark.serial]     # a time bound: run alone (setup.cfg)


def test_short_chaos_run(tmp_path):
    reason = twonode.tried_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "chaos.json"
    p = subprocess.run([sys.executable, "-m", "scripts.faults.chaos", "--short", "--seed", "3",
                        "--memory-every", "5", "--json", str(out), "--work", str(tmp_path / "work")],
                       env=launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    if p.returncode == 2:
        pytest.skip(p.stderr.strip())
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    (report,) = json.loads(out.read_text())
    assert sorted(r["kind"] for r in report["rows"]) == ["bad-sample", "node-joins", "node-lost"]
    checks = report["checks"]
    assert checks["ok_budget_consumed"] and abs(checks["samples"] - checks["budget"]) <= checks["last_global_batch"]
    assert checks["worlds"][0] == 3 and 2 in checks["worlds"] and all(r["latest_ok"] for r in report["rows"])
    assert checks["ok_damaged_sample_named"] and len(checks["damaged"]) == 1 and checks["named"]
    lost = {r["kind"]: r["lost"] for r in report["rows"]}
    assert lost["node-joins"] == 0                                       # the group stops with a checkpoint first
    source = {r["kind"]: r.get("source") for r in report["rows"]}
    # at most 2 K: the steps since the snapshot, and up to K more while it lands (docs/evidence/reliability.md, the bound)
    assert source["node-lost"] == "memory" and lost["node-lost"] <= 2 * 5
    assert checks["ok_steps_lost_at_most_2K"] and checks["ok_no_false_stragglers"]
