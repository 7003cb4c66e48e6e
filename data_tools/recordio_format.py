"""MXNet/InsightFace RecordIO (``train.rec`` + ``train.idx``) read in pure Python, no mxnet.

The format (dmlc-core ``recordio.h``, MXNet ``recordio.py``):

* a record is ``uint32 magic = 0xced7230a``, ``uint32 lrecord``, then ``length`` payload bytes padded with
  zeros to a multiple of 4; ``lrecord``'s upper 3 bits are a continuation flag (0 whole record, 1 first,
  2 middle, 3 last part) and its lower 29 bits the length. A payload that itself contains the magic word
  at a 4-byte boundary is split there and the magic dropped; the reader puts it back between the parts.
* a payload is an IRHeader ``struct 'IfQQ' (flag, label, id, id2)`` (24 bytes); when ``flag > 0``, ``flag``
  float32 labels follow the header (and the ``label`` field is unused); the encoded image follows.
* ``.idx`` is text, one ``key<TAB>offset`` line per record (offset of the record's magic word).

InsightFace training sets (MS1M, Glint360K, WebFace42M...) start with a header record (key 0) with
``flag > 0`` whose labels are ``(a, b)`` and no image: image records are keys ``1 .. a-1``, and keys ``a .. b-1`` are
per-identity records (label ``(first, last+1)`` image keys) that carry no image. Without such a header
(key 0 with labels and no image bytes), every key in the index is an image record. An image's class is its first label.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, List, Tuple

import numpy as np

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_IR_FORMAT = "IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)
_LEN_MASK = (1 << 29) - 1


def rec_idx_paths(prefix: str) -> Tuple[str, str]:
    """(PREFIX.rec, PREFIX.idx) from a prefix or either file's name; a missing one is an error naming it."""
    for ext in (".rec", ".idx"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    rec, idx = prefix + ".rec", prefix + ".idx"
    for p in (rec, idx):
        if not os.path.isfile(p):
            raise ValueError(f"{p}: missing (recordio expects PREFIX.rec and PREFIX.idx)")
    return rec, idx


class RecordIOError(ValueError):
    pass


def read_index(idx_path: str) -> Dict[int, int]:
    """{key: byte offset} from a ``.idx`` file."""
    index: Dict[int, int] = {}
    with open(idx_path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split("\t") if "\t" in line else line.split()
            if len(parts) != 2:
                raise RecordIOError(f"{idx_path}:{n}: expected 'key<TAB>offset', got {line!r}")
            index[int(parts[0])] = int(parts[1])
    return index


def _read_part(f, path: str, offset: int) -> Tuple[int, bytes]:
    head = f.read(8)
    if len(head) < 8:
        raise RecordIOError(f"{path}: truncated record at byte {offset}")
    magic, lrec = struct.unpack("<II", head)
    if magic != MAGIC:
        raise RecordIOError(f"{path}: bad magic 0x{magic:08x} at byte {offset} (not a RecordIO record)")
    cflag, length = lrec >> 29, lrec & _LEN_MASK
    data = f.read(length)
    if len(data) < length:
        raise RecordIOError(f"{path}: record at byte {offset} is truncated ({len(data)} of {length} bytes)")
    f.read((4 - length % 4) % 4)
    return cflag, data


def read_record_at(path: str, offset: int) -> bytes:
    """The payload of the record that starts at ``offset`` (parts joined with the magic word)."""
    with open(path, "rb") as f:
        return read_record(f, path, offset)


def read_record(f, path: str, offset: int) -> bytes:
    """`read_record_at` on an open file (a streaming build keeps one handle per worker: opening the
    file for every record of a multi-million-record set costs more than reading a small record)."""
    f.seek(offset)
    cflag, data = _read_part(f, path, offset)
    if cflag == 0:
        return data
    if cflag != 1:
        raise RecordIOError(f"{path}: record at byte {offset} starts with continuation flag {cflag}")
    parts = [data]
    while cflag != 3:
        cflag, data = _read_part(f, path, f.tell())
        if cflag not in (2, 3):
            raise RecordIOError(f"{path}: record at byte {offset} has a broken continuation ({cflag})")
        parts.append(data)
    return _MAGIC_BYTES.join(parts)


def read_index_arrays(idx_path: str, block: int = 1 << 20) -> Tuple[np.ndarray, np.ndarray]:
    """(keys, offsets), int64 arrays sorted by key, from a ``.idx`` file, read in 1 MiB blocks
    (each block is split into Python strings: ~7 MB transient; 16 MiB blocks cost ~110 MB, measured).

    The dict of `read_index` costs ~100 bytes per record in Python objects (~4 GB for 42M records);
    these arrays cost 16 bytes per record.
    """
    lines = 0                                     # pass 1: an upper bound of the records (lines)
    with open(idx_path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            lines += chunk.count(b"\n") + 1
    k = np.empty(lines, np.int64)                 # pass 2: parse into the arrays (no list + concatenate:
    o = np.empty(lines, np.int64)                 # 16 bytes/sample less at the peak)
    n, tail = 0, b""
    with open(idx_path, "rb") as f:
        while True:
            chunk = f.read(block)
            if chunk:
                chunk = tail + chunk
                cut = chunk.rfind(b"\n") + 1
                body, tail = chunk[:cut], chunk[cut:]
            else:
                body, tail = tail, b""
            if body.strip():
                pairs = _parse_index_text(idx_path, body)
                k[n:n + len(pairs)], o[n:n + len(pairs)] = pairs[:, 0], pairs[:, 1]
                n += len(pairs)
            if not chunk:
                break
    k, o = k[:n], o[:n]
    if len(k) > 1 and not (k[1:] > k[:-1]).all():     # im2rec writes keys in order: no sort, no copy
        order = np.argsort(k, kind="stable")
        k, o = k[order], o[order]
    return k, o


def _parse_index_text(idx_path: str, body: bytes) -> np.ndarray:
    text = body.decode("ascii", errors="replace")
    values = np.array(text.split(), dtype=np.int64) if text.strip() else np.zeros(0, np.int64)
    if values.size % 2:
        raise RecordIOError(f"{idx_path}: expected 'key<TAB>offset' lines (an odd number of fields)")
    return values.reshape(-1, 2)


def image_key_mask(rec_path: str, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`image_keys` on sorted key/offset arrays: a bool mask of the image records."""
    if not len(keys):
        return np.zeros(0, bool)
    payload = read_record_at(rec_path, int(offsets[0]))
    flag, labels, _, _, start = unpack_header(payload)
    if keys[0] == 0 and flag > 0 and len(labels) >= 2 and start == len(payload):
        return (keys >= 1) & (keys < int(labels[0]))
    return np.ones(len(keys), bool)


def record_label_from(f, rec_path: str, offset: int) -> float:
    """`record_label` on an open file."""
    f.seek(offset)
    head = f.read(8 + _IR_SIZE + 4)
    return _label_of(head, rec_path, offset, f)


def unpack_header(payload: bytes) -> Tuple[int, np.ndarray, int, int, int]:
    """(flag, labels float32 (max(flag, 1),), id, id2, image start) of a record payload."""
    if len(payload) < _IR_SIZE:
        raise RecordIOError(f"record payload of {len(payload)} bytes is shorter than its IRHeader")
    flag, label, id1, id2 = struct.unpack(_IR_FORMAT, payload[:_IR_SIZE])
    if flag > 0:
        end = _IR_SIZE + 4 * flag
        if len(payload) < end:
            raise RecordIOError(f"record payload too short for its {flag} labels")
        labels = np.frombuffer(payload[_IR_SIZE:end], dtype=np.float32).copy()
        return flag, labels, id1, id2, end
    return flag, np.array([label], dtype=np.float32), id1, id2, _IR_SIZE


def unpack_image(payload: bytes) -> Tuple[np.ndarray, bytes]:
    """(labels, encoded image bytes) of an image record."""
    _, labels, _, _, start = unpack_header(payload)
    return labels, payload[start:]


def image_keys(rec_path: str, index: Dict[int, int]) -> List[int]:
    """The keys of the image records (InsightFace's header convention, see the module docstring)."""
    if not index:
        return []
    first = min(index)
    payload = read_record_at(rec_path, index[first])
    flag, labels, _, _, start = unpack_header(payload)
    # The header record carries no image: that tells it apart from a multi-label image record at key 0.
    if first == 0 and flag > 0 and len(labels) >= 2 and start == len(payload):
        end = int(labels[0])
        return [k for k in range(1, end) if k in index]
    return sorted(index)


def record_label(rec_path: str, offset: int) -> float:
    """The class label of one image record, reading only its header (not the image)."""
    with open(rec_path, "rb") as f:
        f.seek(offset)
        head = f.read(8 + _IR_SIZE + 4)
        return _label_of(head, rec_path, offset, f)


def _label_of(head: bytes, rec_path: str, offset: int, f) -> float:
    if len(head) < 8 + _IR_SIZE:
        raise RecordIOError(f"{rec_path}: truncated record at byte {offset}")
    magic, lrec = struct.unpack("<II", head[:8])
    if magic != MAGIC:
        raise RecordIOError(f"{rec_path}: bad magic 0x{magic:08x} at byte {offset}")
    if lrec >> 29 or (lrec & _LEN_MASK) < _IR_SIZE + 4:     # a split or tiny record: read it whole
        _, labels, _, _, _ = unpack_header(read_record(f, rec_path, offset))
        return float(labels[0])
    flag, label, _, _ = struct.unpack(_IR_FORMAT, head[8:8 + _IR_SIZE])
    if flag > 0:
        if len(head) < 8 + _IR_SIZE + 4:
            raise RecordIOError(f"{rec_path}: truncated labels at byte {offset}")
        return float(np.frombuffer(head[8 + _IR_SIZE:8 + _IR_SIZE + 4], dtype=np.float32)[0])
    return float(label)
