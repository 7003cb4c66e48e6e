"""One config object: sectioned dataclasses, loaded from YAML, overridden by ``--set section.key=value``.

Plain data: validating it checks types, choices and ranges and imports nothing of the runtime. What names a
registered component (``model.name``, ``head.mode``, ``head.loss``, ``data.augment``) is checked when the
run's parts are built, against the registries, as an error agreed by every rank before the first step.
Unknown sections/keys and wrong types are errors (a typo never silently adds a key). The resolved
config is written into the run folder, and a checkpoint records it so resume can compare.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml



@dataclass
class DataConfig:
    shards: str = ""            # shard set directory (manifest.json + shard-*.h5)
    batch_size: int = 128       # per rank, per backward pass
    # DataLoader worker processes per rank (h5py is opened per worker); -1: the rank's cores minus one, at
    # most 8 (data/loader.py resolve_workers; one worker-core decodes ~3,200 faces/s with flip, docs/data.md)
    workers: int = 0
    verify_sha256: bool = False  # hash every shard file before training (slow on big sets)
    # training-time augmentation, applied in this order (hvd_partialfc/data/augment.py: flip, lowres, blur,
    # jitter, gray; "name" or "name:key=value,..."). Empty: glyph classes change under a flip; faces: [flip]
    augment: List[str] = field(default_factory=list)
    # where encoded JPEG shards are decoded: cpu (PIL in the loader's workers) | gpu (nvJPEG on the training
    # device, batched, flip there too; PNG, resized sets and CPU devices fall back to cpu: docs/gpu.md)
    decode: str = "cpu"
    # an encoded sample that cannot be decoded or is empty (a set built with --no-check, or damaged later):
    # stop (the run ends naming it) | skip (the next decodable sample of its class stands in, named once in
    # the log, counted in metrics.jsonl; data/bad_samples.py)
    on_bad_sample: str = "stop"
    # skip: the most distinct bad samples, over all ranks, before the run stops naming their shards (after
    # the step's checkpoint; checked at log steps): a count (>= 1) or a fraction (< 1) of the set's samples;
    # 0: no limit
    max_bad_samples: float = 0.001


@dataclass
class ModelConfig:
    name: str = "resnet"        # backbone registry name (models/)
    embedding_dim: int = 128
    kwargs: Dict[str, Any] = field(default_factory=dict)  # extra backbone arguments (width, blocks, ...)
    # recompute each block's activations in backward (less memory, ~1 more forward); same numbers, BatchNorm
    # statistics updated once (models/recompute.py). iresnet* and mobilefacenet only
    checkpoint_activations: bool = False
    # BatchNorm statistics over all ranks' batches together (syncbn.py): what one process on the global
    # batch computes, for small or class-homogeneous per-rank batches; two small blocking all-reduces per
    # layer per step (forward and backward: 158 for iresnet50; docs/gpu.md)
    sync_batchnorm: bool = False
    # start the backbone from this file (an exported backbone or arcface_torch's backbone.pth); applied
    # at a fresh start only, never over a checkpoint being resumed (pretrained.py)
    init_backbone: str = ""


@dataclass
class HeadConfig:
    loss: str = "arcface"       # softmax | cosface | arcface
    scale: float = 64.0         # s
    margin: float = 0.5         # m (radians for arcface, cosine for cosface)
    mode: str = "local"         # a registered mode (modes.py): local (the method) | global (exact model-parallel softmax) | replicated (DP)
    sample_rate: float = 1.0    # global, local: fraction of the slice's centres scored per step (PartialFC); 1 = all
    # local with sample_rate < 1, the classifier's step (rowsparse.py; docs/benchmarks.md has the choice):
    # exact: the sampled rows' cost, the dense step's numbers (SGD) | lazy: unsampled rows wait (PLSC's sparse
    # momentum; the only rule for AdamW) | dense: torch's step over every row (PartialFC v2's)
    sampled_step: str = "exact"
    # local mode: every K steps the ranks all-gather class centres, used as frozen negative columns
    # (cross-shard negatives, docs/accuracy.md; 0: off). global / replicated already contrast all classes
    # and do not use it. Defaults picked from the measurements there.
    negatives_every: int = 50
    negatives_share: int = 1024  # centres each rank shares per exchange, a random subset (0: its whole slice)
    # the most centres all N ranks share together per exchange: a rank shares min(negatives_share,
    # ceil(pool / N)), so what each rank receives (~pool rows) and holds stays constant as N grows instead of
    # growing with N (0: no cap). 8192 = 1,024 a rank at N=8, where the default was measured; iresnet50:
    # 0.11% of its gradient's traffic at any N (docs/accuracy.md, "At 64-256 ranks")
    negatives_pool: int = 8192
    # precision of the head's matrix products (run/speed.py): auto (tf32 on CUDA, fp32 elsewhere) | fp32 |
    # tf32 (CUDA's TF32 units; CPU: fp32) | bf16 (bf16 operands, float32 sums). The softmax's sums stay
    # float32 in every case (fp16 overflows past 65k columns). bf16's accuracy: docs/gpu.md
    matmul: str = "auto"


@dataclass
class OptimConfig:
    name: str = "sgd"           # sgd | adamw, for both optimizers
    backbone_lr: float = 0.1
    classifier_lr: float = 0.1
    backbone_momentum: float = 0.9
    classifier_momentum: float = 0.9
    backbone_weight_decay: float = 5e-4
    classifier_weight_decay: float = 5e-4
    schedule: str = "cosine"    # cosine | poly | constant (after warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0   # final lr / peak lr
    poly_power: float = 2.0
    clip_grad_norm: float = 0.0  # > 0: clip the *averaged* backbone gradient to this norm
    fp16_compression: bool = False   # Horovod fp16 compression of the backbone gradient allreduce
    backward_passes_per_step: int = 1  # gradient accumulation; one allreduce per optimizer step
    # local mode: the classifier's gradient is that of the mean loss over the *global* batch (scaled by
    # 1/N: what np=1 and `global` mode compute, so classifier_lr means the same at any world size) or
    # over the rank's own batch (N times larger at N ranks)
    classifier_grad_mean: str = "global"  # global | local


@dataclass
class TrainConfig:
    steps: int = 0              # optimizer steps; 0: epochs x (min over ranks of steps per epoch)
    epochs: float = 1.0
    seed: int = 0
    device: str = "auto"        # auto (a GPU if one is visible, else cpu) | cpu | cuda (docs/gpu.md: which GPU)
    # allow ranks to share a GPU (tests, debugging; the torch engine's collectives then run over Gloo, and a
    # Horovod built with NCCL fails); false: ranks on one GPU are an error at start-up (engine/device.py)
    share_gpu: bool = False
    precision: str = "fp32"     # fp32 | bf16 (autocast) | fp16 (autocast + agreed dynamic loss scale)
    # fp16: the loss scale doubles after this many finite steps in a row (halves at a non-finite one); 100 is
    # arcface_torch's GradScaler(growth_interval=100), torch's default is 2000; runs before 2026-12-01: 1000
    loss_scale_growth: int = 100
    log_every: int = 10
    on_nonfinite: str = "stop"  # stop | skip a step whose averaged backbone gradient is not finite
    threads: int = 0            # torch intra-op threads per rank (0: cores / ranks on the host, on CPU)
    # stop with an error after this many skipped steps in a row (fp16 loss-scale back-offs, on_nonfinite=
    # skip, or one rank's non-finite classifier gradient); 0: never stop
    max_consecutive_skips: int = 50
    tensorboard: bool = False   # also write metrics.jsonl's scalars as TensorBoard events in OUT/tensorboard
    engine: str = "auto"        # auto (torch under torchrun, else horovod) | horovod | torch (docs/engines.md)
    # a rank that hears nothing from its ring neighbour for this many seconds (a cut link, a lost node)
    # ends the job naming it, instead of waiting in a collective for Gloo's 30 minutes; 0: off
    heartbeat_timeout: float = 20.0
    cudnn_benchmark: bool = True   # CUDA: cuDNN picks its fastest convolution algorithms at the first step
    # CUDA: backbone and image batches in channels_last (NHWC) layout, for Tensor Cores under fp16 / bf16.
    # Also runs on CPU, where its numbers may differ from the default layout's in the last bits
    channels_last: bool = False
    # Horovod engine on CUDA with a Horovod built without NCCL: false stops at start-up (every gradient would
    # go GPU -> host -> Gloo/MPI -> GPU, several times slower); true goes on at that speed (docs/gpu.md)
    allow_host_allreduce: bool = False


@dataclass
class CheckpointConfig:
    every: int = 0              # steps between checkpoints (0: only at the end)
    keep: int = 2               # checkpoints kept (the final one always)
    resume: str = ""            # "" | auto | path of a checkpoint folder
    every_minutes: float = 0.0  # also checkpoint when this many minutes passed since the last one (0: off)
    allow_other_data: bool = False  # resume on other samples of the same classes and shard label ranges


@dataclass
class EvalConfig:
    pairs: List[str] = field(default_factory=list)  # verification sets (.h5 pair sets or LFW-style .bin)
    every: int = 0              # evaluate every K steps on rank 0 (0: only at the end, if pairs are given)
    flip: bool = False          # add the horizontal flip's embedding (faces: yes; glyphs: no)
    batch_size: int = 256
    on_error: str = "log"       # a failed evaluation (agreed): log (eval.jsonl, go on) | stop (after a checkpoint)


@dataclass
class Config:
    out: str = "runs/default"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "Config":
        choices = {("optim", "name"): ("sgd", "adamw"), ("optim", "schedule"): ("cosine", "poly", "constant"),
                   ("train", "device"): ("auto", "cpu", "cuda"), ("train", "precision"): ("fp32", "bf16", "fp16"),
                   ("train", "on_nonfinite"): ("stop", "skip"),
                   ("train", "engine"): ("auto", "horovod", "torch"),
                   ("head", "sampled_step"): ("exact", "lazy", "dense"),
                   ("head", "matmul"): ("auto", "fp32", "tf32", "bf16"),
                   ("optim", "classifier_grad_mean"): ("global", "local"), ("data", "decode"): ("cpu", "gpu"),
                   ("data", "on_bad_sample"): ("stop", "skip"),
                   ("eval", "on_error"): ("log", "stop")}
        for (sec, key), allowed in choices.items():
            v = getattr(getattr(self, sec), key)
            if v not in allowed:
                raise ConfigError(f"{sec}.{key}={v!r}: expected one of {', '.join(allowed)}")
        positive = [("data", "batch_size"), ("optim", "backward_passes_per_step"), ("train", "log_every"),
                    ("train", "loss_scale_growth")]
        for sec, key in positive:
            if getattr(getattr(self, sec), key) < 1:
                raise ConfigError(f"{sec}.{key} must be >= 1")
        if self.data.workers < -1:
            raise ConfigError(f"data.workers={self.data.workers}: expected >= 0, or -1 (the rank's cores minus one)")
        if self.data.max_bad_samples < 0:
            raise ConfigError(f"data.max_bad_samples={self.data.max_bad_samples}: expected a count (>= 1), a "
                              f"fraction of the set's samples (< 1), or 0 (no limit)")
        if not self.data.shards:
            raise ConfigError("data.shards is required (a shard set directory)")
        if not 0.0 < self.head.sample_rate <= 1.0:
            raise ConfigError(f"head.sample_rate={self.head.sample_rate}: expected 0 < rate <= 1")
        if min(self.head.negatives_every, self.head.negatives_share, self.head.negatives_pool) < 0:
            raise ConfigError("head.negatives_every, head.negatives_share and head.negatives_pool must be >= 0")
        if self.model.sync_batchnorm and self.model.checkpoint_activations:
            raise ConfigError("model.sync_batchnorm and model.checkpoint_activations together: the recomputed "
                              "forward would repeat every layer's collective; choose one")
        if self.train.max_consecutive_skips < 0 or self.checkpoint.every_minutes < 0:
            raise ConfigError("train.max_consecutive_skips and checkpoint.every_minutes must be >= 0")
        if self.train.heartbeat_timeout < 0:
            raise ConfigError("train.heartbeat_timeout must be >= 0 (0: off)")
        if self.train.steps < 0 or self.train.epochs <= 0:
            raise ConfigError("train.steps must be >= 0 and train.epochs > 0")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _check_type(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return value
    if origin in (list, List, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return list(value)
    if origin is typing.Union:  # Optional[...]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _check_type(path, value, args[0])
    if tp is Any:
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(obj: Any, updates: Dict[str, Any], prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(obj))
            raise ConfigError(f"unknown config key {path!r}; known here: {known}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
            _merge(current, value, path + ".")
        else:
            setattr(obj, key, _check_type(path, value, hints[key]))


def parse_override(text: str) -> Dict[str, Any]:
    """'optim.backbone_lr=0.05' -> {'optim': {'backbone_lr': 0.05}} (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    out: Dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                extra: Optional[Dict[str, Any]] = None) -> Config:
    """Defaults <- YAML file <- ``extra`` (CLI shortcuts) <- ``--set`` overrides, then validated."""
    cfg = Config()
    if path:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections")
        _merge(cfg, data)
    if extra:
        _merge(cfg, extra)
    for o in overrides:
        _merge(cfg, parse_override(o))
    return cfg.validate()


def config_from_dict(d: Dict[str, Any]) -> Config:
    cfg = Config()
    _merge(cfg, d)
    return cfg


def dump_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


def diff_configs(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two config dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_configs(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} != {vb!r}")
    return out
