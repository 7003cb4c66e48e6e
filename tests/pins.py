"""Pinned numbers of fixed short runs: what a refactor must leave unchanged, bit for bit.

    .venv/bin/python tests/pins.py --record     # on a commit known to be right: record this machine's pins

Runs (``CASES``): ``simulate --ranks 2`` for 30 steps, one per classifier mode (``local`` with cross-shard
negatives, sampled ``local`` at r = 0.3, ``global`` at r = 0.1, ``replicated``) and one with fp16 loss
scaling, clipping, two backward passes a step, sync BatchNorm, AdamW and flip augmentation together; and
one real ``horovodrun -np 2`` run (the simulator never touches Horovod's engine). Each run checkpoints at
step 15 and 30. Pinned of the step-30 checkpoint: the backbone (parameters and buffers), its optimizer
state, and every rank's classifier rows, optimizer state and counters, hashed here from the files with
this module's own hash (never the package's, which a refactor might move or change).

The step-15 checkpoints are committed (``tests/fixtures/pins/<case>/``, with the shard sets they trained
on; another environment's under ``tests/fixtures/pins/env-<hash>/<case>/``): a run resumed from one must reach
the pinned step-30 digest, so an old checkpoint keeps resuming bitwise after the code around it moved. The shard builders are pinned too: the sha256 of the shard files
that the in-memory and the streaming builder write from one small RecordIO source.

Float results depend on the torch build and the CPU's kernels, shard bytes on numpy, h5py and Pillow: pins
are kept per environment (``environment()``: those versions and the CPU capability). They are this
machine's regression checks: elsewhere the bitwise tests skip, naming the environments pinned. A developer
moving code on another machine records that machine's pins first, on a commit known to be right (landed
``main``).

What runs on every build (``summary``, ``within``): each pinned run's losses at steps 10, 20, 30 and the
norms of its backbone and classifier rows, against the values recorded here, within the case's recorded tolerance:
ten times the largest difference measured across builds on this machine (``--measure``: the CPU kernels of
AVX2 and of no vector extension through ``ATEN_CPU_CAPABILITY``, 4 threads instead of 1, oneDNN off;
docs/development.md has the figures). A change of method (a margin, a schedule, a gradient scale) moves
these figures by far more.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "pins")
PINS = os.path.join(ROOT, "tests", "pins.json")
STEPS, RESUME_AT = 30, 15

# the small feature runs: an MLP with BatchNorm on 40 classes of 16-d features, 2 shards
FEATURES = ["model.name=mlp", "model.embedding_dim=32", "model.kwargs={hidden_dim: 32}", "data.batch_size=16",
            "train.log_every=10", "optim.warmup_steps=3", "train.threads=1", "checkpoint.every=15",
            "checkpoint.keep=3", "head.loss=cosface", "head.scale=16", "head.margin=0.2"]
IMAGES = ["model.name=resnet", "model.kwargs={width: 4}", "data.batch_size=8", "train.log_every=10",
          "optim.warmup_steps=3", "train.threads=1", "checkpoint.every=15", "checkpoint.keep=3",
          "head.loss=cosface", "head.scale=16", "head.margin=0.2"]
CASES: Dict[str, Dict] = {
    "local_negatives": {"data": "features", "sets": FEATURES + ["head.negatives_every=5", "head.negatives_share=8"]},
    "local_sampled": {"data": "features", "sets": FEATURES + ["head.negatives_every=0", "head.sample_rate=0.3"]},
    "global_sampled": {"data": "features", "sets": FEATURES + ["head.mode=global", "head.sample_rate=0.1"]},
    "replicated": {"data": "features", "sets": FEATURES + ["head.mode=replicated"]},
    "mixed": {"data": "images", "sets": IMAGES + [
        "train.precision=fp16", "optim.clip_grad_norm=1.0", "optim.backward_passes_per_step=2",
        "model.sync_batchnorm=true", "optim.name=adamw", "optim.backbone_lr=0.003", "optim.classifier_lr=0.003",
        "data.augment=[flip]", "head.negatives_every=4", "head.negatives_share=2"]},
    "horovodrun": {"data": "features", "real": True,
                   "sets": FEATURES + ["head.negatives_every=5", "head.negatives_share=8"]},
}


def environment() -> str:
    """What the pinned bytes depend on: the torch build and the CPU kernels it picks (runs); numpy, h5py and
    its HDF5, Pillow (shards). ``HVD_PARTIALFC_PINS_ENV`` stands in for it (tests of another machine)."""
    if os.environ.get("HVD_PARTIALFC_PINS_ENV"):
        return os.environ["HVD_PARTIALFC_PINS_ENV"]
    import h5py
    import numpy
    import PIL
    import torch
    return (f"torch {torch.__version__} / {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
            f"{_cpu_generation()} / numpy {numpy.__version__} / h5py {h5py.__version__} "
            f"(HDF5 {h5py.version.hdf5_version}) / Pillow {PIL.__version__}")


def _cpu_generation() -> str:
    """" AMX" on a CPU with AMX tiles (Sapphire Rapids and later), else "". torch reports the same capability
    (AVX512) there, but its float32 matrix products take other kernels: on 2026-12-06 a machine of this
    project with AMX gave other digests than the pins recorded without, at the same torch, numpy and code."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
    return " AMX" if " amx_tile" in flags else ""


def fixture_dir(recorded: Dict, case: str) -> str:
    """The committed step-15 checkpoint of ``case`` for the environment whose pins are ``recorded``: each
    environment resumes its own (another's step 15 takes other kernels' path to step 30)."""
    return os.path.join(FIXTURES, recorded.get("fixtures", ""), case)


# --- what runs on every build: losses and norms within a measured tolerance ------------------------------

def summary(ckpt: str) -> Dict[str, float]:
    """Losses at the logged steps and norms of a run's step-30 checkpoint (``ckpt``): what every build must
    reproduce closely, not bitwise."""
    import torch
    run = os.path.dirname(os.path.dirname(ckpt))
    out = {}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and r.get("step"):
                out[f"loss@{r['step']}"] = float(r["loss"])
    bb = torch.load(os.path.join(ckpt, "backbone.pt"), map_location="cpu", weights_only=True)["state_dict"]
    out["norm:backbone"] = float(torch.sqrt(sum((v.double() ** 2).sum() for v in bb.values() if v.is_floating_point())))
    with open(os.path.join(ckpt, "meta.json")) as f:
        files = json.load(f)["classifier_files"]
    for r, name in enumerate(files):
        w = torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=True)["weight"]
        out[f"norm:rank{r}.classifier"] = float(w.double().norm())
    return out


def within(got: Dict[str, float], want: Dict[str, float], tolerance: Dict[str, float]) -> List[str]:
    """The figures of ``got`` outside ``tolerance`` (relative) of ``want``; empty when all agree."""
    bad = []
    if sorted(got) != sorted(want):
        return [f"figures {sorted(got)} != recorded {sorted(want)}"]
    for k, w in want.items():
        tol = tolerance["loss" if k.startswith("loss") else "norm"]
        if abs(got[k] - w) > tol * max(abs(w), 1e-12):
            bad.append(f"{k}: {got[k]:.6g}, recorded {w:.6g} (relative difference {abs(got[k] - w) / abs(w):.2e} > {tol:.1e})")
    return bad


# --- hashing, independent of the package --------------------------------------------------------------

def _feed(h, obj) -> None:
    """Hash tensors (dtype, shape, bytes), containers in key order, and plain values by repr."""
    import torch
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def digest(obj) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def checkpoint_digests(ckpt: str) -> Dict[str, str]:
    """The pinned parts of a checkpoint folder: backbone, its optimizer, each rank's classifier file."""
    import torch
    load = lambda name: torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=True)  # noqa: E731
    bb = load("backbone.pt")
    out = {"backbone": digest(bb["state_dict"]), "backbone_optimizer": digest(bb["optimizer"])}
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    for r, name in enumerate(meta["classifier_files"]):
        f = load(name)
        out[f"rank{r}.classifier"] = digest(f["weight"])
        out[f"rank{r}.classifier_optimizer"] = digest(f["optimizer"])
        # the torch stream is seeded by the run (seeds.py); numpy's and Python's global generators are
        # seeded by the OS at each start and nothing in a run draws from them: their states are not pinned
        rng = {k: v for k, v in (f.get("rng") or {}).items() if k in ("torch", "cuda")}
        out[f"rank{r}.rng_counters_head"] = digest([rng, f.get("counters"), f.get("head_state")])
    return out


# --- running ------------------------------------------------------------------------------------------

def _env() -> Dict[str, str]:
    bin_ = os.path.dirname(sys.executable)
    e = dict(os.environ, PYTHONPATH=ROOT, PATH=bin_ + os.pathsep + os.environ.get("PATH", ""),
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    e.pop("HVD_PARTIALFC_FAULT", None)
    return e


def _run(cmd: List[str], timeout: int = 300, env: Optional[Dict[str, str]] = None) -> None:
    p = subprocess.run(cmd, env=dict(_env(), **(env or {})), cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")


def run_case(name: str, out: str, resume: str = "") -> str:
    """Train case ``name`` into ``out`` (to step 30; from checkpoint ``resume`` if given); the step-30 folder."""
    case = CASES[name]
    args = ["--shards", os.path.join(FIXTURES, "data", case["data"]), "--out", out, "--steps", str(STEPS)]
    if resume:
        args += ["--resume", resume]
    for s in case["sets"]:
        args += ["--set", s]
    if case.get("real"):
        cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "--gloo",
               sys.executable, "-m", "hvd_partialfc.cli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "hvd_partialfc.cli", "simulate", "--ranks", "2", *args]
    _run(cmd)
    return os.path.join(out, "checkpoints", f"step-{STEPS:08d}")


def shard_builds(tmp: str) -> Dict[str, List[str]]:
    """sha256 of every shard file the in-memory and the streaming builder write from one RecordIO source."""
    sys.path.insert(0, ROOT)
    from data_tools.bench_build import write_synthetic_rec
    write_synthetic_rec(os.path.join(tmp, "src"), 240, 12, 0)
    from data_tools.build import BuildOptions, build
    from data_tools.importers import get_importer
    out = {}
    for builder in ("memory", "stream"):
        for store in ("raw", "encoded"):
            dst = os.path.join(tmp, f"{builder}-{store}")
            if builder == "memory":
                build(get_importer("recordio"), os.path.join(tmp, "src"), BuildOptions(
                    out=dst, num_shards=3, store=store, seed=3, holdout=0.25, workers=1, progress=False))
            else:
                _run([sys.executable, "-m", "data_tools.shards_cli", "build", "recordio", os.path.join(tmp, "src"),
                      "--out", dst, "--num-shards", "3", "--store", store, "--seed", "3", "--holdout", "0.25",
                      "--workers", "1"])
            shas = []
            for folder in (dst, dst + "-holdout"):
                with open(os.path.join(folder, "manifest.json")) as f:
                    files = [s["file"] for s in json.load(f)["shards"]]
                for name in files:
                    with open(os.path.join(folder, name), "rb") as f:
                        shas.append(hashlib.sha256(f.read()).hexdigest())
            out[f"{builder}-{store}"] = shas
    return out


def load_pins() -> Dict:
    if not os.path.isfile(PINS):
        return {}
    with open(PINS) as f:
        return json.load(f)


# --- recording --------------------------------------------------------------------------------------------

def _scrub_meta(ckpt: str, run_dir: str) -> None:
    """The committed meta.json names no machine path: the run and shard folders become placeholders
    (resume ignores both keys: they may change between a checkpoint and its resume)."""
    path = os.path.join(ckpt, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta["config"]["out"] = "RUN"
    meta["config"]["data"]["shards"] = "SHARDS"
    meta["time"] = 0.0
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)


def _make_data() -> None:
    """The two committed shard sets (built once; their provenance path scrubbed)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import build_shards, make_feature_npz, make_image_npz
    for kind, make in (("features", lambda p: make_feature_npz(p, [24] * 40)),
                       ("images", lambda p: make_image_npz(p, 12, 16))):
        dst = os.path.join(FIXTURES, "data", kind)
        if os.path.isdir(dst):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            build_shards(make(os.path.join(tmp, "src.npz")), dst, 2)
        with open(os.path.join(dst, "manifest.json")) as f:
            m = json.load(f)
        m["source"] = {k: ("src.npz" if k == "path" else v) for k, v in m.get("source", {}).items()}
        with open(os.path.join(dst, "manifest.json"), "w") as f:
            json.dump(m, f, indent=1)


def record() -> Dict:
    _make_data()
    env = environment()
    pins = load_pins()
    mine = {"runs": {}, "shards": {}}
    others = [k for k in pins if k not in ("portable", env)]
    if pins.get(env, {}).get("fixtures") or others:   # the first environment's fixtures are FIXTURES/<case>
        mine["fixtures"] = pins.get(env, {}).get("fixtures") or "env-" + hashlib.sha256(env.encode()).hexdigest()[:8]
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            run = os.path.join(tmp, name)
            final = run_case(name, run)
            mine["runs"][name] = checkpoint_digests(final)
            at = os.path.join(run, "checkpoints", f"step-{RESUME_AT:08d}")
            fixture = fixture_dir(mine, name)
            if not CASES[name].get("real"):
                shutil.rmtree(fixture, ignore_errors=True)
                shutil.copytree(at, fixture)
                _scrub_meta(fixture, run)
                resumed = run_case(name, os.path.join(tmp, name + "-resumed"), resume=fixture)
                got = checkpoint_digests(resumed)
                assert got == mine["runs"][name], f"{name}: the resumed run differs from the uninterrupted one"
            print(f"{name}: {mine['runs'][name]['backbone'][:16]}", flush=True)
        mine["shards"] = shard_builds(tmp)
    pins[env] = mine
    with open(PINS, "w") as f:
        json.dump(pins, f, indent=1, sort_keys=True)
        f.write("\n")
    return mine


# The other builds a user may have, as this machine can stand in for them: (name, environment, code run
# before the CLI). ATEN_CPU_CAPABILITY picks torch's CPU kernels (an AVX2 or an older CPU's).
VARIANTS = [
    ("AVX2 kernels", {"ATEN_CPU_CAPABILITY": "avx2"}, ""),
    ("no vector kernels", {"ATEN_CPU_CAPABILITY": "default"}, ""),
    ("4 threads", {"HVD_PARTIALFC_PINS_THREADS": "4"}, ""),
    ("oneDNN off", {}, "import torch; torch.backends.mkldnn.enabled = False; "),
]


def _summary_run(name: str, out: str, env: Dict[str, str], prelude: str) -> Dict[str, float]:
    case = CASES[name]
    argv = ["simulate", "--ranks", "2", "--shards", os.path.join(FIXTURES, "data", case["data"]), "--out", out,
            "--steps", str(STEPS)]
    for s in case["sets"] + ([f"train.threads={env['HVD_PARTIALFC_PINS_THREADS']}"]
                             if "HVD_PARTIALFC_PINS_THREADS" in env else []):
        argv += ["--set", s]
    _run([sys.executable, "-c", prelude + "import sys; from hvd_partialfc.cli import main; "
          f"sys.exit(main({argv!r}))"], env=env)
    return summary(os.path.join(out, "checkpoints", f"step-{STEPS:08d}"))


def measure() -> Dict:
    """The simulated cases' figures here, then under each of ``VARIANTS``: per case, the largest relative
    difference of its losses and of its norms under each variant; a case's tolerance is ten times its largest
    (at least 1e-6). Written to tests/pins.json's ``portable`` section; a table printed."""
    cases = [c for c in CASES if not CASES[c].get("real")]
    ref, worst = {}, {c: {} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for name in cases:
            ref[name] = _summary_run(name, os.path.join(tmp, name), {}, "")
        for i, (label, env, prelude) in enumerate(VARIANTS):
            for name in cases:
                got = _summary_run(name, os.path.join(tmp, f"{name}-{i}"), env, prelude)
                w = {"loss": 0.0, "norm": 0.0}
                for k, v in ref[name].items():
                    kind = "loss" if k.startswith("loss") else "norm"
                    w[kind] = max(w[kind], abs(got[k] - v) / max(abs(v), 1e-12))
                worst[name][label] = w
    tolerance = {c: {k: max(1e-6, 10 * max(w[k] for w in worst[c].values())) for k in ("loss", "norm")}
                 for c in cases}
    print(f"{'case':<16} " + " ".join(f"{label:>22}" for label, _, _ in VARIANTS) + "   tolerance (loss, norm)")
    for c in cases:
        print(f"{c:<16} " + " ".join(f"{worst[c][l]['loss']:>10.1e} {worst[c][l]['norm']:>10.1e} " for l, _, _ in VARIANTS)
              + f"  {tolerance[c]['loss']:.1e}, {tolerance[c]['norm']:.1e}")
    pins = load_pins()
    pins["portable"] = {"recorded_on": environment(), "reference": ref, "measured": worst, "tolerance": tolerance}
    with open(PINS, "w") as f:
        json.dump(pins, f, indent=1, sort_keys=True)
        f.write("\n")
    return pins["portable"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="record this machine's pins into tests/pins.json")
    ap.add_argument("--measure", action="store_true",
                    help="measure the cross-build differences and record the portable figures and tolerance")
    a = ap.parse_args()
    if a.record:
        record()
        print(f"recorded pins for {environment()} in {os.path.relpath(PINS, ROOT)}")
    if a.measure:
        measure()
