"""``hvd-partialfc doctor``: what this machine has and lacks for a run, one line each, the fix beside a gap.

    hvd-partialfc doctor [--engine auto|horovod|torch] [--out RUN] [--config FILE] [--set KEY=VALUE ...]
                         [--shards DIR [--np N]]

Lines: torch and its CUDA GPUs; Horovod (built? with PyTorch, its controllers Gloo / MPI, its GPU operations
NCCL); torch.distributed's backends; ``mpirun``; the demo's CJK fonts; a writable run folder; this node's
memory-snapshot root (``checkpoint.memory_every``: writable?, its free space, the memory available, and the
snapshot folders that runs left there: a failure keeps them for its restart); with ``--shards``, the set's
manifest, and with ``--np N`` whether N ranks fit its shards under the layout rules (``data.layout.RankLayout``,
``partition.block_bounds``), the memory per rank (``tools/estimate.py``'s figure for the config's backbone, head
and batch) and, with ``checkpoint.memory_every``, whether the node's snapshots fit.

Exit status: 1 when a requirement of the engine in use is missing (``--engine``, else the config's
``train.engine``; ``auto`` resolves as training does, ``engine/select.py``: Horovod when it is installed,
else torch), when the run folder is not writable, or when the shard set is missing or does not fit N; a
missing optional engine, ``mpirun``, fonts or GPUs (on a CPU run) are notes, exit 0.

Horovod is read through its Python API (``engine/horovod.py`` ``build_info``: ``gloo_built()``,
``mpi_built()``, ``nccl_built()``), not ``horovodrun --check-build``, which starts a process per framework:
9.8 s of CPU measured on the project's shared 2-core machine (43.7 s wall at a load of 10), against 0.1 s for
the import once torch is loaded (torch's own import is ~2 s of doctor's whole run).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional

OK, NOTE, FAIL = "ok", "note", "FAIL"
INSTALL = "bash scripts/setup/install.sh"


@dataclass
class Check:
    """One line of the report: ``status`` ok | note | FAIL, what was found, and the fix where something lacks."""

    status: str
    what: str
    fix: str = ""

    def line(self) -> str:
        return f"  {self.status:<5} {self.what}" + (f" -> fix: {self.fix}" if self.fix else "")


def _gpu_wanted(device: str, cuda: bool) -> bool:
    """Whether a run with ``train.device`` = ``device`` trains on CUDA (as engine/device.py decides)."""
    return device == "cuda" or (device == "auto" and cuda)


def _release(version: str) -> tuple:
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit())


def check_torch(device: str) -> List[Check]:
    import torch
    from .. import MIN_TORCH
    if _release(torch.__version__) < _release(MIN_TORCH):
        return [Check(FAIL, f"torch {torch.__version__}: older than {MIN_TORCH}, the oldest this package supports",
                      f"pip install 'torch>={MIN_TORCH}'")]
    cuda = torch.cuda.is_available()
    if cuda:
        gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        names = ", ".join(sorted({f"{g.name} ({g.total_memory / 2 ** 30:.0f} GiB)" for g in gpus}))
        return [Check(OK, f"torch {torch.__version__}, CUDA {torch.version.cuda}: {len(gpus)} GPU(s), {names}")]
    why = (f"a CUDA build (CUDA {torch.version.cuda}) that sees no GPU" if torch.version.cuda
           else "a CPU-only build")
    fix = ("check the driver and CUDA_VISIBLE_DEVICES" if torch.version.cuda
           else "install a CUDA build of torch for GPUs (docs/gpu.md)")
    status = FAIL if device == "cuda" else NOTE
    return [Check(status, f"torch {torch.__version__}: {why}; training runs on CPU", fix)]


def check_horovod(in_use: bool, gpu: bool, allow_host_allreduce: bool) -> List[Check]:
    """Horovod's build through its Python API. Missing parts fail only when Horovod is the engine in use."""
    need = FAIL if in_use else NOTE
    try:
        from ..engine.horovod import build_info   # the one module that imports Horovod
        info = build_info()
    except Exception as e:   # noqa: BLE001 - not installed, blocked, or its extension does not load
        why = "optional: the torch engine (torchrun) needs none" if not in_use else "the engine in use"
        return [Check(need, f"Horovod: not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]}); {why}",
                      f"{INSTALL} (builds it) or pip install '.[horovod]'")]
    controllers = [n for n, key in (("Gloo", "gloo"), ("MPI", "mpi")) if info[key]]
    checks = [Check(OK if controllers else need,
                    f"Horovod {info['version']}: frameworks PyTorch; controllers "
                    f"{', '.join(controllers) or 'none'}",
                    "" if controllers else f"rebuild it: {INSTALL} (HOROVOD_WITH_GLOO=1)")]
    nccl = info["nccl"]
    if nccl:
        checks.append(Check(OK, f"Horovod GPU operations: NCCL {nccl}"))
    elif gpu and not allow_host_allreduce:
        checks.append(Check(need, "Horovod GPU operations: none, on a CUDA run (every gradient through the host)",
                            "HOROVOD_GPU_OPERATIONS=NCCL " + INSTALL + " (docs/gpu.md#building-horovod-for-gpus)"))
    else:
        checks.append(Check(NOTE if gpu else OK, "Horovod GPU operations: none (NCCL not built; "
                            + ("train.allow_host_allreduce is on)" if gpu else "not needed on CPU)")))
    return checks


def check_torch_distributed(in_use: bool, gpu: bool) -> List[Check]:
    import torch.distributed as dist
    need = FAIL if in_use else NOTE
    if not dist.is_available():
        return [Check(need, "torch.distributed: not in this torch build", "install torch from pytorch.org")]
    backends = [n for n, f in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available),
                               ("mpi", dist.is_mpi_available)) if f()]
    wanted = "nccl" if gpu else "gloo"
    torchrun = shutil.which("torchrun") or shutil.which("torchrun", path=os.path.dirname(sys.executable))
    ok = wanted in backends and torchrun
    fix = "" if ok else (f"a torch build with {wanted}" if wanted not in backends else "torchrun comes with torch: "
                         "put the environment's bin/ on PATH")
    return [Check(OK if ok else need, f"torch.distributed: backends {', '.join(backends) or 'none'}; the torch "
                  f"engine needs {wanted} and torchrun ({torchrun or 'not found'})", fix)]


def check_mpirun() -> List[Check]:
    path = shutil.which("mpirun")
    if path:
        return [Check(OK, f"mpirun: {path}")]
    return [Check(NOTE, "mpirun: not on PATH (needed only to launch with mpirun / Horovod's MPI controller; "
                  "horovodrun --gloo and torchrun need none)", "apt-get install openmpi-bin, or " + INSTALL)]


def check_fonts() -> List[Check]:
    """The demo's fonts, as fontconfig lists them (the `fonts` importer reads ``fc-list``; it then keeps a face
    for a character only where its cmap has the glyph: data_tools/importers/fonts.py). A note, never a failure."""
    try:
        out = subprocess.run(["fc-list", ":lang=zh", "--format", "%{file}\n"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [Check(NOTE, "demo fonts: fc-list not found (fontconfig)", INSTALL + " --fonts (make demo runs it)")]
    n = len({line for line in out.splitlines() if line.strip()})
    if n:
        return [Check(OK, f"demo fonts: {n} font files with Chinese glyphs (fc-list :lang=zh)")]
    return [Check(NOTE, "demo fonts: no font with Chinese glyphs (fc-list :lang=zh)",
                  INSTALL + " --fonts (make demo runs it)")]


def check_run_folder(out: str) -> List[Check]:
    """``out`` or, when it does not exist yet, its nearest existing parent must take a new file."""
    probe = os.path.abspath(out)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        fd, name = tempfile.mkstemp(prefix=".doctor-", dir=probe)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        return [Check(FAIL, f"run folder {out}: cannot write in {probe} ({e.strerror or e})",
                      "pass --out on a writable file system (every node's ranks write there)")]
    where = "" if probe == os.path.abspath(out) else f" (created at the start; {probe} takes files)"
    from ..run.watch.run_lock import CannotTell, in_use
    try:
        busy = in_use(out)
    except CannotTell as e:
        return [Check(NOTE, f"run folder {out}: writable; whether a job trains into it now cannot be told by "
                      f"this user ({e})", "the lock file's owner's next start there lets the folder's "
                      "group read it (or: chmod g+r it); until then, ask whoever runs jobs there")]
    if busy:
        return [Check(NOTE, f"run folder {out}: writable, and in use by a job training now ({busy}): a start "
                      "there waits for it (checkpoint.lock_wait), then refuses",
                      "wait for that job to end, or pass another --out")]
    return [Check(OK, f"run folder {out}: writable{where}")]


def check_memory_snapshots(configured: str) -> List[Check]:
    """The node's snapshot root (``memory_store.memory_root``: ``$HVD_PARTIALFC_MEMORY_DIR``, else
    ``checkpoint.memory_dir``), the two limits its start-up room check reads (the root's free space, a tmpfs
    having its own size, and ``MemAvailable``), and the ``hvd_partialfc-*`` folders in it with their owners
    (owner.json). A missing or read-only root is a note, not a failure: snapshots are off by default. Folders
    are a note too: a run that ended removed its own, so these are a running run's or a failed one's, and
    they hold the node's memory until removed by hand."""
    from ..run.snapshots.memory_store import PREFIX
    from ..run.snapshots.snapshot_root import ENV_DIR, mem_available, memory_root
    from ..run_files import folder_bytes
    from ..sizes import human
    root = memory_root(configured)
    fix = f"point {ENV_DIR} (or checkpoint.memory_dir) at a writable tmpfs, or leave checkpoint.memory_every=0"
    try:
        fd, name = tempfile.mkstemp(prefix=".doctor-", dir=root)
        os.close(fd)
        os.remove(name)
        st = os.statvfs(root)
    except OSError as e:
        return [Check(NOTE, f"memory snapshots: {root} cannot take a file ({e.strerror or e}); "
                      "checkpoint.memory_every > 0 would be refused at start-up", fix)]
    avail = mem_available()
    what = (f"memory snapshots: {root} writable, {human(st.f_bavail * st.f_frsize)} free, "
            + (f"{human(avail)} of memory available" if avail is not None else "memory available unknown"))
    left, paths = [], []
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        entries = []
    for d in entries:
        full = os.path.join(root, d)
        if not d.startswith(PREFIX) or not os.path.isdir(full):
            continue
        paths.append(full)
        try:
            with open(os.path.join(full, "owner.json")) as f:
                owner = json.load(f)
            whose = f"run {owner.get('run_dir')}, token {owner.get('token')}"
        except (OSError, ValueError, AttributeError):
            whose = "no readable owner.json"
        left.append(f"{d} ({whose}, {human(folder_bytes(full))})")
    if not left:
        return [Check(OK, what + "; no snapshot folders")]
    return [Check(NOTE, what + f"; {len(left)} snapshot folder(s): " + "; ".join(left) + ": a running run's, or "
                  "left by one that crashed or failed (a run that ends removes its own)",
                  "once their runs are over, remove them by hand: rm -r " + " ".join(paths))]


def check_shards(shards: str, world_size: Optional[int], cfg) -> List[Check]:
    """The manifest, whether ``world_size`` ranks fit its shards, and the estimator's memory per rank."""
    from ..data.shards import ShardError, rank_layout, read_manifest
    try:
        m = read_manifest(shards)
    except ShardError as e:
        return [Check(FAIL, f"shards: {e}")]   # the message says what to do
    checks = [Check(OK, f"shards {shards}: {m.num_classes:,} classes, {m.num_shards} shards, {m.num_samples:,} "
                        f"samples, {m.kind} {'x'.join(map(str, m.sample_shape))}")]
    if not world_size:
        return checks
    try:
        layout = rank_layout(m, world_size)
    except ShardError as e:
        return checks + [Check(FAIL, f"{world_size} ranks: {e}")]
    blocks = sorted({len(b) for b in layout.shard_blocks})
    per_rank = str(blocks[0]) if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
    how = ("equal blocks" if m.num_shards % world_size == 0
           else "blocks balanced by samples (N does not divide the shard count)")
    checks.append(Check(OK, f"{world_size} ranks: {per_rank} shard(s) a rank, {how}; "
                            f"{min(layout.widths):,}-{max(layout.widths):,} classes a rank"))
    return checks + [_memory(m, world_size, cfg)] + _snapshot_room(m, world_size, cfg)


def _optimizer(cfg) -> str:
    """The estimator's name for the config's optimizer (its state slots a parameter)."""
    o = cfg.optim
    return "adamw" if o.name == "adamw" else ("sgd" if o.classifier_momentum else "sgd-nomomentum")


def _memory(manifest, world_size: int, cfg) -> Check:
    """The estimator's memory per rank for the config's backbone, head and batch on these shards (a backbone
    that does not take their samples, or an unknown mode, is a FAIL: training would stop on it too)."""
    from ..classifier.modes import get_mode
    from ..sizes import human
    from .estimate import estimate
    h, optimizer = cfg.head, _optimizer(cfg)
    try:
        negatives = h.negatives_every if get_mode(h.mode).negatives else 0
        e = estimate(manifest.num_classes, world_size, cfg.model.embedding_dim, cfg.data.batch_size,
                     cfg.model.name, h.mode, optimizer=optimizer, sample_rate=h.sample_rate,
                     in_shape=manifest.sample_shape, backbone_kwargs=cfg.model.kwargs, negatives_every=negatives,
                     negatives_share=h.negatives_share, negatives_pool=h.negatives_pool, sampled_step=h.sampled_step)
    except (ValueError, KeyError) as err:
        return Check(FAIL, f"model {cfg.model.name}, head.mode={h.mode} on these shards: {str(err).strip(chr(39))}")
    classifier = sum(v for k, v in e["memory_bytes"].items() if k.startswith("classifier"))
    return Check(OK, f"memory per rank (estimate, {cfg.model.name} D={cfg.model.embedding_dim}, batch "
                     f"{cfg.data.batch_size}, {e['mode']}): {human(e['memory_total'])}, classifier {human(classifier)} "
                     f"(docs/scaling.md)")


def _snapshot_room(manifest, world_size: int, cfg) -> List[Check]:
    """With ``checkpoint.memory_every`` > 0: this node's snapshots (the estimator's host terms, a node of
    ``$HVD_PARTIALFC_RANKS_PER_NODE`` ranks, else of the GPUs it shows, else of all N) against the room the
    start-up check reads (``memory_store.room_error``): a FAIL where training would refuse to start."""
    every = cfg.checkpoint.memory_every
    if every <= 0:
        return []
    import torch
    from ..run.snapshots.snapshot_root import memory_root, room_error
    from ..sizes import human
    from .estimate import estimate
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_node = int(os.environ.get("HVD_PARTIALFC_RANKS_PER_NODE") or 0) or min(world_size, gpus or world_size)
    try:
        e = estimate(manifest.num_classes, world_size, cfg.model.embedding_dim, cfg.data.batch_size, cfg.model.name,
                     cfg.head.mode, optimizer=_optimizer(cfg), in_shape=manifest.sample_shape,
                     backbone_kwargs=cfg.model.kwargs, memory_every=every, ranks_per_node=per_node)
    except (ValueError, KeyError):
        return []                       # _memory's line says why
    need = e["host_bytes"]["memory snapshots per node (host RAM)"]
    root = memory_root(cfg.checkpoint.memory_dir)
    short = room_error(root, need, per_node)
    if short:
        return [Check(FAIL, short, "the start-up check refuses the same; $HVD_PARTIALFC_RANKS_PER_NODE sets the "
                      "ranks a node if the guess is wrong")]
    return [Check(OK, f"memory snapshots every {every} steps: {human(need)} a node of {per_node} rank(s) "
                      f"(estimate: two snapshots, the buddies' copies, the backbone) fit {root}")]


def _config(args):
    from ..config_io import load_config
    return load_config(args.config, args.set or [], {"data": {"shards": args.shards or "-"}})


def _engine(want: str):
    """The engine in use for ``train.engine`` = ``want`` in this environment, and why."""
    from ..config import ConfigError
    from ..engine.select import choose_engine
    try:
        return choose_engine(want, os.environ), f"train.engine={want}"
    except ConfigError as e:   # horovod asked for but not installed (its check says so), or a launcher mismatch
        return ("horovod" if want == "horovod" else "torch"), f"train.engine={want}: {e}"


def run_doctor(args) -> int:
    from ..config import ConfigError
    if args.np is not None and not args.shards:
        raise ConfigError("--np N checks a shard set: give --shards DIR too")
    cfg = _config(args)
    engine, why = _engine(args.engine or cfg.train.engine)
    import torch
    gpu = _gpu_wanted(cfg.train.device, torch.cuda.is_available())
    checks = check_torch(cfg.train.device)
    checks += check_horovod(engine == "horovod", gpu, cfg.train.allow_host_allreduce)
    checks += check_torch_distributed(engine == "torch", gpu)
    checks += check_mpirun() + check_fonts() + check_run_folder(args.out or cfg.out)
    checks += check_memory_snapshots(cfg.checkpoint.memory_dir)
    if args.shards:
        checks += check_shards(args.shards, args.np, cfg)
    failed = [c for c in checks if c.status == FAIL]
    notes = sum(c.status == NOTE for c in checks)
    print(f"hvd-partialfc doctor: engine {engine} ({why})")
    print("\n".join(c.line() for c in checks))
    print(f"doctor: {len(failed)} missing requirement(s), {notes} note(s)" if failed
          else f"doctor: every requirement of the {engine} engine is met ({notes} note(s))", flush=True)
    return 1 if failed else 0


def add_arguments(p) -> None:
    p.add_argument("--engine", choices=["auto", "horovod", "torch"],
                   help="the engine to check for (default: the config's train.engine, auto)")
    p.add_argument("--out", help="the run folder to check (default: the config's out)")
    p.add_argument("--config", help="a training config: its engine, device, backbone, head and batch")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--shards", help="a shard set: its manifest; with --np, the layout and memory per rank")
    p.add_argument("--np", type=int, help="ranks to check the shard set against (with --shards)")
