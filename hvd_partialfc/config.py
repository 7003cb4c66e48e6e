"""One config object: sectioned dataclasses, loaded from YAML, overridden by ``--set section.key=value``.

Every key is declared with ``opt(default, help, choices=, see=, resume=)``: its one line of help, the choices
validate() accepts, the docs page of its caveats and whether it may change on resume travel with the field, so
``hvd-partialfc config --list``, docs/configuration.md (config_docs.py) and resume's check (``resume_policy``)
are generated from here and cannot drift from the code.
Plain data: validating it checks types, choices and ranges and imports nothing of the runtime. What names a
registered component (``model.name``, ``head.mode``, ``head.loss``, ``data.augment``) is checked when the
run's parts are built, against the registries, as an error agreed by every rank before the first step.
Unknown sections/keys and wrong types are errors (a typo never silently adds a key). The resolved
config is written into the run folder, and a checkpoint records it so resume can compare. Reading YAML and
overrides, writing and comparing configs: config_io.py.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Sequence, Tuple, Union


RESUME_POLICIES = ("match", "free", "extend")


def opt(default: Any, help: str, choices: Sequence[str] = (), see: str = "", resume: str = "match") -> Any:
    """A config key: its default; the one line that ``hvd-partialfc config --list`` and docs/configuration.md
    show (``help``); the values validate() accepts (``choices``, its only list of them); the docs page that
    holds its caveats and figures (``see``, ``docs/page.md#anchor``); whether a resume may change it
    (``resume``): ``match`` (it changes the numbers: the checkpoint's value stays), ``free`` (it does not change
    the numbers), ``extend`` (it trains longer: allowed, but the lr schedule is then recomputed, so the result
    is no longer the uninterrupted run's; resume says so)."""
    meta = {"help": help, "choices": tuple(choices), "see": see, "resume": _policy(resume)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, resume: str = "match") -> Any:
    """A config section; ``resume="free"``: every key of it may change on resume, as one entry."""
    return field(default_factory=cls, metadata={"resume": _policy(resume)})


def _policy(resume: str) -> str:
    if resume not in RESUME_POLICIES:     # a typo would silently mean "match"
        raise ValueError(f"resume={resume!r}: expected one of {', '.join(RESUME_POLICIES)}")
    return resume


FAST = "docs/gpu.md#the-fast-path-keys"    # the fast-path keys' page (each `auto`: on CUDA only, run/speed.py)


@dataclass
class DataConfig:
    shards: str = opt("", "shard set directory (manifest.json + shard-*.h5); required",
                      see="docs/data.md#1-shard-set-format-version-1", resume="free")
    batch_size: int = opt(128, "samples per rank per backward pass")
    workers: int = opt(0, "DataLoader worker processes per rank; -1: the rank's cores minus one, at most 8",
                       see="docs/gpu.md#workers-per-gpu", resume="free")
    batch_timeout: float = opt(600.0, "with workers: seconds a rank waits for one batch before it stops naming its "
                                      "workers (one stuck on a stalled file system); 0: no limit",
                               see="docs/reliability.md#a-stuck-loader-worker")
    verify_sha256: bool = opt(False, "hash every shard file against the manifest before training (slow on big sets)",
                              see="docs/reliability.md#failures-every-rank-exits-fast-and-says-why", resume="free")
    augment: List[str] = opt([], "training-time augmentations in order: flip, lowres, blur, jitter, gray "
                                 "(\"name\" or \"name:key=value,...\")", see="docs/data.md#71-dataaugment")
    # free on resume, as train.device: it changes the numbers as a device does (nvJPEG's pixels are within a few
    # levels of PIL's, docs/gpu.md)
    decode: str = opt("cpu", "where JPEG shards are decoded: PIL in the loader's workers, or nvJPEG on the GPU",
                      choices=("cpu", "gpu"), see="docs/gpu.md#decoding-on-the-gpu", resume="free")
    # free on resume: it changes none of a run that would not have stopped (resuming a stopped run with skip is
    # its use)
    on_bad_sample: str = opt("stop", "an encoded sample that cannot be decoded or is empty: stop naming it, or skip "
                                     "(the next decodable sample of its class stands in, counted)",
                             choices=("stop", "skip"),
                             see="docs/data.md#71a-dirty-sets-undecodable-and-empty-images-dataon_bad_sample",
                             resume="free")
    max_bad_samples: float = opt(0.001, "with skip: the most distinct bad samples over all ranks before the run "
                                        "stops naming their shards; a count (>= 1), a fraction (< 1), 0: no limit",
                                 see="docs/data.md#71a-dirty-sets-undecodable-and-empty-images-dataon_bad_sample",
                                 resume="free")


@dataclass
class ModelConfig:
    name: str = opt("resnet", "backbone registry name (mlp, resnet, resnet18, iresnet18..2060, mobilefacenet, "
                              "vit_t..vit_h)", see="docs/faces.md#backbones-arcface_torchs-weights-in-onnx-out")
    embedding_dim: int = opt(128, "width of the embedding the classifier scores")
    kwargs: Dict[str, Any] = opt({}, "extra backbone arguments (width, blocks, ...)")
    checkpoint_activations: bool = opt(False, "recompute each block in backward: less memory, one more forward; "
                                              "iresnet*, mobilefacenet and vit_*",
                                       see="docs/faces.md#activation-checkpointing-modelcheckpoint_activationstrue",
                                       resume="free")
    sync_batchnorm: bool = opt(False, "BatchNorm statistics over every rank's batch (two all-reduces per layer "
                                      "per step)", see="docs/gpu.md#sync-batchnorm")
    init_backbone: str = opt("", "start the backbone from this file (exported, or arcface_torch's backbone.pth); "
                                 "fresh starts only", see="docs/faces.md#starting-from-pretrained-weights---init-backbone")


@dataclass
class HeadConfig:
    loss: str = opt("arcface", "margin loss: softmax | cosface | arcface (a registry name)",
                    see="docs/faces.md#arcface_torchs-config-keys-here")
    scale: float = opt(64.0, "s, the logits' scale")
    margin: float = opt(0.5, "m: radians for arcface, cosine for cosface")
    interclass_filter: float = opt(0.0, "a non-target class whose cosine passes this is scored 0 and gets no "
                                        "gradient (arcface_torch's interclass_filtering_threshold: identities "
                                        "that may be one person); 0: off", see="docs/faces.md#inter-class-filtering")
    mode: str = opt("local", "classifier mode: local (the method) | global (exact model-parallel softmax) | "
                             "replicated (data parallel)", see="docs/accuracy.md#results")
    sample_rate: float = opt(1.0, "global, local: fraction of the slice's centres scored per step (PartialFC); "
                                  "1 = all",
                             see="docs/accuracy.md#sampled-softmax-headsample_rate-in-local-against-r--1-and-partialfc")
    sampled_step: str = opt("exact", "local with sample_rate < 1: the classifier's optimizer step (exact: dense "
                                     "numbers at sampled cost; lazy: PLSC's; dense: PartialFC v2's)",
                            choices=("exact", "lazy", "dense"),
                            see="docs/benchmarks.md#sampled-softmax-partialfc-global-against-local-at-the-same-rates")
    negatives_every: int = opt(50, "local: every K steps the ranks exchange class centres as frozen negatives "
                                   "(cross-shard negatives; 0: off)",
                               see="docs/accuracy.md#cross-shard-negatives-choosing-k-and-s")
    negatives_share: int = opt(1024, "local: centres each rank shares per exchange, a random subset (0: its whole "
                                     "slice)",
                               see="docs/accuracy.md#cross-shard-negatives-choosing-k-and-s")
    negatives_pool: int = opt(8192, "local: the most centres all ranks share together per exchange; a rank "
                                    "shares min(share, ceil(pool / N)) (0: no cap)",
                              see="docs/scaling.md#cross-shard-negatives-at-scale-why-the-default-shares-at-most-8192-centres-in-all")
    matmul: str = opt("auto", "precision of the head's matrix products (auto: tf32 on CUDA, fp32 elsewhere); "
                              "the softmax sums stay fp32", choices=("auto", "fp32", "tf32", "bf16"),
                      see="docs/gpu.md#the-bf16-heads-accuracy", resume="free")


@dataclass
class OptimConfig:
    name: str = opt("sgd", "optimizer of both the backbone and the classifier", choices=("sgd", "adamw"))
    backbone_lr: float = opt(0.1, "backbone peak learning rate")
    classifier_lr: float = opt(0.1, "classifier peak learning rate")
    backbone_momentum: float = opt(0.9, "backbone momentum (sgd; adamw: beta1)")
    classifier_momentum: float = opt(0.9, "classifier momentum (sgd; adamw: beta1)")
    backbone_weight_decay: float = opt(5e-4, "backbone weight decay")
    classifier_weight_decay: float = opt(5e-4, "classifier weight decay")
    schedule: str = opt("cosine", "learning-rate schedule after warmup", choices=("cosine", "poly", "constant"))
    warmup_steps: int = opt(0, "linear warmup steps")
    min_lr_ratio: float = opt(0.0, "final lr / peak lr")
    poly_power: float = opt(2.0, "exponent of the poly schedule")
    clip_grad_norm: float = opt(0.0, "> 0: clip the averaged backbone gradient to this norm",
                                see="docs/faces.md#arcface_torchs-config-keys-here")
    fp16_compression: bool = opt(False, "Horovod: fp16 compression of the backbone gradient's allreduce",
                                 see="docs/engines.md#same-numbers")
    backbone_kernel: str = opt("torch", "the backbone optimizer's kernels: torch's choice (foreach on CUDA, a loop on "
                               "CPU), or auto (fused on CUDA)", ("torch", "loop", "foreach", "fused", "auto"), FAST,
                               resume="free")
    classifier_kernel: str = opt("fused", "the classifier optimizer's kernels (dense rows)", ("fused", "foreach", "loop"),
                                 FAST, resume="free")
    backward_passes_per_step: int = opt(1, "gradient accumulation: backward passes per optimizer step (one "
                                           "allreduce)")
    # match on resume: sum steps k times further than mean. An imported arcface_torch run needs sum (its
    # train_v2.py backpropagates each batch's loss undivided); the import refuses mean at gradient_acc > 1
    accumulate: str = opt("mean", "backward_passes_per_step > 1: the step's gradient is the mean of its passes' "
                                  "(lr means the same at any count) or their sum (arcface_torch's gradient_acc)",
                          choices=("mean", "sum"), see="docs/migrate.md#gradient-accumulation-a-sum")
    classifier_grad_mean: str = opt("global", "local: the classifier's gradient is the global batch's mean loss's "
                                              "(lr means the same at any N) or the rank's own (N times larger)",
                                    choices=("global", "local"), see="docs/accuracy.md#the-classifiers-gradient-scale")


@dataclass
class TrainConfig:
    steps: int = opt(0, "optimizer steps; 0: epochs x (min over ranks of steps per epoch)", resume="extend")
    epochs: float = opt(1.0, "epochs, when train.steps is 0", resume="extend")
    seed: int = opt(0, "seed of the model's initialisation and the data order")
    # free on resume: another device changes the numbers only as a device does (as data.decode)
    device: str = opt("auto", "auto: a GPU if one is visible, else cpu", choices=("auto", "cpu", "cuda"),
                      see="docs/gpu.md#devices-ordinals-and-the-tests-on-a-gpu-node", resume="free")
    share_gpu: bool = opt(False, "allow ranks to share a GPU (tests, debugging); false: an error at start-up",
                          see="docs/gpu.md#devices-ordinals-and-the-tests-on-a-gpu-node", resume="free")
    precision: str = opt("fp32", "fp32 | bf16 (autocast) | fp16 (autocast + agreed dynamic loss scale)",
                         choices=("fp32", "bf16", "fp16"), see="docs/method.md#precision")
    loss_scale_growth: int = opt(100, "fp16: the loss scale doubles after this many finite steps in a row",
                                 see="docs/method.md#precision")
    log_every: int = opt(10, "steps between log lines and metrics.jsonl rows",
                         see="docs/data.md#73-is-the-run-loader-bound-logging", resume="free")
    on_nonfinite: str = opt("stop", "a step whose averaged backbone gradient is not finite: stop the run, or "
                                    "skip the step on every rank", choices=("stop", "skip"),
                            see="docs/reliability.md#steps-that-keep-being-skipped")
    threads: int = opt(0, "torch intra-op threads per rank (0: the host's cores / its ranks, on CPU)",
                       see="docs/engines.md#launching", resume="free")
    max_consecutive_skips: int = opt(50, "stop with an error after this many skipped steps in a row (0: never)",
                                     see="docs/reliability.md#steps-that-keep-being-skipped", resume="free")
    tensorboard: bool = opt(False, "also write metrics.jsonl's scalars as TensorBoard events in OUT/tensorboard",
                            see="docs/data.md#73-is-the-run-loader-bound-logging", resume="free")
    engine: str = opt("auto", "auto: torch under torchrun, else horovod", choices=("auto", "horovod", "torch"),
                      see="docs/engines.md#choosing", resume="free")
    heartbeat_timeout: float = opt(20.0, "seconds of silence from a ring neighbour before the job ends naming it "
                                         "(0: off)", see="docs/engines.md#failures", resume="free")
    collective_timeout: float = opt(10800.0, "seconds a rank waits in one collective (or for the group to form) "
                                            "before it fails: longer than rank 0's slowest work alone (an "
                                            "evaluation, a large checkpoint); a lost peer ends the job sooner "
                                            "(heartbeat_timeout)", see="docs/engines.md#timeouts", resume="free")
    cudnn_benchmark: bool = opt(True, "CUDA: cuDNN picks its fastest convolution algorithms at the first step",
                                see="docs/gpu.md#the-keys", resume="free")
    channels_last: Union[bool, str] = opt(False, "NHWC backbone and batches, for Tensor Cores under fp16 / bf16: false, "
                                          "true, or auto (true on CUDA)", see="docs/gpu.md#the-keys", resume="free")
    compile: str = opt("none", "torch.compile the backbone: none, the whole model (its gradients, and their averaging, "
                       "after the backward), each block, or auto (blocks on CUDA)", ("none", "model", "blocks", "auto"),
                       FAST, resume="free")
    compile_mode: str = opt("default", "torch.compile's mode; reduce-overhead: CUDA graphs (every batch is full)",
                            ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"), FAST,
                            resume="free")
    compile_head: bool = opt(False, "also torch.compile the margin softmax's passes over the (M, W) logits", see=FAST,
                             resume="free")
    skip_decision: str = opt("host", "where a step decides to skip a non-finite gradient: host (reads both norms), device "
                             "(no host read; fused kernels), or auto (device on CUDA)", ("host", "device", "auto"),
                             FAST, resume="free")
    stragglers: str = opt("warn", "a rank whose own step time stays straggler_ratio x the median for straggler_steps "
                                  "steps: name it (warn), also go on without its node (evict: elastic torchrun), "
                                  "or watch nothing (off)", choices=("off", "warn", "evict"),
                          see="docs/reliability.md#stragglers", resume="free")
    straggler_ratio: float = opt(1.5, "a rank is slow in a step when its own time is at least this times the "
                                      "ranks' median", see="docs/reliability.md#stragglers", resume="free")
    straggler_steps: int = opt(10, "slow steps in a row before a rank is named (quiet ones before it is cleared)",
                               see="docs/reliability.md#stragglers", resume="free")
    straggler_min_nodes: int = opt(2, "evict: never below this many nodes (torchrun's --nnodes MIN)",
                                   see="docs/reliability.md#stragglers", resume="free")
    straggler_cooldown: int = opt(1000, "evict: steps after an eviction before the next one",
                                  see="docs/reliability.md#stragglers", resume="free")
    allow_host_allreduce: bool = opt(False, "Horovod on CUDA without NCCL: go on through host memory (several "
                                            "times slower) instead of stopping", see="docs/gpu.md#without-nccl",
                                     resume="free")


@dataclass
class CheckpointConfig:
    every: int = opt(0, "steps between checkpoints (0: only at the end)", see="docs/reliability.md#checkpoints")
    keep: int = opt(2, "checkpoints kept (the final one always)", see="docs/reliability.md#checkpoints")
    resume: str = opt("", "\"\" | auto | path of a checkpoint folder",
                      see="docs/reliability.md#resume---resume-autopath-or---set-checkpointresume")
    every_minutes: float = opt(0.0, "also checkpoint when this many minutes passed since the last one (0: off)",
                               see="docs/reliability.md#preemption-and-time-limits")
    allow_other_data: bool = opt(False, "resume on other samples of the same classes and shard label ranges",
                                 see="docs/reliability.md#resume---resume-autopath-or---set-checkpointresume")
    memory_every: int = opt(0, "steps between memory snapshots (host memory, a copy on another node; 0: off)",
                            see="docs/reliability.md#memory-snapshots")
    memory_dir: str = opt("", "each node's folder for memory snapshots, a tmpfs (\"\": /dev/shm; "
                          "$HVD_PARTIALFC_MEMORY_DIR overrides it)", see="docs/reliability.md#memory-snapshots")
    on_write_error: str = opt("go_on", "a checkpoint no rank could write (a full disk), not the last step's nor a "
                                       "stop's: say it and train on, trying the next one on schedule, or stop",
                              choices=("go_on", "stop"), see="docs/reliability.md#a-full-disk")
    lock_wait: float = opt(120.0, "seconds a start waits for the run folder's lock while another job holds it, "
                                  "before it refuses (longer than an NFS lease: a lost node's lock expires)",
                           see="docs/reliability.md#one-job-a-run-folder")


@dataclass
class EvalConfig:
    pairs: List[str] = opt([], "verification sets evaluated during training (.h5 pair sets or LFW-style .bin)",
                           see="docs/evaluation.md#5-during-training-evalpairs-evalevery-evalon_error")
    every: int = opt(0, "evaluate every K steps on rank 0 (0: only at the end, if pairs are given)",
                     see="docs/evaluation.md#5-during-training-evalpairs-evalevery-evalon_error")
    flip: bool = opt(False, "add the horizontal flip's embedding (faces: yes; glyphs: no)",
                     see="docs/evaluation.md#5-during-training-evalpairs-evalevery-evalon_error")
    batch_size: int = opt(256, "evaluation batch size", resume="free")
    on_error: str = opt("log", "a failed evaluation (agreed across ranks): log it in eval.jsonl and go on, or stop "
                               "after the step's checkpoint", choices=("log", "stop"),
                        see="docs/evaluation.md#5-during-training-evalpairs-evalevery-evalon_error", resume="free")


@dataclass
class Config:
    out: str = opt("runs/default", "run folder: config, metrics, checkpoints", see="docs/reliability.md#checkpoints",
                   resume="free")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig, resume="free")   # where and how often, not what
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> "Config":
        for key, f in iter_keys(self):
            allowed, v = f.metadata.get("choices"), get_key(self, key)
            if allowed and v not in allowed:
                raise ConfigError(f"{key}={v!r}: expected one of {', '.join(allowed)}{did_you_mean(str(v), allowed)}")
        positive = [("data", "batch_size"), ("optim", "backward_passes_per_step"), ("train", "log_every"),
                    ("train", "loss_scale_growth")]
        for sec, key in positive:
            if getattr(getattr(self, sec), key) < 1:
                raise ConfigError(f"{sec}.{key} must be >= 1")
        if self.data.batch_timeout < 0:
            raise ConfigError(f"data.batch_timeout={self.data.batch_timeout}: expected seconds > 0, or 0 (no limit)")
        if self.data.workers < -1:
            raise ConfigError(f"data.workers={self.data.workers}: expected >= 0, or -1 (the rank's cores minus one)")
        if self.data.max_bad_samples < 0:
            raise ConfigError(f"data.max_bad_samples={self.data.max_bad_samples}: expected a count (>= 1), a "
                              f"fraction of the set's samples (< 1), or 0 (no limit)")
        if not self.data.shards:
            raise ConfigError("data.shards is required: give --shards DIR, a shard set written by "
                              "`hvd-partialfc-shards build`")
        if not 0.0 < self.head.sample_rate <= 1.0:
            raise ConfigError(f"head.sample_rate={self.head.sample_rate}: expected 0 < rate <= 1")
        if not 0.0 <= self.head.interclass_filter < 1.0 or (self.head.interclass_filter and self.head.loss == "softmax"):
            raise ConfigError(f"head.interclass_filter={self.head.interclass_filter}: expected a cosine in [0, 1) with "
                              "head.loss arcface or cosface (0: off)")
        if min(self.head.negatives_every, self.head.negatives_share, self.head.negatives_pool) < 0:
            raise ConfigError("head.negatives_every, head.negatives_share and head.negatives_pool must be >= 0")
        if self.model.sync_batchnorm and self.model.checkpoint_activations:
            raise ConfigError("model.sync_batchnorm and model.checkpoint_activations together: the recomputed "
                              "forward would repeat every layer's collective; choose one")
        if self.train.channels_last not in (True, False, "auto"):
            raise ConfigError(f"train.channels_last={self.train.channels_last!r}: expected true, false or auto")
        if self.train.compile != "none" and self.model.sync_batchnorm:
            raise ConfigError("train.compile with model.sync_batchnorm: a graph break at every layer's collective")
        if self.train.max_consecutive_skips < 0 or self.checkpoint.every_minutes < 0:
            raise ConfigError("train.max_consecutive_skips and checkpoint.every_minutes must be >= 0")
        if self.train.heartbeat_timeout < 0:
            raise ConfigError("train.heartbeat_timeout must be >= 0 (0: off)")
        t = self.train
        if t.straggler_ratio <= 1 or t.straggler_steps < 1 or t.straggler_min_nodes < 1 or t.straggler_cooldown < 0:
            raise ConfigError(f"train.straggler_ratio={t.straggler_ratio}, straggler_steps={t.straggler_steps}, "
                              f"straggler_min_nodes={t.straggler_min_nodes}, straggler_cooldown="
                              f"{t.straggler_cooldown}: expected a ratio > 1, steps >= 1, nodes >= 1, cooldown >= 0")
        if self.train.collective_timeout <= 0:
            raise ConfigError("train.collective_timeout must be > 0 seconds")
        if self.checkpoint.lock_wait < 0:
            raise ConfigError("checkpoint.lock_wait must be >= 0 seconds")
        if self.train.steps < 0 or self.train.epochs <= 0:
            raise ConfigError("train.steps must be >= 0 and train.epochs > 0")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A mistake in the user's config: the CLI prints it as one line and exits 2."""


def iter_keys(cfg: Any = None, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every leaf key of a config class or object (default: Config), in order."""
    cls = cfg if isinstance(cfg, type) else type(cfg) if cfg is not None else Config
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def resume_policy(cls: type = Config, prefix: str = "") -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(keys that may change between a checkpoint and its resume, keys that may change to extend the run),
    in declaration order, from each key's ``resume=`` (``opt``): a free section is one entry, ``checkpoint``,
    matching all its keys (resume.check_config compares by prefix)."""
    free: List[str] = []
    extend: List[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, policy = prefix + f.name, f.metadata.get("resume", "match")
        if policy == "free":
            free.append(key)
        elif policy == "extend":
            extend.append(key)
        elif dataclasses.is_dataclass(hints[f.name]):
            more_free, more_extend = resume_policy(hints[f.name], key + ".")
            free += more_free
            extend += more_extend
    return tuple(free), tuple(extend)


def get_key(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def did_you_mean(word: str, options: Sequence[str], cutoff: float = 0.6) -> str:
    """'; did you mean `x`?' for the closest of ``options`` (difflib's ratio >= cutoff), or ''."""
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=cutoff)
    return f"; did you mean `{close[0]}`?" if close else ""
