"""Character sets for the ``fonts`` importer.

* ``gb2312-1``: the 3,755 level-1 Hanzi of GB 2312 (rows 16-55; row 55 ends at column 89), decoded with
  Python's ``gb2312`` codec;
* ``jis-1``: the 2,965 level-1 Kanji of JIS X 0208 (rows 16-47; row 47 ends at column 51), via ``euc_jp``;
* ``cjk``: every code point of the CJK Unified Ideographs block (U+4E00-U+9FFF, 20,992) and of its
  Extension A (U+3400-U+4DBF, 6,592), 27,584 in code point order; which of them a font set really covers
  is decided by the ``fonts`` importer (``--min-families``), not here;
* anything else is a UTF-8 text file: its distinct non-whitespace characters, in file order.

Both tables are read cell by cell (row r, column c -> bytes 0xA0+r, 0xA0+c) and the cells the codec
rejects are the unassigned ones, so the counts above are checked, not assumed.
"""
from __future__ import annotations

import os
from typing import List

CHARSETS = {"gb2312-1": ("gb2312", 16, 55, 3755), "jis-1": ("euc_jp", 16, 47, 2965)}
RANGES = {"cjk": ((0x3400, 0x4DBF), (0x4E00, 0x9FFF))}     # inclusive code point ranges


def _table(codec: str, first_row: int, last_row: int) -> List[str]:
    out = []
    for row in range(first_row, last_row + 1):
        for col in range(1, 95):
            try:
                ch = bytes([0xA0 + row, 0xA0 + col]).decode(codec)
            except UnicodeDecodeError:
                continue
            if len(ch) == 1:
                out.append(ch)
    return out


def load_charset(name: str) -> List[str]:
    if name in RANGES:
        return [chr(c) for a, b in RANGES[name] for c in range(a, b + 1)]
    if name in CHARSETS:
        codec, a, b, expect = CHARSETS[name]
        chars = _table(codec, a, b)
        if len(chars) != expect:
            raise RuntimeError(f"charset {name}: decoded {len(chars)} characters, expected {expect}")
        return chars
    if not os.path.isfile(name):
        raise ValueError(f"unknown charset {name!r}: neither one of {', '.join([*CHARSETS, *RANGES])} nor a file")
    with open(name, encoding="utf-8") as f:
        text = f.read()
    seen, out = set(), []
    for ch in text:
        if not ch.isspace() and ch not in seen:
            seen.add(ch)
            out.append(ch)
    if not out:
        raise ValueError(f"{name}: the character file holds no characters")
    return out
