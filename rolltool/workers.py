"""Planning batches in worker processes (``pack --workers N``).

Each batch's plan (`rolltool.schedule.plan_one_step` / ``plan_batch``) is a pure function of the
light columns, the config and the batch, so batches can be planned anywhere and in any order:
the results are put back in batch order and every byte written is the same as a serial run's
(tests/test_workers.py compares every file). Workers are forked from the driver after the scan,
so they inherit the light columns without pickling them; only each batch's plan travels back.

Processes, not threads: planning is Python and NumPy over small arrays and holds the GIL. A pool
costs ~50-100 ms to start, so it is used only for runs of at least ``MIN_BATCHES`` batches and
``MIN_SAMPLES`` samples; smaller runs plan serially whatever ``workers`` says.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

MIN_BATCHES = 8
"""Fewer batches than this are planned serially."""
MIN_SAMPLES = 50_000
"""Runs with fewer input samples than this are planned serially."""

_JOB: tuple[Callable[..., Any], Sequence[Any]] | None = None  # set in each forked worker


def default_workers() -> int:
    """The cores this process may use (its CPU affinity), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not Linux
        return max(os.cpu_count() or 1, 1)


def worth_it(workers: int, batches: int, samples: int) -> bool:
    """Whether a pool pays for itself (see the module docstring)."""
    return workers > 1 and batches >= MIN_BATCHES and samples >= MIN_SAMPLES


def map_in_order(fn: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]``, computed by `workers` forked processes in contiguous chunks
    (about four per worker), in order. `fn` and `items` reach the workers by fork, not pickle;
    each result is pickled back. An exception in a worker is raised here, as serially."""
    return list(iter_in_order(fn, items, workers))


def iter_in_order(fn: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[R]:
    """`map_in_order`'s results one by one, each yielded as soon as it and those before it
    are computed (serially: computed when asked for), so a caller that folds them as they
    come never holds them all. Leaving early stops the pool."""
    if workers <= 1 or len(items) < 2:
        yield from (fn(x) for x in items)
        return
    parts = spans(len(items), workers * 4)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(
        max_workers=min(workers, len(parts)),
        mp_context=context,
        initializer=_adopt,
        initargs=(fn, items),
    ) as pool:
        for chunk in pool.map(_run, parts):
            yield from chunk


def spans(n: int, parts: int) -> list[tuple[int, int]]:
    """``[a, b)`` bounds cutting ``range(n)`` into ``min(n, parts)`` contiguous, near-equal
    pieces (none empty), in order: ``spans(5, 2) == [(0, 2), (2, 5)]``; ``[]`` when n is 0."""
    k = min(n, max(parts, 1))
    return list(itertools.pairwise(n * i // k for i in range(k + 1))) if k else []


def _adopt(fn: Callable[..., Any], items: Sequence[Any]) -> None:
    global _JOB
    _JOB = (fn, items)


def _run(span: tuple[int, int]) -> list[Any]:
    assert _JOB is not None
    fn, items = _JOB
    return [fn(items[i]) for i in range(*span)]
