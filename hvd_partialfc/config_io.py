"""A config's text: YAML files and ``--set`` overrides read into ``config.Config`` (every value typed against its
field, an unknown key named with its nearest known one), written back, and compared. config.py holds the keys
and their checks; this module, how they are read and written.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, List, Optional, Sequence

import yaml

from .config import Config, ConfigError, did_you_mean, iter_keys


def _check_type(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return value
    if origin in (list, List, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return list(value)
    if origin is typing.Union:  # Optional[...], or one of several types: the first that fits
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        for arg in args[:-1] if value is not None else ():
            try:
                return _check_type(path, value, arg)
            except ConfigError:
                pass
        return None if value is None else _check_type(path, value, args[-1])
    if tp is Any:
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _merge(obj: Any, updates: Dict[str, Any], prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints:
            names = [f.name for f in dataclasses.fields(obj)]
            near = did_you_mean(key, names).replace("`", "`" + prefix, 1) or did_you_mean(   # a key of another section
                key, [k for k, _ in iter_keys() if k.rsplit(".", 1)[-1] == key], cutoff=0)
            raise ConfigError(f"unknown config key {path!r}{near or '; known here: ' + ', '.join(names)}"
                              " (`hvd-partialfc config --list` lists every key)")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
            _merge(current, value, path + ".")
        else:
            if value is False and "off" in _field(obj, key).metadata.get("choices", ()):
                value = "off"   # YAML reads a bare `off` as False (train.stragglers: off)
            setattr(obj, key, _check_type(path, value, hints[key]))


def _field(obj: Any, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(obj) if f.name == name)


def parse_override(text: str) -> Dict[str, Any]:
    """'optim.backbone_lr=0.05' -> {'optim': {'backbone_lr': 0.05}} (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text}: the value is not valid YAML ({' '.join(str(e).split())})") from e
    out: Dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def _read_yaml(path: str) -> Any:
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror}); give --config a YAML file "
                          "such as configs/ms1mv3_r50.yaml") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from e


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (),
                extra: Optional[Dict[str, Any]] = None) -> Config:
    """Defaults <- YAML file <- ``extra`` (CLI shortcuts) <- ``--set`` overrides, then validated."""
    cfg = Config()
    if path:
        data = _read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the config must be a mapping of sections")
        _merge(cfg, data)
    if extra:
        _merge(cfg, extra)
    for o in overrides:
        _merge(cfg, parse_override(o))
    return cfg.validate()


def config_from_dict(d: Dict[str, Any]) -> Config:
    cfg = Config()
    _merge(cfg, d)
    return cfg


def dump_config(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


def diff_configs(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two config dicts."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_configs(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} != {vb!r}")
    return out
