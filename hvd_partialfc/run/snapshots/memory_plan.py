"""Memory snapshots' plan (memory.py): which ranks share a node, whose copies a node holds, how large a rank's
file and a node's backbone are, and the most a buddy takes. Arithmetic over sizes and node keys only: no
collective, no file, no Horovod (estimate's host terms, tools/estimate.py, follow the same rules).
"""
from __future__ import annotations

from typing import Dict, List, Optional


def state_slots(optim_name: str, momentum: float) -> int:
    """Optimizer tensors per parameter tensor: SGD's momentum (none without), AdamW's two moments."""
    return 2 if optim_name == "adamw" else int(momentum > 0)


def snapshot_bytes(parts, optim) -> Dict[str, int]:
    """A rank's snapshot file (its classifier rows and their optimizer state) and the node's backbone file
    (parameters, buffers, optimizer state), in bytes, from the tensors themselves (the optimizers' state is
    made at the first step, so it is counted from their settings)."""
    w = parts.head.weight
    head = w.numel() * w.element_size() * (1 + state_slots(optim.name, optim.classifier_momentum))
    params = sum(p.numel() * p.element_size() for p in parts.backbone.parameters())
    buffers = sum(b.numel() * b.element_size() for b in parts.backbone.buffers())
    backbone = params * (1 + state_slots(optim.name, optim.backbone_momentum)) + buffers
    return {"rank": head + buffers, "backbone": backbone}


def put_limit(parts, sizes: Dict[str, int]) -> int:
    """The most bytes a rank's snapshot file can take (its buddy refuses a larger copy): its rows, their
    optimizer state and its buffers (``sizes``), the head's extra state (the negatives' rows), and 1 MB and 1%
    for what the file adds (counters, random streams, the pickle's own bytes: about 19 KB, measured on a
    22.6 KB file of 3 KB of rows)."""
    return sizes["rank"] + parts.head.extra_state_bytes() + (1 << 20) + sizes["rank"] // 100


class Plan:
    """Which ranks share a node (the same ``node_key``), each node's first rank, and each rank's buddy."""

    def __init__(self, keys: List[str]):
        self.keys = keys
        self.nodes: List[List[int]] = []
        index: Dict[str, int] = {}
        for r, k in enumerate(keys):
            if k not in index:
                index[k] = len(self.nodes)
                self.nodes.append([])
            self.nodes[index[k]].append(r)
        self.node_of = [index[k] for k in keys]

    def writer(self, rank: int) -> int:
        return self.nodes[self.node_of[rank]][0]

    def buddy(self, rank: int) -> Optional[int]:
        """The rank in the same place on the next node; None on one node (its copy would die with it)."""
        if len(self.nodes) < 2:
            return None
        n = self.node_of[rank]
        here, there = self.nodes[n], self.nodes[(n + 1) % len(self.nodes)]
        return there[here.index(rank) % len(there)]

    def hosted(self, node: int) -> List[int]:
        """The ranks whose files a node holds: its own, and those whose buddy is on it."""
        return sorted(set(self.nodes[node]) | {r for r in range(len(self.keys))
                                              if self.buddy(r) is not None and self.node_of[self.buddy(r)] == node})
