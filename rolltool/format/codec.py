"""Frozen dataclass records <-> plain JSON values: one codec for every record and config.

`to_json(record)` gives the JSON value (keys in field order, numpy scalars as Python numbers);
`from_json(Type, value, key)` builds the record back, checking every field's type, and raises
`CodecError` naming the key (``steps[3].ranks[0].rows``) when a value has the wrong shape.
Supported field types: records, int, float, str, bool, ``X | None``, ``tuple[X, ...]``,
fixed tuples, ``Mapping[str, X]`` and `Any`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np


def to_json(value: Any) -> Any:
    """Records to plain JSON values; numpy scalars to Python; keys in field order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, int | float) else "null"
    )


def from_json(tp: Any, value: Any, key: str) -> Any:
    """`value` as type `tp` (a record, int, float, str, bool, X | None, tuple[...], Mapping)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(tp, value, key)
    if dataclasses.is_dataclass(tp):
        return _record(tp, value, key)
    if origin is tuple:
        return _array(tp, value, key)
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise _bad(key, "an object", value)
        inner = typing.get_args(tp)[1]
        return {k: from_json(inner, v, f"{key}.{k}") for k, v in value.items()}
    ok, expected = _SCALARS[tp]
    if not ok(value):
        raise _bad(key, expected, value)
    return float(value) if tp is float else value


_SCALARS: dict[Any, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _union(tp: Any, value: Any, key: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    (inner,) = [a for a in args if a is not type(None)]
    return from_json(inner, value, key)


def _record(tp: Any, value: Any, key: str) -> Any:
    if not isinstance(value, dict):
        raise _bad(key, "an object", value)
    hints = typing.get_type_hints(tp)
    kw = {}
    for f in dataclasses.fields(tp):
        sub = f"{key}.{f.name}" if key else f.name
        if f.name in value:
            kw[f.name] = from_json(hints[f.name], value[f.name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise CodecError(f"key {sub!r} is missing")
    return tp(**kw)


def _array(tp: Any, value: Any, key: str) -> tuple[Any, ...]:
    args = typing.get_args(tp)
    if not isinstance(value, list):
        raise _bad(key, "an array", value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(from_json(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise _bad(key, f"an array of {len(args)}", value)
    return tuple(
        from_json(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
    )


class CodecError(Exception):
    """A JSON value of the wrong shape for its record field (the caller names the file)."""


def _bad(key: str, expected: str, value: Any) -> CodecError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return CodecError(f"{key!r} must be {expected}, got {shown}")
