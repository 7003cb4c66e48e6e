"""Start a backbone from a file: ``hvd-partialfc train --init-backbone FILE`` (``model.init_backbone``).

Two formats are read, both with ``torch.load(weights_only=True)`` (``checkpoint.load_file``: no code in
the file runs):

* a backbone of this package: an ``hvd-partialfc export`` file, or a checkpoint's ``backbone.pt`` (a dict
  with ``model`` = the builder's arguments and ``state_dict``); its backbone name and embedding size must be
  the config's;
* a plain ``state_dict`` (name -> tensor), such as arcface_torch's ``backbone.pth`` for ``iresnet*``
  (``r18`` .. ``r200``) and ``mobilefacenet`` (``mbf``); a ``module.`` prefix on every key (a model saved
  from inside DistributedDataParallel) is dropped.

The keys must match exactly: an error names the file and lists the missing and unexpected keys and the
shape mismatches. Only the backbone is read; the classifier starts fresh.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..run_files import load_file, resolve_checkpoint


class InitBackboneError(ValueError):
    pass


def read_backbone_file(path: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """(state_dict, the builder's arguments or None for a plain state_dict) of a backbone file."""
    obj = load_file(path, "backbone file")
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict) and isinstance(obj.get("model"), dict):
        return obj["state_dict"], obj["model"]
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in obj.items()):
        if all(k.startswith("module.") for k in obj):
            obj = {k[len("module."):]: v for k, v in obj.items()}
        return obj, None
    raise InitBackboneError(f"{path}: neither a backbone of this package (export / checkpoint backbone.pt) nor "
                            "a plain state_dict of tensors")


def _list(keys: List[str], limit: int = 8) -> str:
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def key_mismatch(model: nn.Module, state: Dict[str, torch.Tensor]) -> List[str]:
    """Human-readable differences between ``model``'s state_dict and ``state`` (empty: they fit)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {list(state[k].shape)} != {list(own[k].shape)}" for k in own
              if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    out = []
    if missing:
        out.append(f"{len(missing)} missing keys: {_list(missing)}")
    if unexpected:
        out.append(f"{len(unexpected)} unexpected keys: {_list(unexpected)}")
    if shapes:
        out.append(f"{len(shapes)} shape mismatches (file != model): {_list(shapes)}")
    return out


def load_initial_backbone(model: nn.Module, path: str, model_args: Dict[str, Any]) -> Dict[str, Any]:
    """Copy the backbone weights (parameters and BatchNorm buffers) of ``path`` into ``model``, built from
    ``model_args`` (name, embedding_dim, ...); returns what was read. Errors name the file."""
    state, args = read_backbone_file(path)
    if args is not None:
        for key in ("name", "embedding_dim"):
            if args.get(key) != model_args.get(key):
                raise InitBackboneError(f"{path}: a {args.get('name')} backbone with embedding_dim "
                                        f"{args.get('embedding_dim')}; this run's model is {model_args['name']} "
                                        f"with embedding_dim {model_args['embedding_dim']}")
    problems = key_mismatch(model, state)
    if problems:
        raise InitBackboneError(f"{path}: does not fit the {model_args['name']} backbone "
                                f"(embedding_dim {model_args['embedding_dim']}): " + "; ".join(problems))
    model.load_state_dict(state, strict=True)
    return {"path": path, "format": "hvd_partialfc" if args is not None else "state_dict", "tensors": len(state)}


def load_backbone(path: str) -> Tuple[nn.Module, Dict[str, Any]]:
    """Rebuild a backbone (on CPU, eval mode) from an exported file, a checkpoint folder or a run folder.

    The file is read with ``weights_only=True``: a downloaded file cannot run code here."""
    if os.path.isdir(path):
        path = os.path.join(resolve_checkpoint(path), "backbone.pt")
    state = load_file(path, "backbone file")
    return build_backbone(state["model"], state["state_dict"]), state["model"]


def build_backbone(m: Dict[str, Any], state_dict: Dict[str, Any]) -> nn.Module:
    """The backbone described by ``m`` (a file's ``model``: name, in_shape, embedding_dim, kwargs) with
    ``state_dict`` loaded, on CPU, in eval mode."""
    from .model_registry import create_model
    model = create_model(m["name"], in_shape=m["in_shape"], embedding_dim=m["embedding_dim"], **m["kwargs"])
    model.load_state_dict(state_dict)
    return model.eval()
