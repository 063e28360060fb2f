"""Frozen dataclass records <-> plain JSON values: one codec for every record and config.

`to_json(record)` gives the JSON value (keys in field order, numpy scalars as Python numbers);
`from_json(Type, value, key)` builds the record back, checking every field's type, and raises
`CodecError` naming the key (``steps[3].ranks[0].rows``) when a value has the wrong shape.
Supported field types: records, int, float, str, bool, ``X | None``, ``tuple[X, ...]``,
fixed tuples, ``Mapping[str, X]`` and `Any`. A field whose ``metadata`` is `OMIT_DEFAULT` is
written only when it differs from its default (a key that only some outputs carry).

**Speed** (issue 25: a manifest of ~3k records is read on every ``open_packed``). Each type's
decoder is made once per process and kept (`_decoder`): a record's field types are resolved
(``typing.get_type_hints``, which compiles every annotation string) on its class's first decode,
not on every record, and each field's decoder on its first use (a field type nothing decodes is
never resolved, as before). A key is spelled only when a value is wrong: the error carries the
path up (`_Wrong`), each container adding its part, so a good document builds no key strings.
On the 776-shard pack of ``benchmarks/open.py`` the manifest's decode went from ~1 s to ~40 ms
on a loaded 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Decoder = Callable[[Any], Any]
"""A JSON value -> the value as its type, or `_Wrong` naming what is wrong (not yet where)."""


_OMIT_KEY = "rolltool_omit_default"
OMIT_DEFAULT = {_OMIT_KEY: True}
"""A record field's ``metadata`` that keeps it out of `to_json` while it holds its default:
a key added for one kind of output only (``--hybrid-cp``'s settings) leaves every other
output's JSON, and so its bytes, as older rolltools wrote it; `from_json` gives the default
back for a missing key, as for any field with a default."""


def to_json(value: Any) -> Any:
    """Records to plain JSON values; numpy scalars to Python; keys in field order (a field
    marked `OMIT_DEFAULT` left out while it holds its default)."""
    names = _field_names(type(value))
    if names is not None:
        omit = _OMITTED[type(value)]
        if omit:
            return {
                name: to_json(getattr(value, name))
                for name in names
                if name not in omit or getattr(value, name) != omit[name]
            }
        return {name: to_json(getattr(value, name)) for name in names}
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


_FIELD_NAMES: dict[type, tuple[str, ...] | None] = {}
_OMITTED: dict[type, dict[str, Any]] = {}
"""A record type's `OMIT_DEFAULT` fields and their defaults (set with `_FIELD_NAMES`)."""


def _field_names(tp: type) -> tuple[str, ...] | None:
    """A dataclass's field names in order (None for any other type), once per type. An instance
    is a record when its type is a dataclass; a dataclass itself is not (its type is `type`)."""
    try:
        return _FIELD_NAMES[tp]
    except KeyError:
        pass
    names = None
    if dataclasses.is_dataclass(tp):
        fields = dataclasses.fields(tp)
        names = tuple(f.name for f in fields)
        _OMITTED[tp] = {f.name: f.default for f in fields if f.metadata.get(_OMIT_KEY)}
    _FIELD_NAMES[tp] = names
    return names


def kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, int | float) else "null"
    )


def from_json(tp: Any, value: Any, key: str) -> Any:
    """`value` as type `tp` (a record, int, float, str, bool, X | None, tuple[...], Mapping)."""
    try:
        return _decoder(tp)(value)
    except _Wrong as e:
        raise e.error(key) from None


class CodecError(Exception):
    """A JSON value of the wrong shape for its record field (the caller names the file)."""


class _Wrong(Exception):
    """A wrong value deep in a document: what is wrong (``expected``, ``value``; or a missing
    field when ``expected`` is None) and the path to it, innermost part first (`error` spells
    the key as the recursion would have)."""

    def __init__(self, expected: str | None, value: Any) -> None:
        self.expected, self.value = expected, value
        self.parts: list[tuple[str, Any]] = []  # ("field" | "key" | "index", name or index)

    def error(self, key: str) -> CodecError:
        for how, part in reversed(self.parts):
            if how == "field":
                key = f"{key}.{part}" if key else part
            elif how == "key":
                key = f"{key}.{part}"
            else:
                key = f"{key}[{part}]"
        if self.expected is None:
            return CodecError(f"key {key!r} is missing")
        return _bad(key, self.expected, self.value)


_DECODERS: dict[Any, Decoder] = {}


def _decoder(tp: Any) -> Decoder:
    """The decoder of type `tp`, made on its first use and kept."""
    try:
        return _DECODERS[tp]
    except KeyError:
        pass
    dec = _make(tp)
    _DECODERS[tp] = dec
    return dec


def _make(tp: Any) -> Decoder:
    if tp is Any:
        return _any
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(tp)
    if dataclasses.is_dataclass(tp):
        return _Record(tp)
    if origin is tuple:
        return _array(tp)
    if origin in (Mapping, dict):
        return _mapping(tp)
    return _scalar(tp)


def _any(value: Any) -> Any:
    return value


_SCALARS: dict[Any, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    float: (lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _scalar(tp: Any) -> Decoder:
    ok, expected = _SCALARS[tp]  # KeyError for an unsupported type, as before
    as_float = tp is float

    def scalar(value: Any) -> Any:
        if type(value) is tp:  # the common case, exactly the type (bool is no int here)
            return value
        if not ok(value):
            raise _Wrong(expected, value)
        return float(value) if as_float else value

    return scalar


class _Lazy:
    """The decoder of type `tp`, made on the first call (a container's items, a union's
    member): a type is resolved only once something of it is decoded."""

    __slots__ = ("dec", "tp")

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self.dec: Decoder | None = None

    def get(self) -> Decoder:
        dec = self.dec
        if dec is None:
            dec = self.dec = _decoder(self.tp)
        return dec

    def __call__(self, value: Any) -> Any:
        return self.get()(value)


def _exact(tp: Any) -> type | None:
    """`tp` when it is a scalar type a value of exactly that type needs no conversion for."""
    return tp if tp in _SCALARS else None


def _union(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    optional = type(None) in args
    inners = [_Lazy(a) for a in args if a is not type(None)]

    def union(value: Any) -> Any:
        if value is None and optional:
            return None
        (inner,) = inners
        return inner.get()(value)

    return union


def _mapping(tp: Any) -> Decoder:
    inner = _Lazy(typing.get_args(tp)[1])

    def mapping(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _Wrong("an object", value)
        dec = inner.get() if value else inner
        out = {}
        k = None
        try:
            for k, v in value.items():
                out[k] = dec(v)
        except _Wrong as e:
            e.parts.append(("key", k))
            raise
        return out

    return mapping


class _Record:
    """A record's decoder: a function written for its class on the class's first decode
    (`_record_source`), so a good record costs one call and, per field, one lookup and a type
    test or two. A value of exactly its field's scalar type (or None for an optional field) is
    taken as it is, a nested record or a tuple of records is decoded by the nested class's own
    function, anything else by the field type's decoder; a wrong value raises `_Wrong`, each
    level adding its part of the key (the field, the index, the mapping key) on the way up,
    as the generic decoders do: it is never decoded again (a level that did would decode the
    levels below it twice each, 2^depth times in all)."""

    __slots__ = ("decode", "tp", "writing")

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self.decode: Decoder | None = None
        self.writing = False

    def __call__(self, value: Any) -> Any:
        return self.function()(value)

    def function(self) -> Decoder:
        """The class's written decoder, written on the first call (under a lock: another
        thread waits for it). While it is being written, a field of this very type (a record
        that contains its own type) gets this object, which calls the function once written."""
        decode = self.decode
        if decode is not None:
            return decode
        with _WRITING:
            if self.decode is not None:
                return self.decode
            if self.writing:  # this thread, writing this class: a field of its own type
                return self
            self.writing = True
            try:
                self.decode = decode = _compile_record(self.tp)
            finally:
                self.writing = False
            return decode


_WRITING = threading.RLock()
_MISSING = object()


def _field_decoder(tp: Any) -> Decoder:
    """The decoder of a field's type, or one that makes it on first use where it cannot be
    made yet (an unsupported type raises only when a value of it is decoded, as before)."""
    try:
        return _decoder(tp)
    except KeyError:
        return _Lazy(tp)


def _record_function(tp: Any) -> Decoder | None:
    """The written decoder of record type `tp` (None when `tp` is no record), or, where it
    cannot be written yet (an annotation of `tp` that does not resolve, say a name imported
    only for type checkers), its `_Record`, which writes it, or raises why not, on the first
    value of that type: a field type nothing decodes is never resolved, as before."""
    dec = _field_decoder(tp)
    if not isinstance(dec, _Record):
        return None
    try:
        return dec.function()
    except Exception:  # (any error of get_type_hints) raised again when a value needs it
        return dec


def _field_lines(i: int, hint: Any, names: dict[str, Any]) -> list[str]:
    """How field i's present value ``v{i}`` of type `hint` is decoded (after ``if v{i} is
    _MISSING:``), naming what it uses in `names`."""
    v = f"v{i}"
    names[f"dec_{i}"] = _field_decoder(hint)
    lines = []
    args = typing.get_args(hint)
    inner = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(inner) == 1:
        lines.append(f"        elif {v} is None:\n            pass")
        (hint,) = inner
    exact = _exact(hint)
    if exact is not None:
        names[f"exact_{i}"] = exact
        return [*lines, f"        elif type({v}) is not exact_{i}:\n            {v} = dec_{i}({v})"]
    record = _record_function(hint)
    if record is not None:
        names[f"record_{i}"] = record
        return [*lines, f"        else:\n            {v} = record_{i}({v})"]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _record_function(args[0])
        if item is not None:  # tuple[Record, ...]: the items by their function, in one go
            names[f"item_{i}"] = item
            return [
                *lines,
                f"        elif type({v}) is list:",
                "            out = []",
                "            try:",
                f"                for x in {v}:",
                f"                    out.append(item_{i}(x))",
                "            except _Wrong as e:",
                '                e.parts.append(("index", len(out)))',
                "                raise",
                f"            {v} = tuple(out)",
                f"        else:\n            {v} = dec_{i}({v})",
            ]
    if typing.get_origin(hint) in (Mapping, dict):
        item = _record_function(args[1])
        if item is not None:  # Mapping[str, Record]: the values by their function, in one go
            names[f"item_{i}"] = item
            return [
                *lines,
                f"        elif type({v}) is dict:",
                "            out = {}",
                "            k = None",
                "            try:",
                f"                for k, x in {v}.items():",
                f"                    out[k] = item_{i}(x)",
                "            except _Wrong as e:",
                '                e.parts.append(("key", k))',
                "                raise",
                f"            {v} = out",
                f"        else:\n            {v} = dec_{i}({v})",
            ]
    return [*lines, f"        else:\n            {v} = dec_{i}({v})"]


def _record_source(tp: Any) -> tuple[str, dict[str, Any]]:
    """The source of `tp`'s decoder and the names it uses. For fields ``a: int`` (required)
    and ``b: Spec | None = None``::

        def decode(value):
            if not isinstance(value, dict):
                raise _Wrong("an object", value)
            name = ""
            try:
                name = "a"
                v0 = value.get("a", _MISSING)
                if v0 is _MISSING:
                    raise _Wrong(None, None)
                elif type(v0) is not exact_0:
                    v0 = dec_0(v0)
                name = "b"
                v1 = value.get("b", _MISSING)
                if v1 is _MISSING:
                    v1 = default_1
                elif v1 is None:
                    pass
                else:
                    v1 = record_1(v1)
            except _Wrong as e:
                e.parts.append(("field", name))
                raise
            o = _new(tp)  # object.__new__
            _set(o, "__dict__", {"a": v0, "b": v1})  # object.__setattr__
            return o

    A missing field with a default gets that default (its factory's value), as the class's
    own ``__init__`` would give it. The instance is made as that ``__init__`` makes it, only
    faster, where that is all it does (`_plain`). Any other class is called with the fields
    present in `value` only, as before (its own ``__init__`` gives the missing ones its own
    defaults): ``b`` missing is ``v1 = _MISSING`` and ``return tp(**_present({"a": v0, "b":
    v1}))``, or ``return tp(a=v0, b=v1)`` when every field is required."""
    hints = typing.get_type_hints(tp)
    names: dict[str, Any] = {"_MISSING": _MISSING, "_Wrong": _Wrong, "tp": tp}
    lines = [
        "def decode(value):",
        "    if not isinstance(value, dict):",
        '        raise _Wrong("an object", value)',
        '    name = ""',
        "    try:",
    ]
    plain = _plain(tp)
    args: list[tuple[str, str]] = []  # (field name, its variable)
    optional = False  # a field that may be left out of the class's call (not plain)
    for i, f in enumerate(dataclasses.fields(tp)):
        v = f"v{i}"
        lines += [f"        name = {f.name!r}", f"        {v} = value.get({f.name!r}, _MISSING)"]
        lines.append(f"        if {v} is _MISSING:")
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        if has_default and not plain:  # left to the class's own __init__, as before
            optional = True
            lines.append("            pass")
        elif f.default is not dataclasses.MISSING:
            names[f"default_{i}"] = f.default
            lines.append(f"            {v} = default_{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"factory_{i}"] = f.default_factory
            lines.append(f"            {v} = factory_{i}()")
        else:
            lines.append("            raise _Wrong(None, None)")
        lines += _field_lines(i, hints[f.name], names)
        args.append((f.name, v))
    lines += [
        "    except _Wrong as e:",
        '        e.parts.append(("field", name))',
        "        raise",
    ]
    fields = ", ".join(f"{name!r}: {v}" for name, v in args)
    if plain:  # what the class's own __init__ would do, without its per-field setattr
        names["_new"], names["_set"] = object.__new__, object.__setattr__
        lines += ["    o = _new(tp)", f'    _set(o, "__dict__", {{{fields}}})', "    return o"]
    elif optional:
        names["_present"] = _present
        lines.append(f"    return tp(**_present({{{fields}}}))")
    else:
        lines.append(f"    return tp({', '.join(f'{name}={v}' for name, v in args)})")
    return "\n".join(lines) + "\n", names


def _present(kw: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a value's fields that are present (a record not `_plain`)."""
    return {name: v for name, v in kw.items() if v is not _MISSING}


def _plain(tp: Any) -> bool:
    """Whether an instance of `tp` is exactly its fields in ``__dict__``, set by the
    ``__init__`` dataclasses wrote for it: a frozen dataclass with no ``__post_init__``, every
    field an ``__init__`` argument, no ``InitVar`` or ``ClassVar`` pseudo-field, an ``__init__``
    that dataclasses wrote (compiled from a string, setting fields by the builtin
    ``object.__setattr__`` it closes over), no ``__new__`` or metaclass ``__call__`` of its own,
    and no field that a data descriptor on the class (a slot of its own or a base's, a
    descriptor-typed field) would take instead of ``__dict__``. Then the decoder sets
    ``__dict__`` in one call instead of the frozen ``__init__``'s setattr per field (a third of
    a manifest's decode); any other class is called as usual."""
    params = getattr(tp, "__dataclass_params__", None)
    if params is None or not (params.init and params.frozen) or hasattr(tp, "__post_init__"):
        return False
    code = getattr(tp.__dict__.get("__init__"), "__code__", None)
    fields = dataclasses.fields(tp)
    return (
        code is not None
        and code.co_filename.startswith("<")
        and "__dataclass_builtins_object__" in code.co_freevars
        and all(f.init for f in fields)
        and len(fields) == len(tp.__dataclass_fields__)
        and not any("__slots__" in c.__dict__ for c in tp.__mro__[:-1])
        and tp.__new__ is object.__new__
        and type(tp).__call__ is type.__call__
        and not any(_data_descriptor(tp, f.name) for f in fields)
    )


def _data_descriptor(tp: type, name: str) -> bool:
    """Whether class attribute `name` of `tp` (through its bases) is a data descriptor: one
    that ``__init__``'s setattr goes through, so a value in ``__dict__`` would be ignored."""
    for c in tp.__mro__:
        if name in c.__dict__:
            kind = type(c.__dict__[name])
            return hasattr(kind, "__set__") or hasattr(kind, "__delete__")
    return False


def _compile_record(tp: Any) -> Decoder:
    source, names = _record_source(tp)
    exec(compile(source, f"<rolltool.format.codec decoder of {tp.__qualname__}>", "exec"), names)
    return names["decode"]


def _array(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        item, exact = _Lazy(args[0]), _exact(args[0])

        def variadic(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list):
                raise _Wrong("an array", value)
            if exact is not None:
                for v in value:
                    if type(v) is not exact:
                        break
                else:  # every item exactly of the scalar type: nothing to convert or check
                    return tuple(value)
            dec = item.get() if value else item
            out: list[Any] = []
            try:
                for v in value:
                    out.append(dec(v))
            except _Wrong as e:
                e.parts.append(("index", len(out)))
                raise
            return tuple(out)

        return variadic
    items = [_Lazy(a) for a in args]

    def fixed(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise _Wrong("an array", value)
        if len(value) != len(items):
            raise _Wrong(f"an array of {len(items)}", value)
        out: list[Any] = []
        try:
            for d, v in zip(items, value, strict=True):
                out.append(d(v))
        except _Wrong as e:
            e.parts.append(("index", len(out)))
            raise
        return tuple(out)

    return fixed


def _bad(key: str, expected: str, value: Any) -> CodecError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return CodecError(f"{key!r} must be {expected}, got {shown}")
