"""docs/configuration.md is generated from config.py's fields: it matches the code, every key has its help,
the listed choices are validate()'s, and every docs link lands on a heading."""
import dataclasses
import os
import re

import pytest

from hvd_partialfc.config import Config, ConfigError, get_key, iter_keys, opt
from hvd_partialfc.config_io import load_config
from hvd_partialfc.config_docs import PAGE, key_rows, markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configuration_page_matches_the_code():
    with open(os.path.join(ROOT, PAGE)) as f:
        page = f.read()
    assert page == markdown(key_rows()), \
        "docs/configuration.md is stale: run `hvd-partialfc config --markdown docs/configuration.md`"
    keys = [k for k, _ in iter_keys()]
    flat = [f"{s}.{k}" if isinstance(v, dict) else s     # independent of iter_keys: the config's own dict
            for s, v in Config().to_dict().items() for k in (v if isinstance(v, dict) else [None])]
    assert keys == flat and all(f"| `{k}` |" in page for k in keys)


@dataclasses.dataclass
class _Section:
    documented: int = opt(1, "a key with its line")
    bare: int = 2          # declared the old way: a comment the program cannot read


@dataclasses.dataclass
class _WithBareKey:
    sec: _Section = dataclasses.field(default_factory=_Section)


def test_a_key_without_help_fails_loudly():
    with pytest.raises(ConfigError, match=r"without a one-line help: sec\.bare; declare each with opt"):
        key_rows(_WithBareKey)


def test_listed_choices_are_the_ones_validate_accepts():
    rows = {r["key"]: r for r in key_rows()}
    with_choices = [k for k, f in iter_keys() if f.metadata["choices"]]
    assert len(with_choices) >= 10
    for key in with_choices:
        listed = rows[key]["choices"].split(" | ")
        for value in listed:
            assert get_key(load_config(None, ["data.shards=/x", f"{key}={value}"]), key) == value
        with pytest.raises(ConfigError, match=f"expected one of {', '.join(listed)}"):
            load_config(None, ["data.shards=/x", f"{key}=not-a-choice"])


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    with open(path) as f:
        heads = [l.lstrip("#").strip() for l in f if re.match(r"#{1,6} ", l)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_docs_link_lands_on_a_heading():
    linked = [(k, f.metadata["see"]) for k, f in iter_keys() if f.metadata["see"]]
    assert len(linked) >= 40
    for key, see in linked:
        page, anchor = see.split("#")
        assert anchor in _anchors(os.path.join(ROOT, page)), f"{key}: {see} names no heading of {page}"


def test_config_list_prints_every_key(capsys):
    from hvd_partialfc.cli import main
    assert main(["config", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [l.split()[0] for l in out[1:]] == [k for k, _ in iter_keys()]
    precision = next(l for l in out if l.startswith("train.precision "))
    assert '"fp32"' in precision and "fp32 | bf16 | fp16" in precision
