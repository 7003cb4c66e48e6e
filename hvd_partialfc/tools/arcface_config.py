"""``hvd-partialfc config --from-arcface CONFIG.py``: an arcface_torch config file as this package's YAML.

The file is parsed, never run (no ``exec``, no import): each statement of the file's top level that sets
``config.KEY`` (or ``config["KEY"]``) to a literal (numbers, strings, booleans, None, tuples, lists) is read,
one or several at a time (``config.a, config.b = 1, 2``), annotated or not; every other statement that sets a
key (not a literal, under an ``if``/``for``/``def``/..., an element of it, ``+=``) is listed as not read, with
its line, as the run's value could be another. arcface_torch
starts every config from ``configs/base.py`` (its ``get_config``): that file is read first when it lies
beside CONFIG.py, else its published defaults below stand in for it.

Carried (arcface_torch -> here): network -> model.name (r2060, vit_b, vit_l and vit_h with
model.checkpoint_activations, as its get_model checkpoints them); embedding_size -> model.embedding_dim;
margin_list (m1, m2, m3) -> head.loss arcface with m2 or cosface with m3, head.scale 64 (CombinedMarginLoss's s);
sample_rate -> head.sample_rate; interclass_filtering_threshold -> head.interclass_filter; fp16 ->
train.precision; optimizer, lr, momentum, weight_decay -> optim.*, the backbone and the classifier alike;
batch_size -> data.batch_size (per GPU); num_epoch -> train.epochs; warmup_epoch -> optim.warmup_steps (with
num_image and --world-size: its batches of batch_size x W, which its scheduler counts, in optimizer steps of
gradient_acc batches); the poly schedule; gradient_acc -> optim.backward_passes_per_step, with optim.accumulate
sum (train_v2.py adds its batches' gradients); seed, num_workers, frequent, verbose -> train.seed,
data.workers, train.log_every, eval.every; rec + val_targets -> eval.pairs (its .bin files), eval.flip;
train_v2.py's clip_grad_norm_(backbone, 5) and horizontal flip -> optim.clip_grad_norm 5, data.augment.
``head.mode`` is ``local`` (this package's method) unless ``--mode global`` (Partial FC's exact softmax).
"""
from __future__ import annotations

import ast
import operator
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..models.vit import VARIANTS as VIT_VARIANTS

# configs/base.py's values (arcface_torch), when base.py is not beside the file
BASE = {"margin_list": (1.0, 0.5, 0.0), "network": "r50", "resume": False, "save_all_states": False,
        "output": "ms1mv3_arcface_r50", "embedding_size": 512, "sample_rate": 1, "interclass_filtering_threshold": 0,
        "fp16": False, "batch_size": 128, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4,
        "verbose": 2000, "frequent": 10, "dali": False, "gradient_acc": 1, "seed": 2048, "num_workers": 2}
NETWORKS = {"r18": "iresnet18", "r34": "iresnet34", "r50": "iresnet50", "r100": "iresnet100", "r200": "iresnet200",
            "r2060": "iresnet2060", "mbf": "mobilefacenet", **{name: name for name in VIT_VARIANTS}}
CHECKPOINTED = {"r2060"} | {name for name, v in VIT_VARIANTS.items() if v[5]}   # its get_model's always
# keys with no counterpart here, and why
DROPPED = {
    "dali": "DALI's loader: this package reads HDF5 shards with its own loader",
    "output": "the run folder is --out",
    "resume": "resume is --resume auto (or checkpoint.resume)",
    "save_all_states": "every checkpoint holds all states (checkpoint.every sets how often)",
    "num_classes": "read from the shard set's manifest",
    "num_image": "read from the shard set's manifest (it sized warmup_epoch's steps)",
    "rec": "the .rec becomes shards once (hvd-partialfc-shards build recordio); its .bin files are eval.pairs",
    "val_targets": "carried as eval.pairs when rec is known",
    "wandb_key": "no Weights & Biases logger: metrics.jsonl, and TensorBoard with train.tensorboard",
}


def read_config(path: str, computed: Optional[List[str]] = None) -> Tuple[Dict[str, Any], List[str]]:
    """The ``config.KEY = VALUE`` assignments of ``path`` over base.py's (beside it, else ``BASE``) whose value
    is a literal or arithmetic of literals and keys set before (``_evaluate``); and the keys read otherwise
    (not read). ``computed``: gets a line for each arithmetic value, with its result."""
    base = os.path.join(os.path.dirname(os.path.abspath(path)), "base.py")
    computed = [] if computed is None else computed
    values, skipped = (dict(BASE), []) if not os.path.isfile(base) or os.path.samefile(base, path) else \
        _assignments(base, {}, computed)
    mine, not_read = _assignments(path, values, computed)
    values.update(mine)
    return values, skipped + not_read


def is_number(x) -> bool:
    """An int or a float, not a bool (a config's True is not 1 here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _evaluate(node: ast.AST, known: Dict[str, Any]):
    """A literal, or + - * / // % and unary minus over numbers: literals and keys set before (``config.KEY``,
    base.py's included). arcface_torch's recipes write ``config.warmup_epoch = config.num_epoch // 10``.
    Anything else raises ValueError: nothing is run."""
    key = _key(node)
    if key is not None:
        if key not in known:
            raise ValueError(f"config.{key} is not set before")
        return known[key]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        a, b = _evaluate(node.left, known), _evaluate(node.right, known)
        if not (is_number(a) and is_number(b)):
            raise ValueError("arithmetic of other than numbers")
        return _ARITHMETIC[type(node.op)](a, b)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _evaluate(node.operand, known)
        if not is_number(v):
            raise ValueError("a sign on other than a number")
        return -v if isinstance(node.op, ast.USub) else v
    return ast.literal_eval(node)


def _assignments(path: str, before: Dict[str, Any], computed: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    with open(path) as f:
        text = f.read()
    try:
        tree = ast.parse(text, path)
    except SyntaxError as e:     # a ValueError: the command's one line and exit 2
        raise ValueError(f"{path}:{e.lineno}: not Python ({e.msg}): fix the file (arcface_torch runs it) and "
                         "translate it again") from None
    values: Dict[str, Any] = {}
    not_read: List[str] = []
    lines = text.splitlines()
    for node in tree.body:
        _read_statement(node, values, not_read, lines, before, computed)
    return values, not_read


def _read_statement(node: ast.stmt, values: Dict[str, Any], not_read: List[str], lines: List[str],
                    before: Dict[str, Any], computed: List[str]) -> None:
    """A top-level statement: the keys it sets to values (``_evaluate``) into ``values``; the keys it sets
    otherwise into ``not_read`` with their line; those of a compound statement (``if``, ``for``, ``def``,
    ``with``, ...) all, as they may be set or not."""
    targets, value = [], None
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign):
        if node.value is None:      # an annotation alone sets nothing
            return
        targets, value = [node.target], node.value
    inside = "" if targets or isinstance(node, (ast.AugAssign, ast.Delete, ast.Expr)) else \
        f", inside {type(node).__name__.lower()} of line {node.lineno}"
    for target in targets or [node]:
        pairs = _pairs(target, value) if targets else None
        if pairs is None:      # a key set otherwise than whole to a literal of its own, or maybe not set
            not_read.extend(f"{key} (line {n}{inside}: {lines[n - 1].strip()[:60]}: not read)"
                            for key, n in _keys_set(target))
            continue
        for key, v in pairs:
            try:
                values[key] = ast.literal_eval(v)          # a literal (-1 too): read as it is
                continue
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
            try:
                values[key] = _evaluate(v, {**before, **values})
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, ArithmeticError):
                values.pop(key, None)      # a key set again, otherwise: its earlier value is not the run's
                not_read.append(f"{key} (line {node.lineno}: not a literal: {ast.unparse(v)[:60]})")
                continue
            computed.append(f"{key} = {ast.unparse(v)[:60]} = {values[key]!r} (line {node.lineno})")


def _key(target: ast.AST):
    """``KEY`` of ``config.KEY`` or ``config["KEY"]``; None for anything else."""
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "config":
        return target.attr
    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == "config" \
            and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str):
        return target.slice.value
    return None


def _pairs(target: ast.AST, value: ast.AST):
    """(key, value expression) for each key ``target`` sets whole from ``value``: one, or one per element of
    a tuple or list target unpacking a tuple or list of as many; [] when it sets none; None otherwise."""
    if _key(target) is not None:
        return [(_key(target), value)]
    if isinstance(target, (ast.Tuple, ast.List)):
        if not _keys_set(target):
            return []
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) \
                and not any(isinstance(e, ast.Starred) for e in target.elts + value.elts):
            out = [_pairs(t, v) for t, v in zip(target.elts, value.elts)]
            return None if any(p is None for p in out) else [kv for p in out for kv in p]
        return None
    return None if _keys_set(target) else []


def _keys_set(node: ast.AST) -> List[Tuple[str, int]]:
    """(key, line) of each place ``node`` (a statement, at any depth, or a target) may set a key:
    ``config.KEY`` or ``config["KEY"]`` written to or deleted, an element or attribute of one of them, or a
    method of one called (``.append``); a key named by a variable (``config[k]``) or a call on ``config``
    itself (``config.update(...)``, ``setattr(config, ...)``) by its text."""
    keys: List[Tuple[str, int]] = []
    for n in ast.walk(node):
        label = None
        if isinstance(getattr(n, "ctx", None), (ast.Store, ast.Del)) and not isinstance(n, ast.Name):
            label = _root_key(n) or (ast.unparse(n)[:40] if _is_config(getattr(n, "value", None)) else None)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            label = ast.unparse(n.func)[:40] + "(...)" if _is_config(n.func.value) else _root_key(n.func.value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr") \
                and n.args and _is_config(n.args[0]):
            label = ast.unparse(n)[:40]
        if label is not None and (label, n.lineno) not in keys:
            keys.append((label, n.lineno))
    return keys


def _root_key(node: ast.AST):
    """The key under ``node`` (``config.KEY``, ``config["KEY"]``, or an element or attribute of one)."""
    while _key(node) is None and isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return _key(node)


def _is_config(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "config"


def optimizer_steps(batches: float, acc: int) -> int:
    """arcface_torch's warm-up, in the batches its lr scheduler counts (it steps once a batch), as optimizer
    steps of ``acc`` batches (gradient_acc): whole steps, as its own ``int`` counts did."""
    return int(batches // acc)


def translate(v: Dict[str, Any], world_size: int = 0, mode: str = "local") -> Tuple[Dict[str, Any], List[str]]:
    """This package's config sections for arcface_torch's values ``v``; and the keys not carried, with why."""
    why: List[str] = []
    cfg: Dict[str, Any] = {"data": {"augment": ["flip"]}, "model": {}, "head": {"mode": mode, "scale": 64.0},
                           "optim": {"schedule": "poly", "poly_power": 1.0, "clip_grad_norm": 5.0},
                           "train": {}, "eval": {}}
    net = v.get("network")
    if net == "mbf_large":                 # its get_mbf_large: mobilefacenet with more blocks, 4x wide
        cfg["model"].update(name="mobilefacenet", kwargs={"blocks": [2, 8, 12, 4], "scale": 4})
    elif net in NETWORKS:
        cfg["model"]["name"] = NETWORKS[net]
        if net in CHECKPOINTED:
            cfg["model"]["checkpoint_activations"] = True
    else:
        why.append(f"network {net!r}: no such backbone here (known: {', '.join(NETWORKS)}, mbf_large)")
    cfg["model"]["embedding_dim"] = int(v.get("embedding_size", 512))
    m1, m2, m3 = (list(v.get("margin_list", (1.0, 0.5, 0.0))) + [0.0, 0.0, 0.0])[:3]
    if m1 == 1.0 and m3 == 0.0 and m2 > 0:
        cfg["head"].update(loss="arcface", margin=float(m2))
    elif m1 == 1.0 and m2 == 0.0 and m3 > 0:
        cfg["head"].update(loss="cosface", margin=float(m3))
    else:
        why.append(f"margin_list {(m1, m2, m3)}: a combined margin; here arcface (1, m, 0) or cosface (1, 0, m)")
    cfg["head"]["sample_rate"] = float(v.get("sample_rate", 1.0))
    if v.get("interclass_filtering_threshold"):
        cfg["head"]["interclass_filter"] = float(v["interclass_filtering_threshold"])
    cfg["train"]["precision"] = "fp16" if v.get("fp16") else "fp32"
    name = v.get("optimizer", "sgd")
    o = cfg["optim"]
    o["name"] = name
    o["backbone_lr"] = o["classifier_lr"] = float(v.get("lr", 0.1))
    if name == "sgd":
        o["backbone_momentum"] = o["classifier_momentum"] = float(v.get("momentum", 0.9))
    o["backbone_weight_decay"] = o["classifier_weight_decay"] = float(v.get("weight_decay", 5e-4))
    o["backward_passes_per_step"] = int(v.get("gradient_acc", 1))
    o["accumulate"] = "sum"        # train_v2.py backpropagates each batch's loss undivided
    cfg["data"]["batch_size"] = int(v.get("batch_size", 128))
    cfg["data"]["workers"] = int(v.get("num_workers", 2))
    if "num_epoch" in v:
        cfg["train"]["epochs"] = float(v["num_epoch"])
    warm = v.get("warmup_epoch", 0)
    if warm and world_size and v.get("num_image"):     # train_v2.py's warmup_step, in batches
        batches = v["num_image"] // (cfg["data"]["batch_size"] * world_size) * warm
        o["warmup_steps"] = optimizer_steps(batches, o["backward_passes_per_step"])
    elif warm:
        why.append(f"warmup_epoch {warm}: its steps need num_image and the run's GPU count (--world-size)")
    else:
        o["warmup_steps"] = 0
    cfg["train"].update(seed=int(v.get("seed", 2048)), log_every=int(v.get("frequent", 10)))
    cfg["eval"].update(every=int(v.get("verbose", 2000)), flip=True)
    if v.get("rec") and v.get("val_targets"):
        cfg["eval"]["pairs"] = [os.path.join(v["rec"], f"{t}.bin") for t in v["val_targets"]]
    for key in sorted(v):
        if key in DROPPED and not (key == "val_targets" and "pairs" in cfg["eval"]):
            why.append(f"{key}: {DROPPED[key]}")
        elif key.startswith("wandb") or key in ("using_wandb", "suffix_run_name", "save_artifacts"):
            why.append(f"{key}: {DROPPED['wandb_key']}")
    return cfg, why


def to_yaml(cfg: Dict[str, Any], why: List[str], source: str, not_read: List[str],
            computed: Sequence[str] = ()) -> str:
    import yaml
    dropped = why + [f"{k}: not read" for k in not_read]
    lines = [f"# From arcface_torch's {os.path.basename(source)} (hvd-partialfc config --from-arcface): read, not run."]
    lines += ["# Computed:"] + [f"#   {c}" for c in computed] if computed else []
    lines += ["# Not carried:"] + [f"#   {w}" for w in dropped or ["nothing"]]
    lines.append("# head.mode local is this package's method; --mode global is Partial FC v2's exact softmax.")
    return "\n".join(lines) + "\n" + yaml.safe_dump({k: v for k, v in cfg.items() if v}, sort_keys=False)


def add_arguments(c, group) -> None:
    group.add_argument("--from-arcface", metavar="CONFIG.py", help="translate an arcface_torch config file "
                                                                   "(parsed, never run) into this package's YAML")
    c.add_argument("--world-size", type=int, default=0, help="--from-arcface: the GPUs the run used (sizes "
                                                            "warmup_epoch in steps)")
    c.add_argument("--mode", choices=("local", "global"), default="local", help="--from-arcface: head.mode")
    c.add_argument("--out", help="--from-arcface: write the YAML here (default: stdout)")


def run(args) -> int:
    from ..config_io import load_config
    computed: List[str] = []
    values, not_read = read_config(args.from_arcface, computed)
    cfg, why = translate(values, args.world_size, args.mode)
    text = to_yaml(cfg, why, args.from_arcface, not_read, computed)
    import yaml
    load_config(None, [], dict(yaml.safe_load(text), data=dict(cfg["data"], shards="-")))   # it loads here
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}; not carried: {len(why) + len(not_read)} keys (its header says why)",
              file=sys.stderr)
    else:
        print(text, end="")
    return 0
