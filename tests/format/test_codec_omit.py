"""`rolltool.format.codec.OMIT_DEFAULT`: a record field written only away from its default, so a
key one kind of output adds (``--hybrid-cp``'s) leaves every other output's JSON as it was."""

from __future__ import annotations

from dataclasses import dataclass, field

from rolltool.format import from_json, to_json
from rolltool.format.codec import OMIT_DEFAULT


@dataclass(frozen=True, kw_only=True)
class _Rec:
    a: int
    b: float | None = field(default=None, metadata=OMIT_DEFAULT)
    c: bool = field(default=False, metadata=OMIT_DEFAULT)
    d: int = 0


def test_omit_default_fields_are_left_out_only_at_their_default() -> None:
    assert to_json(_Rec(a=1)) == {"a": 1, "d": 0}  # d: no flag, always written
    assert to_json(_Rec(a=1, b=2.5, c=True)) == {"a": 1, "b": 2.5, "c": True, "d": 0}
    assert list(to_json(_Rec(a=1, c=True))) == ["a", "c", "d"]  # field order kept
    assert to_json(_Rec(a=1, b=0.0)) == {"a": 1, "b": 0.0, "d": 0}  # 0.0 is not None


def test_a_record_without_the_keys_reads_back_with_the_defaults() -> None:
    for rec in (_Rec(a=1), _Rec(a=1, b=0.0), _Rec(a=1, c=True, d=3)):
        assert from_json(_Rec, to_json(rec), "") == rec
    assert from_json(_Rec, {"a": 2}, "") == _Rec(a=2)  # as an older writer wrote it
