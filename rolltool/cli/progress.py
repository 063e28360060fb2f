"""Progress on stderr: a live bar on a terminal, a plain line now and then in a log.

A long pack on a cluster writes to a log file, not a terminal: there a bar would be noise (or
nothing), so `progress` writes one line every `ROLLTOOL_PROGRESS_S` seconds (default 30; ``0``
turns progress off everywhere) once the job has run that long, and a last line when it ends. A
short run prints nothing, so piped output stays exactly the results and the warnings.

Each line (and the bar) says how far it is in items and, given a `size` per item, the rate:

    packing steps: 40/95 (42%), 24.1 M tokens, 12.3 M tokens/s, 0:00:02 elapsed, ~0:00:02 left
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from rich.console import Console

from rolltool.errors import RolltoolError
from rolltool.util.numfmt import big

T = TypeVar("T")

DEFAULT_S = 30.0
"""Seconds between two progress lines when stderr is not a terminal."""


def interval() -> float:
    """`ROLLTOOL_PROGRESS_S`: seconds between log lines (0: no progress at all)."""
    raw = os.environ.get("ROLLTOOL_PROGRESS_S", "")
    if not raw:
        return DEFAULT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise RolltoolError(
            f"ROLLTOOL_PROGRESS_S must be a number of seconds >= 0, got {raw!r}",
            hint="unset it for a line every 30 s in logs, or set 0 to turn progress off",
        )
    return seconds


@dataclass
class Tally:
    """How far a loop is: items and their size done, since `start` (monotonic seconds)."""

    total: int | None
    unit: str
    start: float = field(default_factory=lambda: time.monotonic())
    done: int = 0
    size: int = 0

    def add(self, size: int) -> None:
        self.done += 1
        self.size += size

    def line(self, description: str, now: float) -> str:
        """``description: 40/95 (42%), 24.1 M tokens, 12.3 M tokens/s, 0:00:02 elapsed, ...``"""
        elapsed = max(now - self.start, 1e-9)
        parts = [f"{self.done:,}/{self.total:,}" if self.total else f"{self.done:,}"]
        if self.total:
            parts[0] += f" ({self.done / self.total:.0%})"
        if self.size:
            parts += [
                f"{big(self.size)} {self.unit}",
                f"{big(round(self.size / elapsed))} {self.unit}/s",
            ]
        parts.append(f"{_clock(elapsed)} elapsed")
        if self.total and 0 < self.done < self.total:
            parts.append(f"~{_clock(elapsed / self.done * (self.total - self.done))} left")
        return f"{description}: " + ", ".join(parts)


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress(
    console: Console,
    items: Iterable[T],
    total: int | None,
    description: str,
    *,
    size: Callable[[T], int] | None = None,
    unit: str = "tokens",
) -> Iterator[T]:
    """Yield `items`, telling `console` (stderr) how far the loop is: a bar on a terminal, a
    line every `interval()` seconds otherwise; `size(item)` counts the item's `unit`s."""
    every = interval()
    if every == 0:
        yield from items
    elif console.is_terminal:
        yield from _bar(console, items, total, description, size, unit)
    else:
        yield from _lines(console, items, Tally(total, unit), description, size, every)


def _lines(
    console: Console,
    items: Iterable[T],
    tally: Tally,
    description: str,
    size: Callable[[T], int] | None,
    every: float,
) -> Iterator[T]:
    last = tally.start
    for item in items:
        yield item
        tally.add(size(item) if size is not None else 0)
        now = time.monotonic()
        if now - last >= every:
            console.print(tally.line(description, now), markup=False, highlight=False)
            last = now
    if last != tally.start:  # said something: say how it ended
        console.print(tally.line(description, time.monotonic()), markup=False, highlight=False)


def _bar(
    console: Console,
    items: Iterable[T],
    total: int | None,
    description: str,
    size: Callable[[T], int] | None,
    unit: str,
) -> Iterator[T]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    if size is not None:
        columns.append(TextColumn("{task.fields[rate]}"))
    tally = Tally(total, unit)
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, rate="")
        for item in items:
            yield item
            tally.add(size(item) if size is not None else 0)
            elapsed = max(time.monotonic() - tally.start, 1e-9)
            bar.update(task, advance=1, rate=f"{big(round(tally.size / elapsed))} {unit}/s")
