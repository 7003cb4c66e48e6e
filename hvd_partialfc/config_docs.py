"""Every config key as a table, from the fields themselves: ``hvd-partialfc config --list`` (plain text) and
``--markdown`` (docs/configuration.md, which tests/test_config_docs.py compares with a fresh rendering).

A key declared without ``opt(default, help, ...)`` is an error here, not a silent gap in the page: a key
added in the old style (a bare default and a comment) fails ``config --list`` and the test until it gets
its line of help.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Dict, List, Optional

from .config import Config, ConfigError, iter_keys, resume_policy

PAGE = os.path.join("docs", "configuration.md")


def key_rows(cfg_class: type = Config) -> List[Dict[str, str]]:
    """One row per key: key, default, choices, help, see, resume ("free", "extends" or "fixed")."""
    free_keys, extend_keys = resume_policy()   # declared beside each key (config.opt's resume=)
    rows, missing = [], []
    for key, f in iter_keys(cfg_class):
        meta = f.metadata
        if not meta.get("help") or "\n" in meta["help"]:
            missing.append(key)
            continue
        see = meta.get("see", "")
        if see and not (see.startswith("docs/") and ".md#" in see):
            raise ConfigError(f"config key {key}: see={see!r} is not docs/PAGE.md#anchor")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        free = any(key == k or key.startswith(k + ".") for k in free_keys)
        rows.append({"key": key, "default": json.dumps(default), "choices": " | ".join(meta.get("choices", ())),
                     "help": meta["help"], "see": see,
                     "resume": "free" if free else "extends" if key in extend_keys else "fixed"})
    if missing:
        raise ConfigError(f"config keys without a one-line help: {', '.join(missing)}; declare each with "
                          "opt(default, help, choices=..., see=...) in hvd_partialfc/config.py")
    return rows


def plain_table(rows: List[Dict[str, str]]) -> str:
    """Aligned columns for a terminal: key, default, choices, what it does."""
    cols = ("key", "default", "choices", "help")
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols[:-1]}
    line = lambda r: "  ".join(r[c].ljust(width[c]) for c in cols[:-1]) + "  " + r["help"]
    return "\n".join([line({c: c for c in cols})] + [line(r) for r in rows])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(rows: List[Dict[str, str]]) -> str:
    """docs/configuration.md: one table per section, each key's docs link beside it."""
    out = ["# Configuration: every key, its default and what it does", "",
           "Generated from `hvd_partialfc/config.py` (`hvd-partialfc config --markdown docs/configuration.md`;",
           "`tests/test_config_docs.py` fails when they disagree). Set a key in the `--config` YAML or with",
           "`--set section.key=value`. On resume `free` keys may change, `extends` ones may grow (the lr schedule",
           "follows), `fixed` ones must match the checkpoint's. The linked page has each key's caveats.", ""]
    for sec, group in itertools.groupby(rows, key=lambda r: r["key"].split(".")[0] if "." in r["key"] else "run"):
        out += [f"## {sec}", "", "| key | default | choices | what it does | on resume | more |",
                "|---|---|---|---|---|---|"]
        for r in group:
            target = r["see"][len("docs/"):]      # the page lives in docs/
            link = f"[{target.split('#')[0]}]({target})" if target else ""
            choices = ", ".join(f"`{c}`" for c in r["choices"].split(" | ")) if r["choices"] else ""
            out.append(f"| `{r['key']}` | `{_cell(r['default'])}` | {choices} | {_cell(r['help'])} | "
                       f"{r['resume']} | {link} |")
        out.append("")
    return "\n".join(out)


def write_markdown(path: Optional[str]) -> str:
    """Render the page; write it to ``path`` ("-" or None: return it only)."""
    text = markdown(key_rows())
    if path and path != "-":
        with open(path, "w") as f:
            f.write(text)
    return text
