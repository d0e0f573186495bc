"""A config table's values: each key checked and converted by its field's annotation (`build_table`), and a
value written back as TOML (`toml_value`). The messages name the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import orjson

from draftgen.core.errors import ConfigError

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               Path: "a path string", dict: "a table", list: "a list"}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_describe(inner).removeprefix('a ').removeprefix('an ')}s"
    return _TYPE_NAMES.get(origin or tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (ints to floats, strs to Paths)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return _coerce_union(value, tp, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, not {value!r}")
        return value
    coerce = _SCALARS.get(tp)
    if coerce is None:
        raise TypeError(f"unhandled config type {tp!r}")  # a programming error, not a user one
    return coerce(value, where)


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    """`None` where the union allows it, else the first arm that takes the value."""
    if value is None and type(None) in typing.get_args(tp):
        return None
    arms = [arm for arm in typing.get_args(tp) if arm is not type(None)]
    if len(arms) == 1:  # `float | None`: the arm's own message ("must be a finite number")
        return _coerce(value, arms[0], where)
    for arm in arms:
        try:
            return _coerce(value, arm, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where} must be {_describe(tp)}, not {value!r}")


def _coerce_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    return value


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be an integer, not {value!r}")
    return value


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if not math.isfinite(value):  # TOML has nan and inf: a nan budget would never stop the run
        raise ConfigError(f"{where} must be a finite number, not {value!r}")
    return float(value)


def _no_nul(value: str, where: str) -> None:
    if "\x00" in value:  # names and paths reach the filesystem, which cannot hold a NUL
        raise ConfigError(f"{where} must not contain a NUL character (\\u0000), not {value!r}")


def _coerce_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, not {value!r}")
    _no_nul(value, where)
    return value


def _coerce_path(value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a path string, not {value!r}")
    _no_nul(value, where)
    return Path(value)


def key_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    """The fields of a config table (class or instance) that are its keys (not `ApiConfig.server`)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("key", True)]


# The plain annotations a config field may carry, each with its check.
_SCALARS: dict[Any, Callable[[Any, str], Any]] = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float,
                                                 str: _coerce_str, Path: _coerce_path}


def build_table(cls: type, table: Any, where: str, file: Path) -> Any:
    """An instance of the table dataclass `cls` from its TOML `table` (`where`: its dotted name): every key
    coerced by its field's annotation; an unknown key, a missing required one or a wrong type is a ConfigError
    naming the file and the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: [{where}] must be a table, not {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in key_fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{file}: unknown key {where}.{unknown[0]} (known keys: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name in table:
            kwargs[name] = _coerce(table[name], hints[name], f"{file}: {where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{file}: {where}.{name} is required")
    return cls(**kwargs)


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and DEL, which JSON leaves bare and TOML refuses, as \\u007f."""
    return orjson.dumps(text).decode().replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    """One TOML value: strings as basic strings, lists, inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return _toml_string(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_string(str(k))} = {toml_value(x)}" for k, x in value.items()) + "}"
    if isinstance(value, (int, float)):
        return repr(value)  # TOML spells nan and inf as Python does
    raise TypeError(f"no TOML for {type(value).__name__}")
