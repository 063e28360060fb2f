"""Problems found in data: one collector shared by the input schema, pack and verify.

A `Problem` has a stable ``kind`` code (``"null"``, ``"shard.hash"``, ...: tests and ``--json``
key on it), where it is (file, step/rank/micro-batch, sample) and a sentence for people.
`Problems` keeps the first ``MAX_LISTED`` of each kind and counts the rest, so a million broken
rows cost a counter, not a million strings; texts can be built lazily with `Problems.many`.

>>> p = Problems()
>>> p.add("null", "a.parquet: sample 3", "column 'reward' is null")
>>> p.count, p.listed()[0].line()
(1, "a.parquet: sample 3: column 'reward' is null")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolltool.errors import RolltoolError

MAX_LISTED = 8
"""Problems listed per kind; the rest are counted."""


@dataclass(frozen=True)
class Problem:
    kind: str
    """Stable code, e.g. ``"null"`` or ``"row.padding"``."""
    where: str
    """File, sample, step/rank/micro-batch the problem concerns ("" for the whole input)."""
    text: str
    """What is wrong, for people."""

    def line(self) -> str:
        return f"{self.where}: {self.text}" if self.where else self.text

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "where": self.where, "text": self.text}


@dataclass
class Problems:
    """Problems by kind, in the order kinds were first seen; the first few of each are kept."""

    limit: int = MAX_LISTED
    kept: dict[str, list[Problem]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, where: str, text: str) -> None:
        self.many(kind, [None], lambda _: (where, text))

    def extend(self, problems: Iterable[Problem]) -> None:
        for p in problems:
            self.many(p.kind, [p], lambda q: (q.where, q.text))

    def many(
        self, kind: str, items: Sequence[Any] | Any, describe: Callable[[Any], tuple[str, str]]
    ) -> None:
        """One problem of `kind` per item; `describe(item) -> (where, text)` is called only for
        the items that are listed."""
        kept = self.kept.setdefault(kind, [])
        room = self.limit - len(kept)
        for item in list(items[:room]) if room > 0 else []:
            kept.append(Problem(kind, *describe(item)))
        self.counts[kind] = self.counts.get(kind, 0) + len(items)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def __bool__(self) -> bool:
        return self.count > 0

    def listed(self) -> list[Problem]:
        return [p for ps in self.kept.values() for p in ps]

    def lines(self) -> list[str]:
        """Listed problems, each kind followed by how many more of it were not listed."""
        out: list[str] = []
        for kind, ps in self.kept.items():
            out.extend(p.line() for p in ps)
            more = self.counts[kind] - len(ps)
            if more:
                out.append(f"... and {more:,} more like the above ({kind})")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "by_kind": dict(self.counts),
            "listed": [p.to_dict() for p in self.listed()],
        }

    def raise_if_any(self, what: str, hint: str) -> None:
        """Raise one RolltoolError listing everything: "<what> has N problem(s); ..."."""
        if not self:
            return
        n = self.count
        head = f"{what} has {n:,} problem{'s' * (n != 1)}; nothing was written:"
        raise RolltoolError("\n".join([head, *(f"  {x}" for x in self.lines())]), hint=hint)
