"""Rich tables sized to a terminal: short two-line headers first, then the least important
columns hidden (a caption says which); numbers are never cut. Shared by every command's tables
(`rolltool.stats.render`, `rolltool.bench.render`)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def new_table(title: str, columns: Iterable[str], first_left: bool = True) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 and first_left else "right", no_wrap=i == 0)
    return t


@dataclass(frozen=True)
class Col:
    """A table column: its header, a short (two-line) header for narrow terminals, and ``keep``:
    at a narrow width the columns with the lowest ``keep`` are hidden first (0: never)."""

    header: str
    short: str | None = None
    keep: int = 0
    left: bool = False
    wrap: bool = False


def natural_width(t: Table) -> int:
    """The width ``t`` takes when nothing squeezes it."""
    console = Console(width=100_000, file=io.StringIO())
    return Measurement.get(console, console.options, t).maximum


def _build(
    title: str,
    cols: Sequence[Col],
    rows: Sequence[Sequence[str] | None],
    shown: Sequence[int],
    short: bool,
    measure: bool = False,
) -> Table:
    """The table of the ``shown`` columns; ``measure``: wrapping cells cut to their longest word
    (what they need at least)."""
    t = Table(title=title, title_justify="left", title_style="bold", header_style="bold")
    for i in shown:
        c = cols[i]
        header = c.short if short and c.short is not None else c.header
        t.add_column(header, justify="left" if c.left else "right", no_wrap=not c.wrap)
    for row in rows:
        if row is None:
            t.add_section()
        elif measure:
            t.add_row(*(max(row[i].split(), key=len, default="") if cols[i].wrap else row[i] for i in shown))  # fmt: skip
        else:
            t.add_row(*(row[i] for i in shown))
    return t


def fit(
    title: str,
    cols: Sequence[Col],
    rows: Sequence[Sequence[str] | None],
    width: int | None,
) -> Table:
    """The table at its full headers if it fits ``width``; else short headers, then without its
    least important columns (a caption names them) until it fits."""
    shown = list(range(len(cols)))
    if width is None:
        return _build(title, cols, rows, shown, short=False)
    limit = width

    def fits(short: bool) -> bool:
        return natural_width(_build(title, cols, rows, shown, short, measure=True)) <= limit

    if fits(short=False):
        return _build(title, cols, rows, shown, short=False)
    hidden: list[int] = []
    while not fits(short=True):
        optional = [i for i in shown if cols[i].keep > 0]
        if not optional:
            break
        drop = min(optional, key=lambda i: (cols[i].keep, -i))
        shown.remove(drop)
        hidden.append(drop)
    t = _build(title, cols, rows, shown, short=True)
    if hidden:
        names = ", ".join(cols[i].header for i in sorted(hidden))
        t.caption = f"hidden at this width: {names} (--json has them)"
        t.caption_justify = "left"
    return t


def fit_table(
    title: str, cols: Sequence[Col], rows: Sequence[Sequence[str] | None], width: int | None
) -> Table:
    """A table of ``cols`` and ``rows`` fitted to ``width`` (see the module docstring): the
    one sizing rule of every command's tables (bench's too)."""
    return fit(title, cols, rows, width)
