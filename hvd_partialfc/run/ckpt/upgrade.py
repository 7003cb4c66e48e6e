"""``hvd-partialfc upgrade``: checkpoints of format 1 rewritten as format 2, on request only (the one place
that unpickles freely: run it only on checkpoints you wrote)."""
from __future__ import annotations

import json
import os
from typing import Any, List

import numpy as np
import torch

from ... import atomic
from ...run_files import CHECKPOINTS, FORMAT_VERSION, CheckpointError, list_checkpoints, load_file, read_meta

def _upgrade_rng(rng: Any) -> Any:
    if rng is None or not isinstance(rng.get("numpy"), tuple):
        return rng
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    out = dict(rng)
    out["numpy"] = {"kind": kind, "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    return out


def upgrade_checkpoint(ckpt_dir: str) -> bool:
    """Rewrite one format-1 checkpoint folder as format 2 (files loadable with weights_only=True).

    This is the one place that unpickles freely: run it only on checkpoints you wrote. Each file is
    rewritten atomically, meta.json last, so an interrupted upgrade can simply be run again. Returns
    False when the folder is already format 2.
    """
    meta = read_meta(ckpt_dir, check_version=False)
    if meta.get("format_version", 1) >= FORMAT_VERSION:
        return False
    for name in ["backbone.pt"] + list(meta["classifier_files"]):
        path = os.path.join(ckpt_dir, name)
        obj = torch.load(path, map_location="cpu", weights_only=False)  # trusted by the user's request
        if "rng" in obj:
            obj["rng"] = _upgrade_rng(obj["rng"])
        if "counters" not in obj and name != "backbone.pt":
            obj["counters"] = {k: obj.pop(k) for k in ("loss_scale", "skipped_steps") if k in obj}
        atomic.torch_save(obj, path)
        load_file(path)  # proves the new file is weights_only-loadable
    meta["format_version"] = FORMAT_VERSION
    atomic.write_text(os.path.join(ckpt_dir, "meta.json"), json.dumps(meta, indent=1))
    return True


def upgrade_run(path: str) -> List[str]:
    """Upgrade a checkpoint folder, or every complete checkpoint of a run folder; returns those rewritten."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        folders = [path]
    else:
        base = os.path.join(path, CHECKPOINTS)
        folders = [os.path.join(base, d) for d in list_checkpoints(path)]
        if not folders:
            raise CheckpointError(f"{path}: no checkpoint folder (meta.json) and no {CHECKPOINTS}/step-*")
    return [d for d in folders if upgrade_checkpoint(d)]
