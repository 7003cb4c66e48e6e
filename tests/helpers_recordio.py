"""A small MXNet RecordIO writer for tests, written from the format (dmlc-core ``recordio.cc``
``RecordIOWriter::WriteRecord`` and MXNet ``recordio.pack``), independently of `data_tools.recordio_format`.

``write_rec(prefix, images, labels)`` writes an InsightFace-style ``prefix.rec``/``prefix.idx``: record 0
is the header (flag 2, labels (first identity key, end of identity keys)), keys 1..N are images with
float labels, then one identity record per class with the (first, last+1) image keys.
"""
from __future__ import annotations

import struct
from typing import List, Optional, Sequence

MAGIC = 0xCED7230A


def pack(flag: int, label, id1: int, payload: bytes, id2: int = 0) -> bytes:
    """MXNet ``recordio.pack``: IRHeader 'IfQQ', then the float32 labels when flag > 0, then the payload."""
    if isinstance(label, (list, tuple)):
        head = struct.pack("IfQQ", len(label), 0.0, id1, id2) + struct.pack(f"{len(label)}f", *label)
    else:
        head = struct.pack("IfQQ", flag, float(label), id1, id2)
    return head + payload


def encode_record(data: bytes) -> bytes:
    """dmlc WriteRecord: split where the magic word appears at a 4-byte boundary (the magic is dropped
    and re-inserted by the reader), each part as magic, lrecord (cflag << 29 | length), data, zero padding."""
    out = bytearray()
    magic = struct.pack("<I", MAGIC)
    aligned = len(data) & ~3
    start, parts = 0, []
    for i in range(0, aligned, 4):
        if data[i:i + 4] == magic:
            parts.append(data[start:i])
            start = i + 4
    parts.append(data[start:])
    for k, part in enumerate(parts):
        if len(parts) == 1:
            cflag = 0
        else:
            cflag = 1 if k == 0 else (3 if k == len(parts) - 1 else 2)
        out += struct.pack("<II", MAGIC, (cflag << 29) | len(part)) + part + b"\0" * ((4 - len(part) % 4) % 4)
    return bytes(out)


def write_rec(prefix: str, images: Sequence[bytes], labels: Sequence[int], header: bool = True,
              multi_label: Optional[Sequence[Sequence[float]]] = None) -> None:
    records: List[tuple] = []
    n = len(images)
    classes = sorted(set(labels))
    if header:
        records.append((0, pack(2, [float(n + 1), float(n + 1 + len(classes))], 0, b"")))
    for i, (img, y) in enumerate(zip(images, labels)):
        label = list(multi_label[i]) if multi_label is not None else float(y)
        records.append((i + 1 if header else i, pack(0, label, i, img)))
    if header:
        for j, c in enumerate(classes):
            keys = [i + 1 for i, y in enumerate(labels) if y == c]
            records.append((n + 1 + j, pack(2, [float(keys[0]), float(keys[-1] + 1)], 0, b"")))
    offset = 0
    with open(prefix + ".rec", "wb") as rec, open(prefix + ".idx", "w") as idx:
        for key, payload in records:
            blob = encode_record(payload)
            idx.write(f"{key}\t{offset}\n")
            rec.write(blob)
            offset += len(blob)
