"""The estimator's arithmetic, and a tiny benchmark run under real horovodrun and torchrun (its figures, not
its speed)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, horovodrun_env
from hvd_partialfc.tools import bench_engines
from hvd_partialfc.tools.bench_engines import HOROVODRUN_ENV
from hvd_partialfc.tools.estimate import estimate

BB = {"params": 1000, "activation_bytes": 0}


def test_local_traffic_is_the_backbone_gradient_whatever_the_classes():
    a = estimate(10_000, 8, 128, 64, mode="local", bb=BB)
    b = estimate(10_000_000, 8, 128, 64, mode="local", bb=BB)
    assert a["traffic_total"] == b["traffic_total"] == 4000
    assert b["memory_bytes"]["classifier weights"] == 1_250_000 * 128 * 4


def test_global_and_replicated_pay_in_classes_and_batch():
    g = estimate(1_000_000, 8, 128, 64, mode="global", bb=BB)
    r = estimate(1_000_000, 8, 128, 64, mode="replicated", bb=BB)
    loc = estimate(1_000_000, 8, 128, 64, mode="local", bb=BB)
    assert g["memory_bytes"]["logits"] == 8 * loc["memory_bytes"]["logits"]     # B x N gathered rows
    assert g["traffic_total"] > loc["traffic_total"] and g["memory_bytes"]["gathered features"] > 0
    assert r["memory_bytes"]["classifier weights"] == 1_000_000 * 128 * 4       # the full matrix
    assert r["traffic_bytes"]["classifier gradient"] == 1_000_000 * 128 * 4
    half = estimate(1_000_000, 8, 128, 64, mode="local", dtype="bf16", bb=BB)
    assert half["memory_bytes"]["classifier weights"] * 2 == loc["memory_bytes"]["classifier weights"]
    with pytest.raises(ValueError, match="unknown classifier mode"):
        estimate(10, 2, 8, 4, mode="ring", bb=BB)


def test_backbone_figures_for_features_grey_and_colour_images():
    from hvd_partialfc.tools.estimate import backbone_figures
    grey = backbone_figures("resnet", 32, 4, [32, 32], {"width": 8})       # (H, W): one channel
    rgb = backbone_figures("resnet", 32, 4, [32, 32, 3], {"width": 8})
    assert 0 < grey["params"] < rgb["params"] and grey["activation_bytes"] > 0
    assert backbone_figures("mlp", 32, 4, [64])["params"] > 0


def test_negatives_cost_their_buffer_columns_and_amortised_gather():
    loc = estimate(1_000_000, 8, 128, 64, mode="local", bb=BB)
    full = estimate(1_000_000, 8, 128, 64, mode="local", bb=BB, negatives_every=50)
    some = estimate(1_000_000, 8, 128, 64, mode="local", bb=BB, negatives_every=10, negatives_share=1000)
    assert full["memory_bytes"]["remote centres (negatives)"] == 7 * 125_000 * 128 * 4   # the other 7 slices
    assert full["memory_bytes"]["logits"] == 64 * 1_000_000 * 4                         # W + remote columns
    assert full["traffic_bytes"]["centres (allgather, amortised)"] == 125_000 * 128 * 4 / 50
    assert some["memory_bytes"]["remote centres (negatives)"] == 7 * 1000 * 128 * 4
    assert some["traffic_total"] - loc["traffic_total"] == 1000 * 128 * 4 / 10
    # the fused head scores the remote rows in the same buffer: no (W + R, D) copy, no gradient for them
    assert full["memory_bytes"]["classifier temporaries"] == some["memory_bytes"]["classifier temporaries"] == 0
    assert full["memory_total"] - loc["memory_total"] == (
        full["memory_bytes"]["remote centres (negatives)"] + 64 * 875_000 * 4
        + full["memory_bytes"]["negatives exchange (beyond the step)"])


def test_negatives_exchange_counts_what_the_step_does_not_already_hold():
    # np=4, whole slices: W = 100,000, R = 300,000. The exchange (old buffer freed) holds the gathered
    # R + W rows and the new R-row buffer: R + W rows beyond the buffer; the step's transients are the
    # classifier gradient (W rows), the logits (64 x (W + R)) and the backbone's gradient
    neg = estimate(400_000, 4, 128, 64, mode="local", bb=BB, negatives_every=2)
    step = 100_000 * 128 * 4 + 64 * 400_000 * 4 + 1000 * 4
    assert neg["memory_bytes"]["negatives exchange (beyond the step)"] == 400_000 * 128 * 4 - step
    # a subset: the published rows are copied out of the weight too (R + 2 x share rows)
    some = estimate(400_000, 4, 128, 8, mode="local", bb=BB, negatives_every=2, negatives_share=90_000)
    step = 100_000 * 128 * 4 + 8 * 370_000 * 4 + 1000 * 4
    assert some["memory_bytes"]["negatives exchange (beyond the step)"] == (270_000 + 2 * 90_000) * 128 * 4 - step
    # at np=2 the step's gradient and logits outweigh it
    assert estimate(1_000_000, 2, 128, 64, mode="local", bb=BB, negatives_every=2)["memory_bytes"][
        "negatives exchange (beyond the step)"] == 0
    with pytest.raises(ValueError, match="belong to mode local"):
        estimate(10, 2, 8, 4, mode="global", bb=BB, negatives_every=5)


def test_estimate_cli_prints_a_table():
    out = subprocess.run([os.path.join(BIN, "hvd-partialfc"), "estimate", "--classes", "1e6", "--world-size", "8",
                          "--dim", "128", "--batch", "32", "--backbone", "mlp", "--in-shape", "64"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "| classifier weights |" in out and "local C=1,000,000 N=8" in out and "replicated" in out


def test_estimate_cli_negatives_default_to_trainings_share_and_pool(capsys):
    """`--negatives-every K` alone estimates what a run with the default head does: share and pool are
    training's (1,024 a rank, capped at ceil(8,192 / N)), not the whole slice. The CLI's own parser and
    printing, in this process (the console script itself: the test above)."""
    from hvd_partialfc.cli import main
    from hvd_partialfc.config import HeadConfig

    def cli(*extra):
        capsys.readouterr()
        assert main(["estimate", "--classes", "1e6", "--world-size", "64", "--dim", "128", "--batch", "32",
                     "--backbone", "mlp", "--in-shape", "64", "--mode", "local", "--negatives-every", "50",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)[1]
    h = HeadConfig()
    want = estimate(1_000_000, 64, 128, 32, "mlp", "local", in_shape=[64], negatives_every=50,
                    negatives_share=h.negatives_share, negatives_pool=h.negatives_pool)
    got = cli()
    assert got["traffic_bytes"] == want["traffic_bytes"] and got["memory_bytes"] == want["memory_bytes"]
    assert got["traffic_bytes"]["centres (allgather, amortised)"] == 128 * 128 * 4 / 50      # ceil(8192 / 64)
    whole = cli("--negatives-share", "0", "--negatives-pool", "0")          # whole slices, no cap
    assert whole["traffic_bytes"]["centres (allgather, amortised)"] == 15_625 * 128 * 4 / 50



def test_memory_snapshots_are_host_rows_by_their_own_arithmetic():
    """``memory_every`` > 0: a rank's file (its ceil(1,000 / 16) = 63 rows and their momentum, fp32, plus its
    BatchNorm buffers), the node's backbone file, 2 x (the node's 8 files + the 8 buddies' copies + the
    backbone) on a node, and the buddy copy / K in the traffic; none of it in the GPU's memory. One node: its
    own files only, no traffic; 12 ranks on nodes of 8 and 4: a node hosts 12 files. K = 0: nothing of it."""
    bb = dict(BB, buffer_bytes=100)
    off = estimate(1000, 16, 512, 64, mode="local", bb=bb)
    on = estimate(1000, 16, 512, 64, mode="local", bb=bb, memory_every=100, ranks_per_node=8)
    rank, backbone = 63 * 512 * 4 * 2 + 100, 1000 * 4 * 2 + 100
    assert on["host_bytes"] == {"memory snapshot (one rank's file)": rank, "backbone file": backbone,
                                "memory snapshots per node (host RAM)": 2 * (16 * rank + backbone)}
    assert on["host_total"] == 2 * (16 * rank + backbone)
    assert on["traffic_bytes"]["memory snapshot to buddy (amortised)"] == rank / 100
    assert on["traffic_total"] == off["traffic_total"] + rank / 100
    assert on["memory_bytes"] == off["memory_bytes"] and on["memory_total"] == off["memory_total"]
    assert not {"host_bytes", "host_total", "memory_every"} & set(off)
    assert "memory snapshot to buddy (amortised)" not in off["traffic_bytes"]
    assert off == estimate(1000, 16, 512, 64, mode="local", bb=bb, memory_every=0, ranks_per_node=4)
    one = estimate(1000, 8, 512, 64, mode="local", bb=bb, memory_every=100)              # one node
    rank8 = 125 * 512 * 4 * 2 + 100
    assert one["host_bytes"]["memory snapshots per node (host RAM)"] == 2 * (8 * rank8 + backbone)
    assert one["traffic_bytes"]["memory snapshot to buddy (amortised)"] == 0
    uneven = estimate(1000, 12, 512, 64, mode="local", bb=bb, optimizer="adamw", memory_every=10)
    rank12, backbone3 = 84 * 512 * 4 * 3 + 100, 1000 * 4 * 3 + 100                    # AdamW: two moments
    assert uneven["host_bytes"]["memory snapshots per node (host RAM)"] == 2 * (12 * rank12 + backbone3)
    fp16 = estimate(1000, 16, 512, 64, mode="local", dtype="fp16", bb=bb, memory_every=100)
    assert fp16["host_bytes"] == on["host_bytes"]          # the head's weight is an fp32 master under autocast


def test_snapshot_estimate_matches_what_training_counts():
    """The estimator's file sizes are ``run/snapshots/memory_plan.py``'s ``snapshot_bytes`` of the same tensors (a resnet's
    BatchNorm buffers included), so the estimate and the run's start-up room check cannot drift apart."""
    from types import SimpleNamespace
    import torch
    from hvd_partialfc.config import OptimConfig
    from hvd_partialfc.models import create_model
    from hvd_partialfc.run.snapshots.memory_plan import snapshot_bytes
    from hvd_partialfc.tools.estimate import backbone_figures
    figures = backbone_figures("resnet", 32, 4, [32, 32, 3], {"width": 8})
    assert figures["buffer_bytes"] > 0
    parts = SimpleNamespace(head=SimpleNamespace(weight=torch.zeros(63, 32)),
                            backbone=create_model("resnet", in_shape=[32, 32, 3], embedding_dim=32, width=8))
    for name, optimizer in (("sgd", "sgd"), ("adamw", "adamw")):
        want = snapshot_bytes(parts, OptimConfig(name=name))
        got = estimate(1000, 16, 32, 4, "resnet", "local", optimizer=optimizer, bb=figures, memory_every=5)
        assert got["host_bytes"]["memory snapshot (one rank's file)"] == want["rank"]
        assert got["host_bytes"]["backbone file"] == want["backbone"]


def test_estimate_cli_memory_every_prints_host_rows(capsys):
    """``--memory-every K``: the host rows after the GPU's totals; without it, none."""
    from hvd_partialfc.cli import main

    def cli(*extra):
        capsys.readouterr()
        assert main(["estimate", "--classes", "1000", "--world-size", "16", "--dim", "512", "--batch", "8",
                     "--backbone", "mlp", "--in-shape", "64", "--mode", "local", *extra]) == 0
        return capsys.readouterr().out.splitlines()
    lines = cli("--memory-every", "100", "--ranks-per-node", "4")
    host = [i for i, line in enumerate(lines) if line.startswith("| host: ")]
    assert [lines[i].split(" | ")[0] for i in host] == [
        "| host: memory snapshot (one rank's file)", "| host: backbone file",
        "| host: memory snapshots per node (host RAM)"]
    assert host[0] > next(i for i, line in enumerate(lines) if line.startswith("| **traffic / step**"))
    assert not any("host" in line for line in cli())

def _tiny_bench(out, *args):
    """``hvd-partialfc bench`` at a tiny point (D=16, batch 8, one step) into ``out``; its bench.json. The driver
    runs in this process (``bench.main``, as the console script calls it: no interpreter start for it); each job
    is its own launch as always (horovodrun, torchrun, the limit's processes)."""
    from hvd_partialfc.tools import bench
    argv = ["--dims", "16", "--batch", "8", "--steps", "1", "--warmup", "1", "--limit-procs", "1", "--in-dim", "32",
            "--out", str(out), "--config", os.path.join(ROOT, "configs", "bench.yaml"), *args]
    with pytest.MonkeyPatch.context() as m:
        m.setenv(HOROVODRUN_ENV, horovodrun_env()[HOROVODRUN_ENV])
        m.setattr(sys, "argv", ["hvd-partialfc", "bench", *argv])      # what bench.json records as its command
        m.chdir(ROOT)
        assert bench.main(argv) == 0
    return json.load(open(os.path.join(out, "bench.json")))


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """One tiny bench for both tests below (9 jobs, 7 of them under horovodrun -np 2): C = 4,000 (a slice
    W = 2,000 a rank), cross-shard negatives every step with whole slices, at sample rates 0.1 and 1. Points
    by (mode, rate); and the output folder."""
    out = tmp_path_factory.mktemp("bench")
    res = _tiny_bench(out, "--classes", "4000", "--negatives-every", "1", "--sample-rates", "0.1,1")
    assert {p["classes"] for p in res["points"]} == {4000}
    return {(p["mode"], p["sample_rate"]): p for p in res["points"]}, out


@pytest.mark.multirank
def test_tiny_bench_counts_bytes_and_writes_table(tiny_bench):
    """Bytes per step as each mode sends them (rate 1): local exactly the backbone gradient (so whatever the
    class count), negatives that plus the whole slice's centres, replicated that plus the whole C x D
    classifier gradient, global more than local, the limit nothing; memory within 10 % of the estimate."""
    by, out = tiny_bench
    assert set(m for m, _ in by) == {"limit", "local", "negatives", "global", "replicated"}
    loc = by["local", 1.0]
    # negatives (K=1, share 0): local's bytes plus the whole slice's centres, every step
    assert by["negatives", 1.0]["bytes_per_step"] - loc["bytes_per_step"] == 2000 * 16 * 4
    # local: exactly the backbone gradient in fp32 (no term in the class count or the slice)
    assert loc["bytes_per_step"] == loc["grad_bytes"] == loc["backbone_params"] * 4
    assert by["global", 1.0]["bytes_per_step"] > loc["bytes_per_step"]
    # replicated: the backbone gradient and the whole classifier's (all C = 4,000 rows, not the slice's)
    assert by["replicated", 1.0]["bytes_per_step"] - loc["bytes_per_step"] == 4000 * 16 * 4
    assert by["limit", 1.0]["bytes_per_step"] == 0 and loc["vs_limit"] > 0
    ran = [p for p in by.values() if "skipped" not in p]
    # the estimate within 10 % of the peak RSS, both ways (measured: -2.5 % ... +1.6 % over the 9 jobs, the
    # runtime's ~238 MB most of it; |err| < 1 let through an estimate of a hundredth of the RSS, -99 %)
    assert len(ran) == 9 and all(p["peak_rss"] > 0 and -0.10 < p["estimate_err"] < 0.10 for p in ran), \
        [(p["mode"], p["sample_rate"], p["estimate_err"]) for p in ran]
    assert "| 16 | 4,000 | replicated |" in open(out / "bench.md").read()


@pytest.mark.multirank
def test_bench_sample_rates_reach_every_job_and_count_logits(tiny_bench):
    """One set of jobs per rate, the limit included; the rate each worker ran with is its own config's;
    logits per rank and step: rows (B; B x N gathered for global) x columns (rate x W of W = 2,000, plus the
    remote centres for negatives)."""
    by, out = tiny_bench
    assert by["replicated", 0.1]["skipped"] == "replicated does not sample" and "skipped" not in by["replicated", 1.0]
    for mode in ("limit", "local", "negatives", "global"):
        assert by[mode, 0.1]["sample_rate"] == 0.1 and by[mode, 1.0]["sample_rate"] == 1.0
    assert by["local", 0.1]["logits_per_step"] == by["limit", 0.1]["logits_per_step"] == 8 * 200
    assert by["global", 0.1]["logits_per_step"] == 16 * 200 and by["local", 1.0]["logits_per_step"] == 8 * 2000
    assert by["negatives", 0.1]["logits_per_step"] == 8 * (200 + 2000)
    assert by["replicated", 1.0]["logits_per_step"] == 8 * 4000
    assert by["local", 0.1]["bytes_per_step"] == by["local", 1.0]["bytes_per_step"]
    assert by["local", 0.1]["vs_limit"] > 0           # against the limit of the same rate
    assert "| 16 | 4,000 | global | 0.1 |" in open(out / "bench.md").read()


@pytest.mark.multirank
def test_bench_runs_each_job_under_both_engines_and_compares_them(tiny_bench, tmp_path, monkeypatch):
    """``--engines horovod,torch``: the local job under horovodrun and under torchrun, each rank on the engine
    its launcher implies (with the collective-order check on), one limit for both. Each record names its
    engine, the step split fits in the step (the torch engine's own wait counted once), the gradient's
    bytes once under both, and the ratio is torch's samples/s over Horovod's of the same run. The torch job
    is launched here; the Horovod job and the limit are the same jobs (C = 4,000, rate 1, ``local`` bare)
    that the tiny bench above launched through the same ``launch``: their records are handed back from its
    folder instead of launching them again (~15 CPU-seconds)."""
    from hvd_partialfc.tools import bench
    monkeypatch.setenv("HVD_PARTIALFC_CHECK_COLLECTIVES", "1")
    launched = tiny_bench[1] / "jobs"

    def launch(a, mode, engine, classes, dim, out, timeout, rate=1.0):
        if engine == "torch":
            return bench_engines.launch(a, mode, engine, classes, dim, out, timeout, rate)
        job = launched / f"{mode if engine == 'none' else f'{mode}-{engine}'}-C{classes}-D{dim}"
        assert rate == 1.0 and job.is_dir(), job
        return [json.load(open(f)) for f in sorted(job.glob("rank-*.json"))]
    monkeypatch.setattr(bench, "launch", launch)
    res = _tiny_bench(tmp_path, "--classes", "4000", "--modes", "local", "--engines", "horovod,torch")
    by = {(p["mode"], p["engine"]): p for p in res["points"]}
    assert list(by) == [("limit", "none"), ("local", "horovod"), ("local", "torch")]
    assert res["engines"] == ["horovod", "torch"]
    lim, hvd, tch = by["limit", "none"], by["local", "horovod"], by["local", "torch"]
    for p in (hvd, tch):
        assert p["ranks"] == 2 and p["samples_per_s"] > 0 and p["width"] == 2000
        assert p["bytes_per_step"] == p["grad_bytes"] == p["backbone_params"] * 4
        assert min(p["split_s"].values()) >= 0 and sum(p["split_s"].values()) <= p["step_s"] * (1 + 1e-9)
        assert p["vs_limit"] == pytest.approx(p["samples_per_s"] / lim["samples_per_s"])
    assert res["engine_ratios"] == [{"mode": "local", "classes": 4000, "dim": 16, "sample_rate": 1.0,
                                     "horovod": hvd["samples_per_s"], "torch": tch["samples_per_s"],
                                     "torch_vs_horovod": pytest.approx(tch["samples_per_s"] / hvd["samples_per_s"])}]
    md = open(tmp_path / "bench.md").read()
    assert "| 16 | 4,000 | local | 1 | torch |" in md and "| 16 | 4,000 | local | 1 | horovod |" in md
    assert f"| {res['engine_ratios'][0]['torch_vs_horovod']:.2f} |" in md.split("torch / horovod")[1]


def test_sampled_local_counts_its_sampled_columns_and_rows_sparse_gradient():
    # r x W columns of logits for local too, and a gradient of the K sampled rows (global's stays (W, D))
    full = estimate(1_000_000, 2, 128, 64, mode="local", bb=BB)
    loc = estimate(1_000_000, 2, 128, 64, mode="local", sample_rate=0.1, bb=BB)
    glo = estimate(1_000_000, 2, 128, 64, mode="global", sample_rate=0.1, bb=BB)
    assert loc["memory_bytes"]["logits"] == 64 * 50_000 * 4 == full["memory_bytes"]["logits"] // 10
    assert glo["memory_bytes"]["logits"] == 128 * 50_000 * 4
    assert loc["memory_bytes"]["classifier grads"] == 50_000 * 128 * 4
    assert glo["memory_bytes"]["classifier grads"] == 500_000 * 128 * 4
    assert loc["traffic_total"] == full["traffic_total"]


def _limit_job_rss(tmp_path, classes, dim):
    """Peak RSS (bytes) of one no-communication job (``bench --worker limit``, 1 rank: all ``classes``
    rows) in its own process."""
    job = tmp_path / f"c{classes}"
    job.mkdir()
    p = subprocess.run([sys.executable, "-m", "hvd_partialfc.tools.bench", "--worker", "limit", "--classes",
                        str(classes), "--dim", str(dim), "--batch", "8", "--steps", "2", "--warmup", "1", "--np", "1",
                        "--in-dim", "16", "--rank", "0", "--job", str(job)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.load(open(job / "rank-0.json"))["peak_rss"]


def test_the_size_terms_where_they_dominate(tmp_path):
    """The class-dependent terms (weights, gradients, momentum, logits) checked where they are the memory: the
    peak RSS of a 1,000,000-class job minus a 200,000-class one's (the runtime, the backbone and whatever a
    small job's first step leaves cancel) against the estimate's difference (610 MB). A whole-RSS comparison at
    the tiny bench's 4,000 classes is ~99 % the runtime constant: a term wrong by 2x passed it; here one of
    the three C x D terms left out or doubled is 33 % off. Measured: +2.6 % alone. A 20,000-class job as the
    base measured +1.5 % alone but -24 % inside the full suite: its peak holds ~100 MB that the estimate does
    not model and that varied."""
    small, big = _limit_job_rss(tmp_path, 200_000, 64), _limit_job_rss(tmp_path, 1_000_000, 64)
    est = {c: estimate(c, 1, 64, 8, "mlp", "local", bb=BB)["memory_total"] for c in (200_000, 1_000_000)}
    want, got = est[1_000_000] - est[200_000], big - small
    print(f"1M - 200k classes, D 64: peak RSS +{got / 2 ** 20:.0f} MB, estimate +{want / 2 ** 20:.0f} MB "
          f"({got / want - 1:+.1%})")
    assert want > 500 * 2 ** 20 and abs(got / want - 1) < 0.15, (got / 2 ** 20, want / 2 ** 20)
