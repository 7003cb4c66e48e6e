"""Side by side with arcface_torch: its train_v2 step against this package's step, same device, batch and data.

    python -m hvd_partialfc.tools.arcface_compare --arcface-dir ~/insightface --model iresnet50 --batch 128 \\
        --classes 125000 --precision fp16 --gathered 8 --out r50-125k.json
    python -m hvd_partialfc.tools.arcface_compare --contenders local,global --model resnet --image-size 32 \\
        --set "model.kwargs={width: 4}" --classes 1000 --batch 8 --precision fp32 --device cpu   # ours alone

Contenders (``--contenders``): ``arcface`` (arcface_step.py: its iresnet, PartialFC_V2 at ``--sample-rate``
0.1, GradScaler, clip 5, SGD, DDP as train_v2 wraps it; needs ``--arcface-dir``), ``local`` (the trainer's
``Step``, ``head.mode=local``, every centre of the slice) and ``global`` (``head.mode=global`` at the same
sample rate: Partial FC's method in this package). Ours run with clip 5, SGD lr 0.1, momentum 0.9, weight
decay 5e-4 and ArcFace (64, 0.5) as theirs; ``--set`` changes our config (the fast-path keys).

One GPU holds one rank's share of an N-GPU job: ``--classes`` is that share (125,000 = 10^6 / 8), and
``--gathered N`` gives the heads that gather (arcface's, ``global``) the N x B rows a rank of N scores after
its all-gather, labels spread over all N x C classes; ``local`` gathers nothing (its batch holds its own
classes). What the N-GPU job adds beyond (the gathers, the reductions, the backbone's all-reduce):
docs/benchmarks.md, "Side by side with arcface_torch".

The data: ``--pool`` batches of random uint8 images (B, H, W, 3) and labels, made once on the device; every
contender gets them in the same order and turns them into [-1, 1] floats as the trainer does. The timing:
``--warmup`` steps each, then ``--rounds`` rounds, each contender ``--steps`` steps a round in a rotating
order (so drift in the machine's speed falls on all), the device synchronised around each contender's
steps; medians over rounds. A contender that runs out of memory (built, warming up, or in a timed round) is
recorded as such and the others go on. Beside each time: the steps of the timed rounds skipped on a
non-finite fp16 gradient (``skipped_steps`` of ``timed_steps``: a skipped step is cheaper), and for arcface
whether DDP wrapped it (``--no-ddp``: at one rank its all-reduce is a cost ours does not pay) and the
arguments its scheduler passed that this torch no longer takes (``scheduler_dropped``). JSON to ``--out``.

Memory (CUDA): all contenders live on the device together, so the device's peak during one's steps holds the
others' weights too (``device GiB``). Each one's own (``own GiB``) is what its building allocated (model,
head, optimizer, its batches), what its warm-up added (gradients, moments, workspaces) and the most its steps
rose above that (activations, logits): the three measured apart, built and warmed one contender at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from ..atomic import write_text
from ..engine.local import LocalComm
from .arcface_step import ARCFACE_NAMES, ArcfaceStep, check_precision, find_arcface, load_arcface

CONTENDERS = ("arcface", "local", "global")


class GatheredRows(LocalComm):
    """Rank 0 of ``size`` for ``global``'s head with ``--gathered``: its gathers return this rank's rows and
    the other ranks' stand-ins (fixed features, labels of all classes), its reductions this rank's values:
    a rank's compute after the collectives, without them. Nothing else is a collective here."""

    def __init__(self, size: int, peers: torch.Tensor, peer_labels: torch.Tensor):
        super().__init__(0, size)
        self.peers, self.peer_labels = peers, peer_labels

    def allgather_tensor(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if name.endswith(".rows"):                                      # every rank's row count: B
            return tensor.repeat(self.size)
        extra = self.peer_labels if name.endswith(".labels") else self.peers.to(tensor.dtype)
        return torch.cat([tensor.detach(), extra.to(tensor.device)])

    def allreduce_tensor(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        return tensor.detach().clone()


def _peer_rows(a, classes: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    n = (a.gathered - 1) * a.batch
    return (torch.randn(n, 512, generator=g).to(device),
            torch.randint(0, classes * a.gathered, (n,), generator=g).to(device))


def our_step(a, mode: str, device: torch.device, total: int) -> Callable[[Any], Any]:
    """This package's step for ``mode`` (local / global), as the trainer builds it, on ``a``'s sizes."""
    from ..config_io import load_config
    from ..data.layout import RankLayout
    from ..run.parts import build_parts
    from ..run.speed import set_device_flags
    from ..run.step import Step
    sets = [f"model.name={a.model}", "model.embedding_dim=512", f"data.batch_size={a.batch}",
            f"train.precision={a.precision}", f"head.mode={mode}", "head.negatives_every=0",
            f"head.sample_rate={1.0 if mode == 'local' else a.sample_rate}", "head.loss=arcface", "head.scale=64",
            "head.margin=0.5", "optim.clip_grad_norm=5", "optim.backbone_lr=0.1", "optim.classifier_lr=0.1",
            f"train.device={device.type}", "data.shards=synthetic"]
    if a.blocks:
        sets.append(f"model.kwargs={{blocks: [{a.blocks}]}}")
    cfg = load_config(overrides=sets + list(a.set or []))
    # cuDNN's autotuner as the trainer's start-up sets it: torch's default is off, and a step built outside
    # run() (gpu_speed_check's switches, compile cells and largest batch, alone with --only) ran without it
    set_device_flags(cfg, device)
    gather = mode == "global" and a.gathered > 1
    comm = GatheredRows(a.gathered, *_peer_rows(a, a.classes, device)) if gather else LocalComm()
    parts = build_parts(cfg, comm, RankLayout.even(a.classes * comm.size, comm.size),
                        [a.image_size, a.image_size, 3], device)
    step = Step(cfg, comm, parts, device, "images", total)
    count = iter(range(total))

    def run(batches):
        return step(next(count), batches)

    def skipped() -> int:
        """Steps skipped on a non-finite gradient so far (fp16's loss scale), the device decision's books settled."""
        if parts.device_skips is not None:
            parts.device_skips.settle()
        return parts.counters.skipped_steps
    run.compiled = parts.compiled          # train.compile's record: what compiled, in how long
    run.skipped = skipped
    return run


def device_batches(a, device: torch.device, label_range: int):
    g = torch.Generator().manual_seed(0)
    pool = [(torch.randint(0, 256, (a.batch, a.image_size, a.image_size, 3), dtype=torch.uint8, generator=g).to(device),
             torch.randint(0, label_range, (a.batch,), generator=g).to(device)) for _ in range(a.pool)]
    i = 0
    while True:
        yield pool[i % len(pool)]
        i += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(a, device: torch.device, memory=None) -> Dict[str, Dict[str, Any]]:
    """Every contender's step and batches, or the error that stopped it (out of memory, a missing checkout);
    with the device's counters (``device_memory``), the bytes its building allocated (``built_bytes``)."""
    total = a.warmup + a.rounds * a.steps + 1
    out: Dict[str, Dict[str, Any]] = {}
    mem = memory or device_memory(device)
    for name in a.contenders.split(","):
        held = mem.allocated() if mem else 0
        try:
            if name == "arcface":
                mods = load_arcface(a.arcface_dir)
                check_precision(a.precision == "fp16", device)
                net = {v: k for k, v in ARCFACE_NAMES.items()}.get(a.model)
                if net is None:
                    raise ValueError(f"--model {a.model}: arcface_torch has {', '.join(ARCFACE_NAMES.values())}")
                step = ArcfaceStep(mods, net, a.classes, a.sample_rate, a.precision == "fp16", device, a.gathered,
                                   ddp=not a.no_ddp, steps=total, blocks=a.blocks)
                data = device_batches(a, device, a.classes * a.gathered)
                out[name] = {"run": lambda d=data, s=step: s(*next(d)), "root": mods["root"], "skipped": step.skipped,
                             "info": {"ddp": not a.no_ddp, "scheduler_dropped": step.sched_dropped}}
            elif name in ("local", "global"):
                fn = our_step(a, name, device, total)
                data = device_batches(a, device, a.classes * (a.gathered if name == "global" else 1))
                out[name] = {"run": lambda d=data, f=fn: f(d), "skipped": getattr(fn, "skipped", None)}
            else:
                raise ValueError(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")
        except torch.cuda.OutOfMemoryError as e:
            out[name] = {"error": f"out of memory: {' '.join(str(e).split())[:160]}"}
            torch.cuda.empty_cache()
        if mem and "error" not in out[name]:
            out[name]["built_bytes"] = mem.allocated() - held
    return out


class DeviceMemory:
    """One CUDA device's allocator counters, in bytes (``measure``'s accounting; a test gives its own)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def device_memory(device: torch.device):
    return DeviceMemory(device) if device.type == "cuda" else None


def _out_of_memory(contenders, live: List[str], name: str, where: str, batch: int, **kept) -> None:
    """``name`` ran out of device memory ``where``: recorded as its error (with what it measured before,
    ``kept``), out of the rounds, and the allocator's cache given back for the others."""
    contenders[name] = {"error": f"out of memory in {where} at batch {batch}", **kept}
    live.remove(name)
    torch.cuda.empty_cache()


def _warm_up(a, device: torch.device, contenders, live: List[str], mem) -> Dict[str, int]:
    """``a.warmup`` steps of each contender in ``live`` (one out of memory leaves it); with the device's
    counters, what each warm-up left allocated (bytes)."""
    warmed: Dict[str, int] = {}
    for name in list(live):
        held = mem.allocated() if mem else 0
        try:
            for _ in range(a.warmup):
                contenders[name]["run"]()
        except torch.cuda.OutOfMemoryError:
            _out_of_memory(contenders, live, name, f"its first {a.warmup} steps", a.batch)
            continue
        if mem:
            _sync(device)
            warmed[name] = mem.allocated() - held
    return warmed


def measure(a, device: torch.device, contenders: Dict[str, Dict[str, Any]], memory=None) -> Dict[str, Dict[str, Any]]:
    """Warm-up, then alternating rounds; per contender its ms a step in each round, the median, samples/s;
    with the device's counters, its own memory and the device's peak (the module's "Memory")."""
    mem = memory or device_memory(device)
    live = [n for n, c in contenders.items() if "error" not in c]
    warmed = _warm_up(a, device, contenders, live, mem)
    rounds: Dict[str, List[float]] = {n: [] for n in live}
    peaks: Dict[str, int] = {}
    rises: Dict[str, int] = {}
    skips = {n: contenders[n]["skipped"] for n in live if contenders[n].get("skipped")}
    skipped_before = {n: count() for n, count in skips.items()}      # the warm-up's skips are not the rounds'
    for r in range(a.rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for name in order:
            if name not in live:
                continue
            _sync(device)
            if mem:
                mem.reset_peak()
                held = mem.allocated()
            t0 = time.perf_counter()
            try:
                for _ in range(a.steps):
                    contenders[name]["run"]()
                _sync(device)
            except torch.cuda.OutOfMemoryError:      # this contender stops; the others' rounds go on
                _out_of_memory(contenders, live, name, f"timed round {r + 1}", a.batch,
                               ms_per_step_rounds=rounds.pop(name))
                continue
            rounds[name].append(1e3 * (time.perf_counter() - t0) / a.steps)
            if mem:
                top = mem.peak()
                peaks[name], rises[name] = max(peaks.get(name, 0), top), max(rises.get(name, 0), top - held)
    result = {}
    for name, c in contenders.items():
        if "error" in c:
            result[name] = {k: v for k, v in c.items() if k in ("error", "ms_per_step_rounds")}
            continue
        med = statistics.median(rounds[name])
        result[name] = {"ms_per_step_rounds": rounds[name], "median_ms": med, "samples_per_s": 1e3 * a.batch / med,
                        **c.get("info", {})}
        if name in skips:     # a skipped step (fp16 overflow) costs less than a taken one: said beside the time
            result[name].update(skipped_steps=skips[name]() - skipped_before[name], timed_steps=a.rounds * a.steps)
        if mem:                 # own: only where build() counted what the building allocated
            built = c.get("built_bytes")
            result[name].update(device_gib=peaks[name] / 2 ** 30,
                                memory_bytes={"built": built, "warm_up": warmed[name], "step_rise": rises[name]})
            if built is not None:
                result[name]["own_gib"] = (built + warmed[name] + rises[name]) / 2 ** 30
    base = result.get("arcface", {}).get("median_ms")
    for name, r in result.items():
        if base and "median_ms" in r:
            r["speed_vs_arcface"] = base / r["median_ms"]
    return result


def _commit(root: str):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except OSError:
        return None


def run(a) -> Dict[str, Any]:
    """The comparison of ``a`` (``parser()``'s options); the printed table and the JSON."""
    from ..engine.select import start_engine
    want_cpu = a.device == "cpu" or not torch.cuda.is_available()
    comm = start_engine("torch", os.environ, "cpu" if want_cpu else "cuda")   # PartialFC_V2 needs a group: of one
    device = torch.device("cpu") if want_cpu else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True          # train_v2 sets it; the trainer's default too
    if a.threads:
        torch.set_num_threads(a.threads)
    contenders = build(a, device)
    root = next((c.get("root") for c in contenders.values() if c.get("root")), None)
    result = {"what": "arcface_torch side by side", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "arcface_dir": root, "arcface_commit": _commit(root) if root else None,
              "sizes": {k: getattr(a, k) for k in ("model", "blocks", "batch", "image_size", "classes", "gathered",
                                                   "sample_rate", "precision", "rounds", "steps", "warmup")},
              "ours_set": a.set or [], "ddp": not a.no_ddp, "contenders": measure(a, device, contenders)}
    comm.shutdown()
    print(format_table(result))
    if a.out:
        write_text(a.out, json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return result


def format_table(result: Dict[str, Any]) -> str:
    s = result["sizes"]
    lines = [f"{s['model']}{' blocks ' + s['blocks'] if s['blocks'] else ''}, batch {s['batch']}, {s['classes']:,} "
             f"classes, gathered {s['gathered']}, {s['precision']}, {result['device']}",
             f"{'contender':10} {'ms/step':>9} {'rounds (ms)':>28} {'samples/s':>10} {'x arcface':>9} {'own GiB':>8} "
             f"{'device GiB':>10}"]
    for name, r in result["contenders"].items():
        if "error" in r:
            lines.append(f"{name:10} {r['error']}")
            continue
        rounds = " ".join(f"{v:.1f}" for v in r["ms_per_step_rounds"])
        vs = f"{r['speed_vs_arcface']:.2f}" if "speed_vs_arcface" in r else ""
        own, dev = (f"{r[k]:.2f}" if r.get(k) is not None else "" for k in ("own_gib", "device_gib"))
        lines.append(f"{name:10} {r['median_ms']:9.1f} {rounds:>28} {r['samples_per_s']:10,.0f} {vs:>9} {own:>8} "
                     f"{dev:>10}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvd_partialfc.tools.arcface_compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--arcface-dir", help="an InsightFace checkout (or its recognition/arcface_torch)")
    p.add_argument("--contenders", default="arcface,local,global")
    p.add_argument("--model", default="iresnet50", help="iresnet18 | iresnet50 | iresnet100 | vit_t | vit_s | vit_b "
                                                        "(ours alone: any backbone)")
    p.add_argument("--blocks", default="", help="blocks per stage for both iresnets, e.g. 1,1,1,1 (CPU-sized runs)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--classes", type=int, default=125_000, help="one rank's share of the classes")
    p.add_argument("--gathered", type=int, default=1, help="N: the gathering heads score N x batch rows (a rank of N)")
    p.add_argument("--sample-rate", type=float, default=0.1, help="PartialFC_V2's and global's sample rate")
    p.add_argument("--precision", default="fp16", choices=("fp16", "fp32"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per contender per round")
    p.add_argument("--pool", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--device", default="auto", choices=("auto", "cpu"))
    p.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
    p.add_argument("--no-ddp", action="store_true", help="arcface's backbone without train_v2's DDP wrapper")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="our config (e.g. train.channels_last=true)")
    p.add_argument("--out", help="JSON file")
    return p


def main(argv=None) -> int:
    """A user's mistake (no arcface_torch in --arcface-dir, a backbone it lacks, fp16 on CPU) is one line on
    stderr and exit 2, as the console scripts' (cli_support.py; a layer up, so said here alike)."""
    p = parser()
    a = p.parse_args(argv)
    if "arcface" in a.contenders.split(",") and not a.arcface_dir:
        p.error("the arcface contender needs --arcface-dir (an InsightFace checkout), or drop it from --contenders")
    if a.blocks and not a.model.startswith("iresnet"):
        p.error(f"--blocks is for the iresnets; {a.model} takes its own (--set model.kwargs=...) for ours alone")
    try:
        if a.arcface_dir:          # before any work: a folder without arcface_torch is one line
            find_arcface(a.arcface_dir)
        run(a)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
