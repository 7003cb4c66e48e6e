"""``recordio PREFIX``: InsightFace/MXNet ``PREFIX.rec`` + ``PREFIX.idx``, read without mxnet.

Only the record headers are read here (the label of each image record); the image bytes are read by the
worker processes of `data_tools.storage.to_storage`, through `RecordRef`. PREFIX may also be given as the
``.rec`` or ``.idx`` path. See `data_tools.recordio_format` for the format.
"""
from __future__ import annotations

import os

from .importer_registry import register_importer
from ..imported import ImportedData
from ..recordio_format import image_keys, read_index, rec_idx_paths, record_label
from ..storage import RecordRef


@register_importer("recordio")
def import_recordio(prefix: str, **_) -> ImportedData:
    rec, idx = rec_idx_paths(prefix)
    index = read_index(idx)
    keys = image_keys(rec, index)
    refs = [RecordRef(rec, index[k], k) for k in keys]
    labels = []
    for r in refs:
        y = record_label(rec, r.offset)
        if y != int(y) or y < 0:
            raise ValueError(f"{rec}: record {r.key} has label {y}, expected a non-negative integer class id")
        labels.append(int(y))
    return ImportedData("refs", refs, labels, {"format": "recordio", "path": os.path.abspath(rec),
                                               "records": len(index), "images": len(keys)})
