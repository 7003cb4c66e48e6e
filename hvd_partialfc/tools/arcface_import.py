"""``hvd-partialfc import-arcface RUN_DIR --shards SHARDS --out OUT``: an arcface_torch run's per-rank files
(``checkpoint_gpu_{rank}.pt``) written as a checkpoint of this package, which ``--resume`` takes at any
world size (docs/migrate.md).

What arcface_torch's ``train_v2.py`` saves in each rank's file (published format facts, read here):
``epoch``, ``global_step``, ``state_dict_backbone`` (the backbone's state_dict), ``state_dict_softmax_fc``
(Partial FC v2's ``weight``: this rank's classifier rows, (rows, D)), ``state_optimizer`` (ONE optimizer over
two parameter groups: the backbone's parameters, then the classifier's weight) and ``state_lr_scheduler``.
Partial FC v2 gives rank r of W the classes ``C // W * r + min(r, C % W)`` on, ``C // W + (r < C % W)`` of
them: this package's even split (``RankLayout.even``), so the checkpoint keeps those slices and a resume
re-cuts them for its own layout (run/ckpt/reshard.py), at any world size.

The step and the schedule: arcface_torch adds 1 to ``global_step`` and steps its lr scheduler at every
batch, and its optimizer every ``gradient_acc`` batches (the config's ``optim.backward_passes_per_step``), so
the run has taken ``global_step // gradient_acc`` optimizer steps of ``batch_size x gradient_acc x W``
samples (a partial accumulation at the save was never applied). Its lr schedule is read from
``state_lr_scheduler`` (total, warm-up and power, today's ``PolynomialLRWarmup`` or the older
``PolyScheduler`` with power 2) and goes on as it would have (progress.ImportedSchedule); the config's keys
must say the same (``optim.schedule`` poly, ``optim.poly_power``, ``optim.warmup_steps`` in optimizer steps,
the peak lrs, and a length that ends at the scheduler's total), or the import refuses with the key to set.
Its step's gradient is the sum of its ``gradient_acc`` batches' (each loss backpropagated undivided): at
``gradient_acc`` > 1 the config must say ``optim.accumulate: sum`` (``config --from-arcface`` writes it).

The labels: a shard set built from the run's ``.rec`` (``hvd-partialfc-shards build recordio``) names its
classes by the original integer labels, in numeric order: a ``.rec`` of labels 0 ... C-1 keeps every label
as it is, and row l of the run is class l here. The import checks that from the manifest's class names.

The optimizer: SGD's momentum, or AdamW's moments and step count (arcface_torch's ViT recipes), of every
backbone parameter and of the rows; the config's ``optim.name`` and, for AdamW, beta1 (``optim.*_momentum``)
must be the run's, beta2 and eps torch's defaults. PartialFC v2 steps every row each step (zero gradients for
the unsampled ones), so every row has the run's step count; a sampled ``local`` head's per-row count starts there.

Memory: one rank file at a time (its backbone copy, its rows and their optimizer state) beside the first rank's
backbone and one slice being written, so a 2M-class run imports in the memory of a few slices.

Not carried (said in the summary): the GradScaler's loss scale (not in the files: an fp16 run starts its
scale afresh), the random streams (the resume re-seeds them).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List

import torch

from .. import atomic
from ..data.layout import RankLayout
from ..data.shards import read_manifest
from ..digest import state_dict_digest
from ..engine.local import LocalComm
from ..models.pretrained import key_mismatch
from ..run import progress
from ..run.parts import build_parts
from ..run.startup import run_info_of
from ..run_files import CHECKPOINTS, FORMAT, FORMAT_VERSION, LATEST, classifier_file, load_file, step_dir_name
from .arcface_config import is_number, optimizer_steps

RANK_FILE = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
KEYS = ("epoch", "global_step", "state_dict_backbone", "state_dict_softmax_fc", "state_optimizer",
        "state_lr_scheduler")
# an unreadable rank file is the copy's fault, not the run's: there is no earlier checkpoint to go back to
COPY_AGAIN = "copy it again from the arcface_torch run's output folder, as its train_v2.py wrote it"
# the lr scheduler's state: today's PolynomialLRWarmup's keys, then the older PolyScheduler's
SCHEDULER_KEYS = (("total_iters", "warmup_iters"), ("max_steps", "warmup_steps"))


class ArcfaceImportError(ValueError):
    """A source that cannot be imported; the message names the file and what is wrong (one line)."""


def rank_files(run_dir: str) -> List[str]:
    """``checkpoint_gpu_0.pt`` ... ``checkpoint_gpu_{W-1}.pt`` of ``run_dir``; a missing one is an error."""
    found = {int(m.group(1)): os.path.join(run_dir, name) for name in sorted(os.listdir(run_dir))
             if (m := RANK_FILE.match(name))} if os.path.isdir(run_dir) else {}
    if not found:
        raise ArcfaceImportError(f"{run_dir}: no checkpoint_gpu_<rank>.pt (arcface_torch writes them with "
                                 "save_all_states = True)")
    world = max(found) + 1
    missing = [r for r in range(world) if r not in found]
    if missing:
        raise ArcfaceImportError(f"{run_dir}: missing checkpoint_gpu_{missing[0]}.pt ({len(missing)} of "
                                 f"{world} rank files missing)")
    return [found[r] for r in range(world)]


def _read(path: str) -> Dict[str, Any]:
    try:
        obj = load_file(path, "arcface_torch rank file", fix=COPY_AGAIN)
    except Exception as e:  # CheckpointError: unreadable, truncated, or holding code
        raise ArcfaceImportError(str(e)) from None
    missing = [k for k in KEYS if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise ArcfaceImportError(f"{path}: not an arcface_torch rank file (no {', '.join(missing)})")
    weight = obj["state_dict_softmax_fc"].get("weight")
    if not torch.is_tensor(weight) or weight.dim() != 2:
        raise ArcfaceImportError(f"{path}: state_dict_softmax_fc has no (rows, D) weight")
    return obj


def check_labels(class_names: List[str]) -> None:
    """A shard set built from the run's .rec names its classes by the original integer labels in numeric
    order: label l here is arcface_torch's label l. Anything else is another set of classes."""
    if list(class_names) != [str(i) for i in range(len(class_names))]:
        raise ArcfaceImportError(f"the shard set's class names are not the labels 0 ... {len(class_names) - 1} "
                                 "in order: build it from the run's .rec (hvd-partialfc-shards build recordio), "
                                 "whose labels it keeps")


# each optimizer's per-parameter state that maps: SGD's momentum, AdamW's moments and its count of steps
STATE_KEYS = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq", "step")}


def _optimizer_state(path: str, obj: Dict[str, Any], backbone_names: List[str], cfg) -> Dict[str, Any]:
    """The optimizer state of each backbone parameter (by name) and of the rows (``STATE_KEYS``' tensors; AdamW's
    ``step`` as a float32 tensor), from the one optimizer's two parameter groups (backbone parameters in
    registration order, then the classifier weight). Its kind and AdamW's betas and eps must be the config's."""
    opt, rows = obj["state_optimizer"], obj["state_dict_softmax_fc"]["weight"]
    groups = opt.get("param_groups", [])
    if len(groups) != 2 or len(groups[1].get("params", [])) != 1:
        raise ArcfaceImportError(f"{path}: the optimizer has {len(groups)} parameter groups; arcface_torch's has "
                                 "2 (the backbone's parameters, then the classifier's weight)")
    kind = "adamw" if "betas" in groups[0] else "sgd" if "momentum" in groups[0] else None
    if kind is None:
        raise ArcfaceImportError(f"{path}: not arcface_torch's SGD or AdamW (its parameter groups have neither "
                                 "momentum nor betas)")
    if kind != cfg.optim.name:
        _refuse(path, f"its optimizer is {kind}, the config's optim.name {cfg.optim.name}: set optim.name={kind}")
    if kind == "adamw":
        for g, key in zip(groups, ("backbone_momentum", "classifier_momentum")):
            b1, b2 = (float(b) for b in g["betas"])
            if b1 != getattr(cfg.optim, key):
                _refuse(path, f"its AdamW's beta1 is {b1:g}, the config's optim.{key} {getattr(cfg.optim, key):g}: "
                              f"set optim.{key}={b1:g}")
            if b2 != 0.999 or float(g.get("eps", 1e-8)) != 1e-8 or g.get("amsgrad"):
                raise ArcfaceImportError(f"{path}: its AdamW has beta2 {b2:g}, eps {g.get('eps')}, amsgrad "
                                         f"{g.get('amsgrad')}; this package's is torch's 0.999, 1e-8, no amsgrad")
    ids = list(groups[0]["params"])
    if len(ids) != len(backbone_names):
        raise ArcfaceImportError(f"{path}: the optimizer's backbone group holds {len(ids)} parameters, the "
                                 f"backbone {len(backbone_names)}")
    state = opt.get("state", {})

    def entry(i):
        got = {k: v for k, v in state.get(i, {}).items() if k in STATE_KEYS[kind]}
        if "step" in got:          # a tensor since torch 1.12, a number before
            got["step"] = torch.as_tensor(got["step"], dtype=torch.float32).reshape(())
        return got
    out = {name: e for i, name in zip(ids, backbone_names) if (e := entry(i))}
    row_state = entry(groups[1]["params"][0]) or None
    for key, t in (row_state or {}).items():
        if key != "step" and tuple(t.shape) != tuple(rows.shape):
            raise ArcfaceImportError(f"{path}: the classifier's {key} is {tuple(t.shape)}, its weight "
                                     f"{tuple(rows.shape)}")
    return {"backbone": out, "rows": row_state}


def import_arcface(run_dir: str, cfg, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Write ``cfg.out``'s first checkpoint from the arcface_torch run ``run_dir`` (see the module's
    docstring); its summary. Nothing is written when a check fails."""
    files = rank_files(run_dir)
    world = len(files)
    manifest, out_base = _check_target(cfg)
    classes = manifest.num_classes
    layout = RankLayout.even(classes, world)
    made = [d for d in (cfg.out, out_base) if not os.path.isdir(d)]

    t0, first = time.time(), _read(files[0])
    global_step, epoch = int(first["global_step"]), int(first["epoch"])
    step = global_step // cfg.optim.backward_passes_per_step      # optimizer steps (arcface counts batches)
    length = _length(cfg, world, first, files[0], step)
    _check_accumulation(cfg, files[0])
    comm0 = LocalComm(0, world)
    parts = build_parts(cfg, comm0, layout, list(manifest.sample_shape), torch.device("cpu"))
    names = [n for n, _ in parts.backbone.named_parameters()]
    _load_backbone(parts, first, files[0], names, cfg)
    digest = state_dict_digest(parts.backbone.state_dict())      # backbone.pt's: rank 0's parameters and buffers
    same_run = _params_digest(first, names)
    params = dict(parts.backbone.named_parameters())
    base = parts.training_state(layout, 0)
    run_info = run_info_of(cfg, manifest)
    partial = os.path.join(out_base, step_dir_name(step) + ".partial")
    os.makedirs(partial, exist_ok=True)
    try:
        for r in range(world):
            obj = first if r == 0 else _read(files[r])
            first = None                                # rank 0's file goes once its rows are written
            _check_same_run(files[r], obj, global_step, same_run, names)
            state = _rank_state(cfg, parts, base, layout, r, world, obj, files[r], names)
            own = {k: v for k, v in obj["state_dict_backbone"].items() if k not in params}   # its BatchNorm
            atomic.torch_save(state.rank_file(digest, own), os.path.join(partial, classifier_file(r, world)))
            del obj, state, own
        atomic.torch_save(base.backbone_file(), os.path.join(partial, "backbone.pt"))
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                "total_steps": length.total_steps, "length": length.record(step), "world_size": world,
                "slices": layout.bounds(), "classifier_files": [classifier_file(r, world) for r in range(world)],
                "model": base.model_args, "replicated": False, **run_info, **base.counters,
                "digests": [digest] * world, "identical": True, "time": time.time(),
                "imported_from": {"arcface_torch": run_dir, "epoch": epoch, "global_step": global_step,
                                  "gradient_acc": cfg.optim.backward_passes_per_step, "ranks": world}}
        atomic.write_text(os.path.join(partial, "meta.json"), json.dumps(meta, indent=1))
        atomic.commit_folder(partial, os.path.join(out_base, step_dir_name(step)))
        atomic.write_text(os.path.join(out_base, LATEST), step_dir_name(step) + "\n")
    except BaseException:
        _remove_partial(partial, made)
        raise
    summary = {"out": cfg.out, "checkpoint": os.path.join(out_base, step_dir_name(step)), "step": step,
               "global_step": global_step, "epoch": epoch, "ranks": world, "classes": classes,
               "samples_consumed": length.samples_at(step), "budget_samples": length.budget,
               "seconds": round(time.time() - t0, 2)}
    log(f"imported {world} rank files of {run_dir}: step {step} (global_step {global_step} at gradient_acc "
        f"{cfg.optim.backward_passes_per_step}, epoch {epoch}), {classes:,} classes, its lr schedule with it; "
        f"resume with --resume auto --out {cfg.out} at any world size")
    return summary


def _check_target(cfg):
    """The shard set's manifest and the checkpoint folder to write, after the checks that need no rank file:
    labels an arcface_torch run can have trained on, a sliced classifier mode, a new run folder."""
    manifest = read_manifest(cfg.data.shards)
    check_labels(manifest.class_names)
    if cfg.head.mode not in ("local", "global"):
        raise ArcfaceImportError(f"head.mode={cfg.head.mode}: import into local or global (a slice of the "
                                 "classifier a rank, as Partial FC's)")
    out_base = os.path.join(cfg.out, CHECKPOINTS)
    if os.path.isdir(out_base) and os.listdir(out_base):
        raise ArcfaceImportError(f"{out_base} is not empty: import into a new run folder")
    return manifest, out_base


def _load_backbone(parts, first: Dict[str, Any], path: str, names: List[str], cfg) -> None:
    """Rank 0's backbone and its optimizer state into ``parts`` (every rank's parameters are equal; its
    BatchNorm statistics are not and go into its own rank file), refusing a backbone or a state that does not
    fit this config's model."""
    problems = key_mismatch(parts.backbone, first["state_dict_backbone"])
    if problems:
        raise ArcfaceImportError(f"{path}: its backbone does not fit model.name={cfg.model.name} "
                                 f"(embedding_dim {cfg.model.embedding_dim}): " + "; ".join(problems))
    parts.backbone.load_state_dict(first["state_dict_backbone"], strict=True)
    params = dict(parts.backbone.named_parameters())
    opt = parts.backbone_opt
    for name, entry in _optimizer_state(path, first, names, cfg)["backbone"].items():
        for key, t in entry.items():
            if key != "step" and tuple(t.shape) != tuple(params[name].shape):
                raise ArcfaceImportError(f"{path}: the optimizer's {key} of {name} is {tuple(t.shape)}, the "
                                         f"parameter {tuple(params[name].shape)}")
        opt.state[params[name]].update({k: t.clone() for k, t in entry.items()})


def _remove_partial(partial: str, made: List[str]) -> None:
    """After a failed import nothing written stays: the partial folder, and the folders made for it."""
    shutil.rmtree(partial, ignore_errors=True)
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass


def _params_digest(obj: Dict[str, Any], names: List[str]) -> str:
    """The backbone's parameters' digest (DDP keeps them equal; each rank's BatchNorm statistics are its
    own: arcface_torch does not broadcast buffers)."""
    sd = obj["state_dict_backbone"]
    return state_dict_digest({n: sd[n] for n in names if n in sd})


def _check_same_run(path: str, obj: Dict[str, Any], step: int, digest: str, names: List[str]) -> None:
    if int(obj["global_step"]) != step:
        raise ArcfaceImportError(f"{path}: global_step {obj['global_step']}, rank 0's {step}: the rank files "
                                 "are not of one checkpoint")
    mine = _params_digest(obj, names)
    if mine != digest:
        raise ArcfaceImportError(f"{path}: its backbone's parameters differ from rank 0's ({mine[:12]} != "
                                 f"{digest[:12]}): the rank files are not of one checkpoint")


def _rank_state(cfg, parts, base, layout, r: int, world: int, obj, path: str, names):
    """Rank r's TrainingState: a head of rank r's slice holding arcface rank r's rows and their optimizer state."""
    sl = layout.slices[r]
    head = parts.mode.create_head(cfg, layout, r, LocalComm(r, world))
    head_opt = parts.mode.classifier_optimizer(head, cfg)
    rows = obj["state_dict_softmax_fc"]["weight"]
    if rows.shape[0] != sl.width or rows.shape[1] != cfg.model.embedding_dim:
        raise ArcfaceImportError(f"{path}: rows {tuple(rows.shape)}, where rank {r} of {world} of Partial FC v2 "
                                 f"over the shard set's {layout.num_classes:,} classes holds ({sl.width}, "
                                 f"{cfg.model.embedding_dim}): the run's class count or embedding size differs "
                                 "from this one's, or its rows do not tile the classes")
    row_state = _optimizer_state(path, obj, names, cfg)["rows"]
    with torch.no_grad():
        head.weight.copy_(rows)
    if row_state is not None:
        row_state = {k: t.clone() for k, t in row_state.items()}
        if "step" in row_state and not isinstance(head_opt, torch.optim.AdamW):   # sampled rows: a count a row
            row_state["step"] = row_state["step"].expand(rows.shape[0]).clone()  # (each had every dense step)
        head_opt.state[head.weight].update(row_state)
    return replace(base, head=head, head_opt=head_opt, label_slice=(sl.start, sl.end), rank=r)


def _scheduler(path: str, obj: Dict[str, Any]) -> Dict[str, Any]:
    """The run's lr schedule from its scheduler's state: total and warm-up in batches (the scheduler steps
    once a batch), power, the peak lr of each group, and ``last_epoch`` (today's ends a run of G batches at
    G, the older one at G - 1)."""
    s = obj["state_lr_scheduler"]
    for total, warmup in SCHEDULER_KEYS:
        if isinstance(s, dict) and all(is_number(s.get(k)) for k in (total, warmup, "power", "last_epoch")):
            lrs = s.get("base_lrs") or [s.get("base_lr")] * 2
            if len(lrs) != 2 or not all(is_number(x) for x in lrs):
                break
            return {"total": s[total], "warmup": s[warmup], "power": float(s["power"]),
                    "lrs": [float(x) for x in lrs], "last_epoch": int(s["last_epoch"])}
    raise ArcfaceImportError(f"{path}: state_lr_scheduler is not arcface_torch's poly schedule (total_iters, "
                             "warmup_iters, power and base_lrs, or the older max_steps, warmup_steps, power)")


def _length(cfg, world: int, obj: Dict[str, Any], path: str, step: int) -> progress.RunLength:
    """The run's length and lr schedule as arcface_torch's W ranks trained it: steps of ``batch_size x
    gradient_acc x W`` samples, an epoch of the batches its loader gave each rank (global_step / epoch: it
    saves at each epoch's end), the schedule of its scheduler's state. Refused, with the key to set, where the
    config says otherwise: the resume would follow the config's keys."""
    sched, o = _scheduler(path, obj), cfg.optim
    acc, batch = o.backward_passes_per_step, cfg.data.batch_size * world   # a batch on every rank
    unit, global_step, epochs = batch * acc, int(obj["global_step"]), int(obj["epoch"])
    per_epoch = max(1, global_step // epochs if epochs > 0 else global_step)
    total, warmup, power = sched["total"], sched["warmup"], sched["power"]
    # the optimizer step after `samples` takes the lr of its last batch's scheduler step: the scheduler is at
    # last_epoch after global_step batches, and steps once a batch
    schedule = progress.ImportedSchedule(batch, acc - 1 + sched["last_epoch"] - global_step, warmup, total, power)
    steps = int(total // acc)                   # its optimizer steps in `total` batches
    record = {"budget_samples": steps * unit, "samples": step * unit, "samples_per_schedule_step": unit,
              "epoch_samples": per_epoch * batch, "segments": [progress.Segment(0, 0, world, unit).as_dict()],
              "lr_schedule": schedule.as_dict()}
    length = progress.plan(cfg, world, per_epoch // acc, step, record)
    at = f"optimizer steps at gradient_acc {acc}"
    if o.schedule != "poly" or o.min_lr_ratio != 0:
        _refuse(path, f"its lr scheduler is a poly schedule to 0, the config's optim.schedule {o.schedule} with "
                      f"optim.min_lr_ratio {o.min_lr_ratio:g}: set optim.schedule=poly and optim.min_lr_ratio=0")
    if power != o.poly_power:
        _refuse(path, f"its lr scheduler's power is {power}, the config's optim.poly_power {o.poly_power}: set "
                      f"optim.poly_power={power} (older arcface_torch used 2)")
    if optimizer_steps(warmup, acc) != o.warmup_steps:
        _refuse(path, f"its lr scheduler warms up over {warmup:g} batches ({optimizer_steps(warmup, acc)} {at}), "
                      f"the config's optim.warmup_steps {o.warmup_steps}: set optim.warmup_steps="
                      f"{optimizer_steps(warmup, acc)}")
    if sched["lrs"] != [o.backbone_lr, o.classifier_lr]:
        _refuse(path, f"its peak lrs are {sched['lrs'][0]:g} (backbone) and {sched['lrs'][1]:g} (classifier), the "
                      f"config's optim.backbone_lr {o.backbone_lr:g} and optim.classifier_lr {o.classifier_lr:g}: "
                      "set them to the run's")
    if length.budget != steps * unit:
        how = f"train.steps={cfg.train.steps}" if cfg.train.steps else \
            f"train.epochs={cfg.train.epochs:g} x {per_epoch // acc} steps an epoch"
        _refuse(path, f"its lr scheduler runs {total:g} batches ({steps} {at}), the config {length.budget // unit} "
                      f"steps ({how}): set train.steps={steps}")
    return length


def _check_accumulation(cfg, path: str) -> None:
    """train_v2.py backpropagates each of its ``gradient_acc`` batches' losses undivided, so its step's gradient
    is their sum: the resume must sum them too (``optim.accumulate``), or it would step 1/k as far."""
    k = cfg.optim.backward_passes_per_step
    if k > 1 and cfg.optim.accumulate != "sum":
        _refuse(path, f"train_v2.py sums the gradients of its gradient_acc {k} batches, the config's "
                      f"optim.accumulate {cfg.optim.accumulate} would take 1/{k} of them: set optim.accumulate=sum")


def _refuse(path: str, what: str) -> None:
    raise ArcfaceImportError(f"{path}: {what}, and import again")


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="the arcface_torch run's output folder (its checkpoint_gpu_<rank>.pt files)")
    p.add_argument("--shards", required=True, help="the shard set built from the run's .rec (= data.shards)")
    p.add_argument("--out", required=True, help="a new run folder: its first checkpoint is the import")
    p.add_argument("--config", help="this package's YAML for the run (hvd-partialfc config --from-arcface "
                                    "writes it): the resume must give the same")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")


def run(args) -> int:
    from ..config_io import load_config
    cfg = load_config(args.config, args.set or [], {"data": {"shards": args.shards}, "out": args.out})
    print(json.dumps(import_arcface(args.run_dir, cfg, log=lambda m: print(m, file=sys.stderr))))
    return 0
