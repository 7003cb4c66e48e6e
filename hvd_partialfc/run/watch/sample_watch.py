"""The trainer's side of ``data.on_bad_sample: skip``: each bad sample named once, counted, and the limit.

Contract:
* ``batch(b)`` (the step shows it every batch it draws: step.py's watchers) notes the batch's ``bad`` list
  (data/bad_samples.py): Python lists carried with the batch, so noting costs no host synchronisation;
  ``new_lines()`` returns the lines naming the samples not named before in this process (every rank names
  its own, once);
* ``agree(comm)``, at log steps and under ``skip`` only: one ``allgather_object`` of every rank's distinct
  bad samples and replacements by shard file, so every rank sees the same totals: ``bad_samples`` (distinct
  samples found so far, over all ranks; ranks read disjoint shards, so the per-rank counts add up) and
  ``bad_samples_replaced`` (draws replaced), both written to metrics.jsonl;
* above ``data.max_bad_samples`` (a count, or a fraction < 1 of the set's samples; 0: none) ``error`` holds
  the message naming the shards, the same on every rank: ``due`` then, the trainer writes the step's checkpoint and
  raises it. Counted since this process started: a resumed run finds its bad samples again as it draws them.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional


class SampleWatch:
    def __init__(self, policy: str, max_bad: float, num_samples: int):
        self.active = policy == "skip"
        self.limit = max_bad if max_bad >= 1 or max_bad == 0 else max_bad * num_samples
        self.max_bad, self.num_samples = max_bad, num_samples
        self.found: Dict[tuple, str] = {}      # (file, sample) -> its line
        self.by_file: Counter = Counter()      # distinct bad samples per shard file (this rank's)
        self.replaced = 0
        self._new: List[str] = []
        self.error: Optional[str] = None

    def batch(self, batch) -> None:
        """A batch the step drew (a step watcher's hook, step.py)."""
        for record in getattr(batch, "bad", ()):
            self.replaced += 1
            if record.key not in self.found:
                self.found[record.key] = str(record)
                self.by_file[record.file] += 1
                self._new.append(str(record))

    def due(self, done: int, final: bool) -> bool:
        """Too many bad samples (set at a log step, the same on every rank): checkpoint, then stop."""
        return self.error is not None

    def new_lines(self) -> List[str]:
        lines, self._new = self._new, []
        return lines

    def agree(self, comm) -> Dict[str, int]:
        """The totals over all ranks (a collective: every rank calls it at the same log step); sets ``error``
        when they pass the limit."""
        ranks = comm.allgather_object((len(self.found), self.replaced, dict(self.by_file)), name="log.bad_samples")
        total, replaced = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
        if self.limit and total > self.limit:
            shards = sorted(((n, rank, f) for rank, r in enumerate(ranks) for f, n in r[2].items()), reverse=True)
            named = ", ".join(f"rank {rank}: {f} ({n})" for n, rank, f in shards)
            what = f"{self.limit:g} samples" if self.max_bad >= 1 else \
                f"{self.max_bad:g} of the set's {self.num_samples} samples = {self.limit:g}"
            self.error = (f"{total} distinct samples cannot be decoded, over data.max_bad_samples={self.max_bad:g} "
                          f"({what}); by shard: {named}. Rebuild the set without them (`hvd-partialfc-shards "
                          f"inspect SET --decode` lists them and gives the build command), or raise the limit")
        return {"bad_samples": total, "bad_samples_replaced": replaced}
