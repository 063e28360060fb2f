"""`rolltool.format.codec.from_json` against a slow, obvious decoder written from its docstring.

The codec writes a decoder function per record class (issue 25: a manifest of ~3k records is
decoded on every ``open_packed``). Here a plain recursion over the same type rules decodes real
manifests and thousands of broken copies of them: both must build equal records, or both refuse
with the same message naming the same key.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pack_helpers import pack

from rolltool.format import MANIFEST, Manifest, codec, from_json
from rolltool.format.codec import CodecError, _bad


def reference(tp: Any, value: Any, key: str) -> Any:
    """`value` as type `tp`, by the codec's documented rules, one obvious step at a time."""
    if tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return reference(inner, value, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _bad(key, "an object", value)
        hints = typing.get_type_hints(tp)
        kw = {}
        for f in dataclasses.fields(tp):
            at = f"{key}.{f.name}" if key else f.name
            if f.name in value:
                kw[f.name] = reference(hints[f.name], value[f.name], at)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CodecError(f"key {at!r} is missing")
        return tp(**kw)  # type: ignore[operator]
    if origin is tuple:
        if not isinstance(value, list):
            raise _bad(key, "an array", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(reference(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _bad(key, f"an array of {len(args)}", value)
        return tuple(
            reference(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise _bad(key, "an object", value)
        return {k: reference(args[1], v, f"{key}.{k}") for k, v in value.items()}
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        raise _bad(key, expected[tp], value)
    return float(value) if tp is float else value


def _typed(value: Any) -> Any:
    """`value` with every record, container and scalar tagged with its type: equal only when
    the types are equal too (``2 == 2.0``, but a float field must hold a float)."""
    if dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)
        return type(value), tuple((f.name, _typed(getattr(value, f.name))) for f in fields)
    if isinstance(value, dict):
        return dict, tuple((k, _typed(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return type(value), tuple(_typed(v) for v in value)
    return type(value), value


def _outcome(decode: Any, doc: Any) -> tuple[str, Any]:
    try:
        return "ok", _typed(decode(Manifest, doc, ""))
    except CodecError as e:
        return "error", str(e)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (the root excluded)."""
    out = []
    if isinstance(value, dict | list):
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            out.append((*path, k))
            out += _paths(v, (*path, k))
    return out


REPLACEMENTS: list[Any] = ["x", 1, 1.5, -3, True, False, None, [], {}, [1, "a"], {"a": 1}]


def _mutated(doc: Any, rng: random.Random, paths: list[tuple[Any, ...]]) -> Any:
    """A copy of `doc` with one to three places replaced by another JSON value or removed."""
    doc = json.loads(json.dumps(doc))
    for path in rng.sample(paths, rng.randint(1, 3)):
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            last = path[-1]
            if isinstance(parent, dict) and rng.random() < 0.3:
                parent.pop(last, None)
            else:
                parent[last] = copy.deepcopy(rng.choice(REPLACEMENTS))  # never shared
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced it
            continue
    return doc


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """The manifests of packs that use every kind of record field: plain, --cp, --hybrid-cp."""
    example = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
    docs = []
    for name, args in {
        "plain": ("--dp", 3, "--batch-size", 64),
        "cp": ("--dp", 2, "--cp", 2, "--batch-size", 64),
    }.items():
        out = tmp_path_factory.mktemp("codec") / name
        pack(example, out, *args)
        docs.append(json.loads((out / MANIFEST).read_text()))
    return docs


def test_real_manifests_decode_as_the_reference_decodes_them(manifests: list[Any]) -> None:
    for doc in manifests:
        got, want = _outcome(from_json, doc), _outcome(reference, doc)
        assert got[0] == "ok" and got == want


def test_broken_manifests_are_refused_as_the_reference_refuses_them(
    manifests: list[Any],
) -> None:
    rng = random.Random(25)
    outcomes = {"ok": 0, "error": 0}
    for doc in manifests:
        paths = _paths(doc)
        for _ in range(1000):
            broken = _mutated(doc, rng, paths)
            got, want = _outcome(from_json, broken), _outcome(reference, broken)
            assert got == want, broken
            outcomes[got[0]] += 1
    assert min(outcomes.values()) >= 100, outcomes  # both kinds of outcome were exercised


@dataclass(frozen=True, kw_only=True)
class _Node:
    name: str
    weight: float = 1.0
    children: tuple[_Node, ...] = ()
    by_name: Mapping[str, _Node] = dataclasses.field(default_factory=dict)
    parent: _Node | None = None


def test_a_record_that_contains_its_own_type() -> None:
    doc = {
        "name": "root",
        "weight": 2,
        "children": [{"name": "a"}, {"name": "b", "children": [{"name": "c", "weight": 0.5}]}],
        "by_name": {"d": {"name": "d", "parent": {"name": "root"}}},
    }
    node = from_json(_Node, doc, "")
    assert _typed(node) == _typed(reference(_Node, doc, ""))
    assert node.weight == 2.0 and type(node.weight) is float
    assert node.children[1].children[0].name == "c" and node.by_name["d"].parent.name == "root"
    broken = json.loads(json.dumps(doc))
    broken["children"][1]["children"][0]["weight"] = "heavy"
    with pytest.raises(CodecError, match=r"'x\.children\[1\]\.children\[0\]\.weight' must be"):
        from_json(_Node, broken, "x")
    broken["children"][1]["children"][0] = {"weight": 1}
    with pytest.raises(CodecError, match=r"key 'x\.children\[1\]\.children\[0\]\.name' is"):
        from_json(_Node, broken, "x")


@dataclass(frozen=True)
class _Checked:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low > high")


@dataclass(frozen=True)
class _OwnInit:
    total: int

    def __init__(self, total: int) -> None:
        object.__setattr__(self, "total", total * 2)


def test_a_record_is_made_as_its_own_init_makes_it() -> None:
    """Manifest records get ``__dict__`` set in one call (their dataclass ``__init__`` does only
    that); a class whose ``__post_init__`` checks or whose own ``__init__`` computes still runs
    them."""
    node = from_json(_Node, {"name": "n", "children": [{"name": "c"}]}, "")
    made = _Node(name="n", children=(_Node(name="c"),))
    assert node == made and vars(node) == vars(made)
    assert list(vars(node)) == list(vars(made))  # fields in their order
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.name = "m"
    checked = from_json(_Checked, {"low": 1, "high": 2}, "")
    assert checked == _Checked(1, 2) and hash(checked) == hash(_Checked(1, 2))
    assert codec._plain(_Node) and not codec._plain(_Checked) and not codec._plain(_OwnInit)
    with pytest.raises(ValueError, match="low > high"):
        from_json(_Checked, {"low": 3, "high": 2}, "")
    assert from_json(_OwnInit, {"total": 2}, "").total == 4


@dataclass(frozen=True, slots=True)
class _Slotted:
    low: int


@dataclass(frozen=True)
class _AfterSlots(_Slotted):
    """Not slotted itself: ``low`` is its base's slot, which a ``__dict__`` entry cannot set."""

    high: int = 0


class _Tenfold:
    """A data descriptor: the frozen ``__init__``'s setattr stores ten times the value."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return 0 if obj is None else getattr(obj, self.name)

    def __set__(self, obj: Any, value: int) -> None:
        object.__setattr__(obj, self.name, value * 10)


@dataclass(frozen=True)
class _Described:
    size: int = _Tenfold()  # type: ignore[assignment]


@dataclass(frozen=True)
class _OwnNew:
    size: int

    def __new__(cls, *args: Any, **kwargs: Any) -> _OwnNew:
        made = super().__new__(cls)
        object.__setattr__(made, "made_by_new", True)
        return made


@dataclass(frozen=True)
class _Derived:
    size: int
    double: int = dataclasses.field(default=0, init=False)


_SCRIPT = """
@dataclass(frozen=True)
class Doubled:
    total: int = 0
    def __init__(self, total: int = 7) -> None:
        object.__setattr__(self, "total", total * 2)
"""


def test_a_record_whose_init_is_not_all_is_made_by_its_class() -> None:
    """Only a class whose instance is its ``__dict__`` as dataclasses' frozen ``__init__``
    sets it gets that ``__dict__`` set directly: slots (a base's too), a data descriptor, an
    own ``__new__``, an ``init=False`` field or an own ``__init__`` written in a string (a
    ``python -c`` script) are made by the class, with the fields present only, as before."""
    assert from_json(_AfterSlots, {"low": 1, "high": 2}, "").low == 1
    assert from_json(_Described, {"size": 2}, "").size == 20
    assert getattr(from_json(_OwnNew, {"size": 2}, ""), "made_by_new", False)
    assert from_json(_Derived, {"size": 2}, "") == _Derived(2)
    scope: dict[str, Any] = {"dataclass": dataclass}
    exec(compile(_SCRIPT, "<string>", "exec"), scope)
    doubled = scope["Doubled"]
    assert from_json(doubled, {"total": 2}, "").total == 4
    assert from_json(doubled, {}, "").total == 14  # its __init__'s default, not a field's
    for tp in (_AfterSlots, _Described, _OwnNew, _Derived, doubled):
        assert not codec._plain(tp), tp


@dataclass(frozen=True)
class _Lazily:
    size: int
    later: _Unresolved | None = None


@dataclass(frozen=True)
class _Unresolved:
    kind: _NotDefinedAnywhere  # type: ignore[name-defined]  # noqa: F821


def test_a_field_type_nothing_decodes_is_never_resolved() -> None:
    """A nested record's annotations are resolved when a value of it is decoded, as before:
    a name imported only for type checkers does not break the records that never hold it."""
    assert from_json(_Lazily, {"size": 1}, "") == _Lazily(1)
    assert from_json(_Lazily, {"size": 1, "later": None}, "") == _Lazily(1)
    with pytest.raises(NameError, match="_NotDefinedAnywhere"):
        from_json(_Lazily, {"size": 1, "later": {"kind": 1}}, "")


class _CountingDict(dict[str, Any]):
    """A JSON object that counts the look-ups of its keys."""

    gets = 0

    def get(self, *args: Any) -> Any:
        _CountingDict.gets += 1
        return super().get(*args)


def test_a_wrong_value_deep_in_nested_records_is_looked_at_once() -> None:
    """A wrong value 12 records down (tuples and mappings of records) is decoded once, not
    again by every level above it (3^12 times), and named by its whole path."""
    for field, at in (("children", "children[1]"), ("by_name", "by_name.b")):
        bottom = _CountingDict(name=7)
        doc: Any = bottom
        for _ in range(12):
            inner = [{"name": "a"}, doc] if field == "children" else {"a": {"name": "a"}, "b": doc}
            doc = {"name": "n", field: inner}
        _CountingDict.gets = 0
        with pytest.raises(CodecError, match=rf"^'x(\.{re.escape(at)}){{12}}\.name' must be"):
            from_json(_Node, doc, "x")
        assert _CountingDict.gets == 1
