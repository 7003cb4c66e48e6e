"""What an importer returns (`ImportedData`): samples, original labels, their kind, and source facts.

Its own module because both sides of a build use it: the importers (`data_tools/importers/`) make it,
`data_tools.storage` turns its references into stored samples, and `data_tools.build` splits and writes
it. Kept in either of those two, it made them import each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np


@dataclass
class ImportedData:
    kind: str                      # images | encoded | features | refs (references, see storage.py)
    samples: Any                   # array (N, ...), list of encoded bytes, or list of references
    labels: Any                    # original class identities, one per sample
    source: Dict[str, Any] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    sample_shape: Optional[List[int]] = None   # decoded shape, for encoded samples
    classes: Optional[List[Any]] = None        # the classes the source declares (to detect empty ones)

    def subset(self, keep: Sequence[int]) -> "ImportedData":
        keep = np.asarray(keep, dtype=np.int64)
        samples = np.asarray(self.samples)[keep] if isinstance(self.samples, np.ndarray) \
            else [self.samples[i] for i in keep]
        labels = [self.labels[i] for i in keep]
        return ImportedData(self.kind, samples, labels, dict(self.source), list(self.skipped),
                            self.sample_shape, None)
