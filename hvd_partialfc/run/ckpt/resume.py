"""Resume: find the checkpoint, agree on it across ranks, check that it continues this run, restore it.

Compatible means: the same data (``check_data``) and the same config up to the keys that do not change the
numbers (``RESUME_FREE_KEYS``) or that extend the run (``RESUME_EXTEND_KEYS``: the lr schedule is then
recomputed, and resume says so). The restore itself is ``checkpoint.load``: the parts' state, bitwise at
the same world size; at another, the classifier rows re-sharded and the random streams re-seeded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from . import checkpoint as ckpt
from ...run_files import find_resume, read_meta, resolve_checkpoint
from .checkpoint_files import agree_on_resume
from ...config import ConfigError, resume_policy
from ...config_io import config_from_dict, diff_configs
from ...data import class_identity
from ...classifier.modes import get_mode
from ...seeds import RESHARD_RESEED, derive_seed

# Config keys that may change between a checkpoint and its resume (they do not change the numbers), and keys
# that may change to *extend* a run (the lr schedule is then recomputed; resume says so): each declared, with
# why, beside the key in config.py (``opt(..., resume="free" | "extend")``, ``section(..., resume="free")``).
RESUME_FREE_KEYS, RESUME_EXTEND_KEYS = resume_policy()


@dataclass(frozen=True)
class DataIdentity:
    """What resume compares of the shard set: its data digest (``shards.data_digest``), its manifest's
    bytes (checkpoints written before the data digest existed), its class count and shards' label ranges,
    and which classes they are (``class_identity.of_run``; compared when the samples may differ)."""

    data_sha256: str
    manifest_sha256: str
    num_classes: int
    shard_slices: tuple
    classes: Dict[str, Any] = field(default_factory=dict)


def saved_config(d: Dict[str, Any], world_size: int, imported: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A config dict saved by an earlier version (a checkpoint's, written at ``world_size`` ranks; ``imported``:
    its ``imported_from``), completed with what it meant: keys added since take their defaults (they did not
    exist, so the run had the default's behaviour), except where a new default changed the numbers:

    * ``head.sampled_step``: a sampled run of a mode with the row-sparse step (``local``) from before it existed ran the ``lazy`` rule;
    * ``head.negatives_pool``: before it, nothing capped the share, which the default cap leaves unchanged
      only while N x share <= the pool (N=8 at the old defaults); otherwise the run had no cap (0);
    * ``train.loss_scale_growth``: an fp16 run from before it doubled its loss scale every 1,000 steps;
    * ``optim.accumulate``: an arcface_torch import at gradient_acc > 1 (the import's own checkpoint, no step
      taken here yet) goes on as arcface_torch would, with the sum, so a config that says mean is refused.

    Resume compares this against the current config, so upgrading the package never refuses to resume a
    run whose settings did not change, and refuses one whose numbers would."""
    head, train = d.get("head", {}), d.get("train", {})
    full = config_from_dict(d).to_dict()
    h = full["head"]
    mode = get_mode(h["mode"])
    if "sampled_step" not in head and mode.row_sparse_step and h["sample_rate"] < 1.0:
        h["sampled_step"] = "lazy"
    if "negatives_pool" not in head and mode.negatives and h["negatives_every"] > 0 \
            and (h["negatives_share"] == 0 or h["negatives_share"] * world_size > h["negatives_pool"]):
        h["negatives_pool"] = 0
    if "loss_scale_growth" not in train and full["train"]["precision"] == "fp16":
        full["train"]["loss_scale_growth"] = 1000
    if "accumulate" not in d.get("optim", {}) and (imported or {}).get("gradient_acc", 1) > 1:
        full["optim"]["accumulate"] = "sum"
    return full


def check_config(meta: Dict[str, Any], cfg, log) -> None:
    """Raise ValueError unless ``cfg`` continues the checkpoint's config (``meta``)."""
    diffs = [d for d in diff_configs(saved_config(meta["config"], meta["world_size"], meta.get("imported_from")),
                                     cfg.to_dict())
             if not any(d.startswith(k + ".") or d.startswith(k + ":") for k in RESUME_FREE_KEYS)]
    extended = [d for d in diffs if any(d.startswith(k + ":") for k in RESUME_EXTEND_KEYS)]
    diffs = [d for d in diffs if d not in extended]
    if extended:
        log(f"resume: {'; '.join(extended)}: the run is extended, its lr schedule recomputed")
    if diffs:
        raise ValueError("incompatible config (field: checkpoint != now): " + "; ".join(diffs))


def check_data(meta: Dict[str, Any], data: DataIdentity, allow_other_data: bool, log) -> None:
    """Resume continues on the data the checkpoint trained on: the same `data_digest` (what the shard set
    holds; where it was built from may differ). Checkpoints written before it was recorded are compared
    by their manifest's bytes. Other samples on the same classes and shard label ranges are allowed with
    ``checkpoint.allow_other_data`` (cleaned or re-augmented data); other classes or ranges never are:
    a rank's classifier rows would then belong to other classes. "The same classes" is the class count,
    the label ranges and, where both record it, ``class_identity.compare``: the names, or where they are
    only numbers, the per-class counts and first samples. What cannot be checked (a checkpoint or set from
    before the identity was recorded) is said, and the run goes on as before."""
    key = "data_sha256" if "data_sha256" in meta else "manifest_sha256"
    now = data.data_sha256 if key == "data_sha256" else data.manifest_sha256
    if meta[key] == now:
        return
    what = f"the shard set differs from the checkpoint's ({key.split('_')[0]} sha256 {meta[key][:12]} != {now[:12]})"
    slices = [list(s) for s in data.shard_slices]
    if meta["num_classes"] != data.num_classes or meta["shard_slices"] != slices:
        raise ValueError(f"{what}, and so do its classes or shards' label ranges (classes "
                         f"{meta['num_classes']} != {data.num_classes}, {len(meta['shard_slices'])} "
                         f"!= {len(slices)} shards): the classifiers' rows would name other classes")
    differ, unknown, cleaned = class_identity.compare(meta.get("class_identity", {}), data.classes)
    if differ:
        named = " (its class names are the labels 0 ... C-1, which name no class: counts and samples decide)" \
            if data.classes.get("numeric_names") else ""
        raise ValueError(f"{what}, and so do {' and '.join(differ)}{named}: the classifiers' rows would name "
                         "other classes (checkpoint.allow_other_data cannot change that)")
    if not allow_other_data:
        raise ValueError(f"{what}; its classes and shards' label ranges are the same: to go on with "
                         "other samples, resume with checkpoint.allow_other_data=true")
    if unknown:
        log(f"resume: warning: which classes the labels stand for cannot be checked: {'; '.join(unknown)}")
    also = f" ({' and '.join(cleaned)} differ: a cleaned set)" if cleaned else ""
    log(f"resume: {what}: going on with these samples{also} (checkpoint.allow_other_data)")


def load_into(path: str, cfg, comm, parts, layout, data: DataIdentity) -> Dict[str, Any]:
    """Check that ``path`` continues this run, then restore it into ``parts``; the resume point."""
    log = (lambda m: print(m, flush=True)) if comm.is_main else (lambda m: None)
    meta = read_meta(path)
    check_data(meta, data, cfg.checkpoint.allow_other_data, log)
    check_config(meta, cfg, log)
    state = parts.training_state(layout, comm.rank)
    meta = ckpt.load(path, state)
    parts.restore_counters(state.counters)
    if not meta["rng_restored"]:  # another world size: streams cannot be mapped, re-seed them
        torch.manual_seed(derive_seed(cfg.train.seed, comm.rank, meta["step"], RESHARD_RESEED))
    return {"path": path, "step": meta["step"], "world_size": meta["world_size"], "meta": meta,
            "own_buffers": meta.pop("own_buffers", None)}


def restarts_of(environ: Mapping[str, str]) -> Optional[str]:
    """The launcher that may restart this process's job, in words (torchrun with ``--max-restarts`` > 0, a
    torchrun worker already restarted, launch/horovod_restarts.py, horovodrun's elastic mode), else None."""
    for var, what in (("TORCHELASTIC_MAX_RESTARTS", "torchrun --max-restarts {}"),
                      ("TORCHELASTIC_RESTART_COUNT", "torchrun (this worker is restart {})")):
        value = environ.get(var, "0")
        if value.isdigit() and int(value) > 0:
            return what.format(value)
    if "HVD_PARTIALFC_RESTART_COUNT" in environ:
        return "launch/horovod_restarts.py"
    if environ.get("HOROVOD_ELASTIC") == "1":   # the survivors resume in their processes; a newcomer starts
        return "horovodrun's elastic mode"
    return None


def check_restarts_resume(resume_from: str, environ: Mapping[str, str]) -> None:
    """ConfigError unless a job that its launcher may restart resumes its latest checkpoint
    (``checkpoint.resume: auto``). Otherwise a restart starts again from ``checkpoint.resume`` (step 0 when
    unset) and sets every newer checkpoint of the run aside: the run loses everything since it began. Checked
    at start-up, the first attempt included, so the mistake costs seconds, not a restart's progress."""
    launcher = restarts_of(environ)
    if launcher and resume_from != "auto":
        what = f"checkpoint.resume={resume_from}" if resume_from else "checkpoint.resume unset"
        raise ConfigError(f"{what} under {launcher}: a restart would start again from "
                          f"{resume_from or 'step 0'} and set the run's newer checkpoints aside; use --resume auto "
                          "(a fresh start the first time, the run's latest checkpoint at every restart)")


def resume(cfg, comm, parts, layout, data: DataIdentity, memory=None) -> Optional[Dict[str, Any]]:
    """Find the checkpoint named by checkpoint.resume ('auto': the run's latest, if any, or the newer snapshot
    that node memory offers, ``memory.newest``: snapshots/node_memory.py), agree on it across ranks, and load it;
    the resume point (path, step, world size, ``memory``: whether node memory gave it), or None for a fresh
    start. A collective: each stage is agreed, so a rank's error stops every rank. Nothing is called back: what
    an offer leaves on the nodes is the snapshots' own to tidy."""
    error, path = None, None
    try:
        path = find_resume(cfg.out) if cfg.checkpoint.resume == "auto" \
            else resolve_checkpoint(cfg.checkpoint.resume)
    except Exception as e:
        error = f"cannot resume from {cfg.checkpoint.resume} (run {cfg.out}): {type(e).__name__}: {e}"
    comm.agree(error, name="resume.find")
    offer = None
    if memory is not None and cfg.checkpoint.resume == "auto":
        offer = memory.newest(path, [(s.start, s.end) for s in layout.slices], parts.mode.replicated_rows,
                              log=lambda m: comm.is_main and print(m, flush=True))
    point = _load_agreed(cfg, comm, parts, layout, data, offer.path if offer else path)
    if point is not None and offer is not None:
        point.update(path=f"the memory snapshot of step {offer.step}", memory=True)
    return point


def _load_agreed(cfg, comm, parts, layout, data: DataIdentity, path: Optional[str]) -> Optional[Dict[str, Any]]:
    path = agree_on_resume(comm, path)
    error, point = None, None
    try:
        if path:
            point = load_into(path, cfg, comm, parts, layout, data)
    except Exception as e:
        error = f"cannot resume from {path}: {type(e).__name__}: {e}"
    comm.agree(error, name="resume")
    return point
