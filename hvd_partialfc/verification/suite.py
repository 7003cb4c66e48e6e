"""What ``hvd-partialfc eval`` runs: load a backbone, run every protocol asked for, write one ``eval.json``.

``eval.json`` holds ``backbone``, ``model``, ``flip``, ``batch_size``, ``pairs`` (set name -> file),
``sets`` (pair protocol: set name -> model key (``backbone``, ``pixels``, ``pixels_ncc``,
``random_init``) -> the `metrics.verification_metrics` keys plus ``roc``), ``all_pairs`` (shard dir ->
metrics), ``ijb`` (``IJBB``/``IJBC`` -> `metrics.template_metrics` keys, the options that were on,
counts and times) and ``identification`` (shard dir -> rank-k and ``tpir@fpir=...``). Every protocol's
TAR keys are the same ``tar@far=...``. PNGs: ``roc.png`` (pair sets), ``roc-ijbc.png`` / ``roc-ijbb.png``.

The backbone is a file or folder written by this package (`hvd_partialfc.models.pretrained.load_backbone`), a
plain ``state_dict`` file such as arcface_torch's ``backbone.pth`` together with the registered backbone
``model`` name it loads into (its keys must match exactly; ``in_shape`` and ``embedding_dim`` give the
architecture's input and width), or an ONNX model (``.onnx``: onnx_backbone.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch.nn as nn

from ..atomic import write_text
from ..models.pretrained import load_backbone
from ..models import create_model
from ..models.pretrained import key_mismatch, read_backbone_file
from ..data.pair_files import read_pairs
from .all_pairs import evaluate_all_pairs
from .identification import evaluate_identification
from .ijb import evaluate_ijb, print_progress
from .metrics import jsonable
from .output import default_out_dir, format_all_pairs, format_identification, format_ijb, format_table, plot_roc
from .verify_pairs import check_input_shape, check_names, evaluate_backbone, evaluate_baselines


@dataclass
class IJBRequest:
    """One IJB evaluation: the release folder, ``IJBB`` or ``IJBC``, and the protocol's three options."""

    root: str
    name: str = "IJBC"
    flip: bool = True
    norm_score: bool = True
    detector_score: bool = True
    workers: int = 0


@dataclass
class PlainStateDict:
    """How to build the module a plain ``state_dict`` file loads into (``eval --model``)."""

    model: str
    in_shape: Tuple[int, ...] = (112, 112, 3)
    embedding_dim: int = 512


def load_any_backbone(path: str, plain: Optional[PlainStateDict] = None,
                      onnx_input: str = "auto") -> Tuple[nn.Module, Dict[str, Any]]:
    """(eval-mode backbone, model args) from this package's files, from a plain ``state_dict`` file when
    ``plain`` names the architecture, or from an ``.onnx`` file (onnx_backbone.py; ``onnx_input``: how its
    pixels are fed). Every torch file loads with ``weights_only=True``."""
    if path.lower().endswith(".onnx") and os.path.isfile(path):
        from .onnx_backbone import load_onnx_backbone
        return load_onnx_backbone(path, onnx_input)
    if plain is None or os.path.isdir(path):
        return load_backbone(path)
    state, own_args = read_backbone_file(path)          # the one reader of backbone files (pretrained.py)
    if own_args is not None:                             # written by this package: it names its architecture
        return load_backbone(path)
    args = {"name": plain.model, "in_shape": [int(v) for v in plain.in_shape],
            "embedding_dim": int(plain.embedding_dim), "kwargs": {}}
    model = create_model(plain.model, in_shape=args["in_shape"], embedding_dim=args["embedding_dim"])
    problems = key_mismatch(model, state)
    if problems:
        raise ValueError(f"{path}: does not load into backbone {plain.model!r} ({'; '.join(problems)}); check "
                         f"--model and --embedding-dim")
    model.load_state_dict(state, strict=True)
    return model.eval(), args


def evaluate_files(backbone: str, pairs_paths: Sequence[str], flip: bool = False, baselines: bool = False,
                   batch_size: int = 256, out_dir: Optional[str] = None, seed: int = 0,
                   all_pairs_dirs: Sequence[str] = (), ijb: Optional[IJBRequest] = None,
                   identification_dirs: Sequence[str] = (), plain: Optional[PlainStateDict] = None,
                   onnx_input: str = "auto") -> Dict[str, Any]:
    """Evaluate a backbone (file, checkpoint, run or ONNX model) on every protocol given, write ``eval.json``
    and the ROC PNGs into ``out_dir``; returns the JSON dict with ``tables`` (text, one per result) and
    ``files``. ``flip`` applies to the pair, all-pairs and identification protocols; IJB has its own
    (``ijb.flip``)."""
    model, args = load_any_backbone(backbone, plain, onnx_input)
    if baselines and args["name"] == "onnx":
        raise ValueError(f"{backbone}: --baselines builds the backbone's architecture at random; an ONNX file has "
                         "none here (evaluate the run's backbone for them)")
    if not pairs_paths and not all_pairs_dirs and ijb is None and not identification_dirs:
        raise ValueError("nothing to evaluate: give pair sets, shard sets (all-pairs, identification) or an IJB folder")
    sets = [read_pairs(p) for p in pairs_paths]
    check_names(sets, pairs_paths)
    for s in sets:
        check_input_shape(args, s)
    out_dir = out_dir or default_out_dir(backbone)
    os.makedirs(out_dir, exist_ok=True)
    results: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for s in sets:
        results[s.name] = {"backbone": evaluate_backbone(model, s, batch_size, flip)}
        if baselines:
            results[s.name].update(evaluate_baselines(args, s, batch_size, flip, seed))
    all_pairs = {os.path.normpath(d): evaluate_all_pairs(model, d, batch_size, flip, name=backbone)
                 for d in all_pairs_dirs}
    ijb_results = {}
    if ijb is not None:
        ijb_results[ijb.name.upper()] = evaluate_ijb(
            model, args["in_shape"], ijb.root, ijb.name, batch_size, ijb.flip, ijb.norm_score, ijb.detector_score,
            ijb.workers, progress=print_progress())
    ident = {os.path.normpath(d): evaluate_identification(model, d, batch_size, flip, seed) for d in identification_dirs}
    report = {"backbone": os.path.normpath(backbone), "model": args, "flip": flip, "batch_size": batch_size,
              "pairs": {s.name: os.path.normpath(p) for s, p in zip(sets, pairs_paths)}, "sets": results,
              "all_pairs": all_pairs, "ijb": ijb_results, "identification": ident}
    json_path, png_path = os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "roc.png")
    write_text(json_path, json.dumps(jsonable(report), indent=1))
    files = {"json": json_path, "roc": plot_roc(results, png_path) if results else None}
    for name, m in ijb_results.items():
        files[f"roc_{name.lower()}"] = plot_roc({name: {"backbone": m}}, os.path.join(out_dir, f"roc-{name.lower()}.png"))
    report["files"] = files
    report["tables"] = [format_table(name, rows) for name, rows in results.items()]
    report["tables"] += [format_all_pairs(d, m) for d, m in all_pairs.items()]
    report["tables"] += [format_ijb(m) for m in ijb_results.values()]
    report["tables"] += [format_identification(d, m) for d, m in ident.items()]
    return report
