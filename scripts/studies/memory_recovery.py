#!/usr/bin/env python
"""Memory snapshots (checkpoint.memory_every) measured on network-namespace nodes (scripts/faults/twonode.py), one
rank a node, the torch engine under torchrun; the figures in docs/evidence/reliability.md "Memory snapshots: measured". Run from the
repository root:

    python -m scripts.studies.memory_recovery --nodes 2 3 --json memory_recovery.json
    python -m scripts.studies.memory_recovery --show memory_recovery.json

For each node count N:

* **recovery**: a classifier of ``--classes`` x ``--dim`` (1.2 GB with its momentum at the defaults) trained with
  a disk checkpoint and a snapshot at step 10; the last node is SIGKILLed before step 14. The N - 1 others
  restart twice from step 10: from memory (the lost node's slice from its buddy's copy), and from disk (a copy
  of the run folder, snapshots off, the page cache dropped first: the disk is read, not memory). Figures: the
  trainer's "restored in" (finding, gathering and loading the state) and the wall time from the launch to the
  first step after the resume; and the bytes on each node's snapshot root against ``estimate``'s terms.
* **overhead**: a small classifier beside a large backbone (an MLP of ``--hidden`` units), snapshots every K
  steps, K the smallest multiple of 10 whose snapshot traffic (a rank's file / K) is at most 1% of the backbone
  gradient's bytes a step; the mean step time of runs with and without snapshots, alternated.

Needs root (namespaces, drop_caches). This machine: 2 cores, a local virtual disk (2.2 GB/s cold reads, measured
with dd after drop_caches): a shared file system under many readers is slower, so the disk figures are a floor.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from hvd_partialfc.run_files import folder_bytes  # noqa: E402
from scripts.faults import twonode  # noqa: E402

RANK_FILE = "memory snapshot (one rank's file)"      # estimate's host terms
BASE = ["model.name=mlp", "train.threads=1", "data.workers=0", "train.log_every=1", "checkpoint.resume=auto",
        "train.heartbeat_timeout=5", "head.negatives_every=0", "train.engine=torch", "checkpoint.keep=2"]


def shards(folder: str, classes: int, per_class: int, dim: int, num_shards: int) -> str:
    import numpy as np
    from data_tools.build import build_shard_set
    from data_tools.importers import get_importer
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(classes), per_class)
    x = rng.normal(size=(len(y), dim)).astype(np.float32)
    npz = os.path.join(folder, "f.npz")
    np.savez(npz, features=x, labels=y)
    build_shard_set(get_importer("npz")(npz), os.path.join(folder, "shards"), num_shards)
    os.remove(npz)
    return os.path.join(folder, "shards")


def launch(nodes, which: List[int], roots: Dict[int, str], shard_dir: str, run: str, steps: int, sets: List[str],
           logs: str, fault: str = "", timeout: float = 900, env: Dict[str, str] = None) -> Dict:
    """One static torchrun job over ``which`` nodes (one rank each); exit codes, output, seconds."""
    port = 29700 + int(time.time()) % 200
    argv = ["-m", "hvd_partialfc.cli", "train", "--shards", shard_dir, "--out", run, "--steps", str(steps)]
    for s in BASE + sets:
        argv += ["--set", s]
    procs, t0 = [], time.time()
    for i, node in enumerate(which):
        e = dict(nodes.launch_env(node), PYTHONPATH=ROOT, HVD_PARTIALFC_MEMORY_DIR=roots[node], **(env or {}))
        e.pop("HVD_PARTIALFC_FAULT", None)
        if fault:
            e["HVD_PARTIALFC_FAULT"] = fault
        cmd = nodes.torchrun_argv(node, argv, nproc=1, port=port, rdzv_id=f"mem-{port}",
                                  nnodes=str(len(which)))
        cmd = _host_first(cmd, nodes, which[0], node)
        log = open(os.path.join(logs, f"{os.path.basename(run)}-{int(t0)}-node{node}.log"), "w")
        procs.append(nodes.popen(node, cmd, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=timeout) for p in procs]
    return {"codes": codes, "t0": t0, "seconds": time.time() - t0}


def _host_first(cmd: List[str], nodes, host: int, node: int) -> List[str]:
    """The rendezvous hosted by the first node of this job (``torchrun_argv`` hosts it on node 1)."""
    i = cmd.index("--rdzv-endpoint")
    cmd[i + 1] = f"{nodes.addr(host)}:{cmd[i + 1].split(':')[1]}"
    j = cmd.index("--rdzv-conf")
    cmd[j + 1] = f"is_host={int(node == host)}"
    return cmd


def first_record_after(run: str, t0: float, step: int) -> float:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if '"loss"' in line]
    return next(r["time"] for r in recs if r["step"] == step + 1 and r["time"] >= t0) - t0


def said(logs: str, text: str) -> List[str]:
    out = []
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            out += [line.strip() for line in f.read().replace("\r", "\n").splitlines() if text in line]
    return out


def recovery(n: int, a, work: str) -> Dict:
    from hvd_partialfc.tools.estimate import estimate
    folder = os.path.join(work, f"recovery-{n}")
    os.makedirs(folder)
    data = shards(folder, a.classes, 2, 32, n * 2)
    logs = os.path.join(folder, "logs")
    os.makedirs(logs)
    sets = [f"model.embedding_dim={a.dim}", "model.kwargs={hidden_dim: 64}", "data.batch_size=32",
            "checkpoint.every=10", "checkpoint.memory_every=5"]
    with twonode.Nodes(n, suffix=twonode.owner_suffix(), prefix="hpfcm") as nodes:
        roots = {node: os.path.join(a.shm, f"recovery-{n}-mem{node}") for node in nodes.node_ids}
        for r in roots.values():
            os.makedirs(r)
        run = os.path.join(folder, "run")
        # the ranks pause after step 12 while snapshot 10 lands (on 2 busy cores its thread, at nice 19, gets
        # little CPU: without the pause it had not landed 4 steps later), then the last node goes
        crash = launch(nodes, nodes.node_ids, roots, data, run, 40, sets, logs, fault=f"stall@12,kill@13:{n - 1}",
                       env={"HVD_PARTIALFC_STALL_SECONDS": "20"})
        ckpt_bytes = folder_bytes(os.path.join(run, "checkpoints", "step-00000010"))
        per_node = {node: folder_bytes(roots[node]) for node in nodes.node_ids}
        files = {}
        for node in nodes.node_ids:
            for d, _, fs in os.walk(roots[node]):
                for f in fs:
                    if f.startswith("classifier-") and "step-00000010" in d:
                        files[f] = os.path.getsize(os.path.join(d, f))
        shutil.rmtree(roots[n])                      # the lost node's memory
        os.makedirs(roots[n])
        disk_run = os.path.join(folder, "disk-run")
        shutil.copytree(run, disk_run)
        subprocess.run(["sync"])                     # the copy's writes are not the restart's to wait for
        up = nodes.node_ids[:-1]
        stop = "raise@11"           # each restart ends after its first step: the figure is taken
        mem = launch(nodes, up, roots, data, run, 40, sets, logs, fault=stop)
        t_mem = first_record_after(run, mem["t0"], 10)
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        disk = launch(nodes, up, {k: os.path.join(a.shm, "unused") for k in roots}, data, disk_run, 40,
                      sets[:-1] + ["checkpoint.memory_every=0"], logs, fault=stop)
        t_disk = first_record_after(disk_run, disk["t0"], 10)
    restored = said(logs, "restored in")
    mem_line = [x for x in restored if "memory snapshot" in x][0]
    disk_line = [x for x in restored if "memory snapshot" not in x][-1]
    rs = lambda line: float(line.rsplit("restored in ", 1)[1].split()[0])  # noqa: E731
    est = estimate(a.classes, n, a.dim, 32, backbone="mlp", in_shape=[32], backbone_kwargs={"hidden_dim": 64},
                   memory_every=5, ranks_per_node=1)
    return {"nodes": n, "classes": a.classes, "dim": a.dim, "checkpoint_bytes": ckpt_bytes,
            "crash_codes": crash["codes"], "memory_codes": mem["codes"], "disk_codes": disk["codes"],
            "restore_s_memory": rs(mem_line), "restore_s_disk": rs(disk_line),
            "first_step_s_memory": t_mem, "first_step_s_disk": t_disk,
            "snapshot_file_bytes": files, "node_root_bytes": per_node,
            "estimate_host": est.get("host_bytes", {}), "memory_line": mem_line, "disk_line": disk_line,
            "memory_said": said(logs, "memory: resuming")}


def overhead(n: int, a, work: str) -> Dict:
    from hvd_partialfc.tools.estimate import estimate
    folder = os.path.join(work, f"overhead-{n}")
    os.makedirs(folder)
    data = shards(folder, 200 * n, 40, 64, n * 2)
    logs = os.path.join(folder, "logs")
    os.makedirs(logs)
    est = estimate(200 * n, n, 256, 64, backbone="mlp", in_shape=[64], backbone_kwargs={"hidden_dim": a.hidden},
                   memory_every=1, ranks_per_node=1)
    rank_bytes, grad = est["host_bytes"][RANK_FILE], est["backbone_params"] * 4
    k = max(10, -(-int(100 * rank_bytes / grad) // 10) * 10)
    sets = ["model.embedding_dim=256", f"model.kwargs={{hidden_dim: {a.hidden}}}", "data.batch_size=64",
            "checkpoint.every=0"]
    ks = [k, 5 * k]
    times: Dict[str, List[float]] = {"off": [], **{str(x): [] for x in ks}}
    with twonode.Nodes(n, suffix=twonode.owner_suffix(), prefix="hpfco") as nodes:
        roots = {node: os.path.join(a.shm, f"overhead-{n}-mem{node}") for node in nodes.node_ids}
        for r in roots.values():
            os.makedirs(r, exist_ok=True)
        for rep in range(a.repeats):
            for kind in times:
                run = os.path.join(folder, f"run-{kind}-{rep}")
                every = 0 if kind == "off" else int(kind)
                launch(nodes, nodes.node_ids, roots, data, run, a.steps, sets + [f"checkpoint.memory_every={every}"],
                       logs)
                with open(os.path.join(run, "metrics.jsonl")) as f:
                    recs = [json.loads(line) for line in f if '"loss"' in line]
                warm = [r["step_time"] for r in recs if r["step"] > 20]
                times[kind].append(sum(warm) / len(warm))
    mean = {x: sum(v) / len(v) for x, v in times.items()}
    return {"nodes": n, "K": ks, "rank_file_bytes": rank_bytes, "backbone_grad_bytes": grad,
            "traffic_share": [rank_bytes / x / grad for x in ks], "step_s": times,
            "overhead": [mean[str(x)] / mean["off"] - 1 for x in ks]}


def table(report: Dict) -> str:
    from hvd_partialfc.sizes import human
    lines = ["| nodes | state on disk | restored from memory | from disk | ratio | first step after launch: memory | disk |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["recovery"]:
        lines.append(f"| {r['nodes']} -> {r['nodes'] - 1} | {human(r['checkpoint_bytes'])} | {r['restore_s_memory']:.2f} s | "
                     f"{r['restore_s_disk']:.2f} s | {r['restore_s_memory'] / r['restore_s_disk']:.2f} | "
                     f"{r['first_step_s_memory']:.1f} s | {r['first_step_s_disk']:.1f} s |")
    lines += ["", "| nodes | a rank's file: measured | estimate | a node's root (one snapshot + the landing one): measured "
              "| estimate (two snapshots) |", "|---|---:|---:|---:|---:|"]
    for r in report["recovery"]:
        f, e = max(r["snapshot_file_bytes"].values()), r["estimate_host"]
        lines.append(f"| {r['nodes']} | {human(f)} | {human(e.get(RANK_FILE, 0))} | "
                     f"{human(max(r['node_root_bytes'].values()))} | {human(e.get('memory snapshots per node (host RAM)', 0))} |")
    lines += ["", "| nodes | K | snapshot traffic / backbone gradient | step without | with | overhead |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in report["overhead"]:
        off = sum(r["step_s"]["off"]) / len(r["step_s"]["off"])
        for k, share, over in zip(r["K"], r["traffic_share"], r["overhead"]):
            on = sum(r["step_s"][str(k)]) / len(r["step_s"][str(k)])
            lines.append(f"| {r['nodes']} | {k} | {100 * share:.2f}% | {1000 * off:.1f} ms | {1000 * on:.1f} ms | "
                         f"{100 * over:+.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--classes", type=int, default=300_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048, help="the overhead runs' MLP width (its gradient's size)")
    ap.add_argument("--steps", type=int, default=300, help="steps of each overhead run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["recovery", "overhead"])
    twonode.study_options(ap)
    a = ap.parse_args(argv)
    done = twonode.study_preamble(a, "memory_recovery", table)
    if done is not None:
        return done
    work = a.work or tempfile.mkdtemp(prefix="hpfc-memory-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    a.shm = tempfile.mkdtemp(prefix="hpfc-memory-", dir="/dev/shm")     # the nodes' memory: a tmpfs, not the disk
    report = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "recovery": [], "overhead": []}
    try:
        for n in a.nodes:
            if a.only != "overhead":
                report["recovery"].append(recovery(n, a, work))
            if a.only != "recovery":
                report["overhead"].append(overhead(n, a, work))
    finally:
        shutil.rmtree(a.shm, ignore_errors=True)
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    twonode.study_report(a, report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
