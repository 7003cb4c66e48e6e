"""Picking and exporting the trained backbone, and summarising a run. No Horovod needed here.

Since all ranks' backbones are bitwise identical (verified by digest at every checkpoint), the backbone is
stored once. Exporting "rank K's copy" therefore means: check that every rank recorded the same digest,
that rank K's recorded digest is the digest of the stored backbone (recomputed from the file), and write
that backbone as a standalone file (a plain ``torch.load``-able dict; ``models.pretrained.load_backbone`` rebuilds the
module). When the ranks' digests differ (a run that diverged), export refuses: there is no single model.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from ..run_files import load_file, read_meta, resolve_checkpoint
from ..run.watch.stragglers import read_events
from .. import atomic
from ..digest import state_dict_digest


class ExportError(RuntimeError):
    pass


def run_summary(path: str) -> Dict[str, Any]:
    """The JSON of ``hvd-partialfc info``: world size, step, slices, classifier shapes, digests, and the
    stragglers the run named or evicted (run/watch/stragglers.py)."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    ranks = []
    for r, name in enumerate(meta["classifier_files"]):
        f = os.path.join(ckpt, name)
        entry: Dict[str, Any] = {"rank": r, "label_start": meta["slices"][r][0], "label_end": meta["slices"][r][1],
                                 "digest": meta["digests"][r], "file": name}
        if os.path.isfile(f):
            state = load_file(f, "classifier checkpoint")
            entry["classifier_shape"] = list(state["weight"].shape)
        else:
            entry["classifier_shape"] = None
        ranks.append(entry)
    return {"checkpoint": ckpt, "step": meta["step"], "total_steps": meta.get("total_steps"),
            "world_size": meta["world_size"], "num_classes": meta["num_classes"], "model": meta["model"],
            "digests_agree": len(set(meta["digests"])) == 1, "ranks": ranks,
            # the run folder's straggler events (checkpoints/step-X sits two levels below it)
            "stragglers": read_events(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))))}


def verified_backbone(path: str, rank: int = 0) -> Tuple[Dict[str, Any], Dict[str, Any], str]:
    """(backbone file contents, meta.json, digest) of the run/checkpoint at ``path``, once every rank's
    recorded digest agrees and rank ``rank``'s equals the stored backbone's (recomputed from the file)."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    digests: List[str] = meta["digests"]
    if not 0 <= rank < len(digests):
        raise ExportError(f"--rank {rank}: the run has ranks 0..{len(digests) - 1}")
    if len(set(digests)) != 1:
        detail = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise ExportError(f"{ckpt}: the ranks' backbones differ ({detail}); refusing to export one as the model")
    src = os.path.join(ckpt, "backbone.pt")
    state = load_file(src, "backbone checkpoint")
    actual = state_dict_digest(state["state_dict"])
    if actual != digests[rank]:
        raise ExportError(f"{src}: digest {actual[:12]} does not match rank {rank}'s recorded {digests[rank][:12]}")
    return state, meta, actual


def export_backbone(path: str, out: str, rank: int = 0) -> Dict[str, Any]:
    """Write rank ``rank``'s backbone of the run/checkpoint at ``path`` to ``out``; returns what was written."""
    state, meta, actual = verified_backbone(path, rank)
    payload = {"format": "hvd_partialfc.exported_backbone", "model": state["model"],
               "state_dict": state["state_dict"], "digest": actual, "step": meta["step"], "rank": rank}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic.torch_save(payload, out)
    return {"out": out, "digest": actual, "step": meta["step"], "rank": rank,
            "model": state["model"]}
