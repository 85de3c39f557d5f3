"""Typed configs from YAML: dataclasses in, dataclasses out, every key checked.

``from_dict(TrainConfig, yaml_dict)`` builds nested frozen dataclasses, checking each
value against its annotation (``int``, ``float``, ``bool``, ``str``, ``Literal``,
``Optional``, ``list``/``tuple``/``dict`` of those, nested dataclasses). An unknown key
names itself, its path and the valid keys; an ill-typed value names its path, the type
wanted and the value given. ``apply_overrides`` takes ``dotted.key=value`` strings from
the command line, values parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted path."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not a valid choice; valid: {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path=path)
    if origin in (list, Sequence, tuple) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_tp, val_tp = args if args else (Any, Any)
        return {_convert(key_tp, k, path): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot read a {_type_name(tp)} from {value!r}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value."""
    if data is None:
        data = {}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        where = f"{path}.{key}" if path else key
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown config key {where!r}{hint}; valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        where = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, where)
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = ", ".join(f"{path}.{m}" if path else m for m in missing)
        raise ConfigError(f"missing required config key(s): {where}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path or cls.__name__}: {err}") from err


def to_dict(config: Any) -> Any:
    """Plain, YAML/JSON-able form of a config dataclass (tuples become lists)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict (values parsed as YAML scalars)."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_yaml(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    return data
