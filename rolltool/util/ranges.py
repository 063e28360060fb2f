"""Index ranges: laid end to end (the flat indices of many [start, start + length) at once), or
one range cut into consecutive slices or pieces."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate

import numpy as np


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated index ranges [start, start + length) (int64), in order: what
    ``np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])`` gives, in three
    NumPy calls. Lengths must be >= 0."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)


def slices(n: int, size: int) -> list[slice]:
    """[0, n) cut into consecutive slices of `size` (the last one shorter), for passes over an
    array a few MB at a time: ``slices(5, 2)`` is ``[slice(0, 2), slice(2, 4), slice(4, 5)]``."""
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def cut(a: np.ndarray, sizes: Iterable[int]) -> list[np.ndarray]:
    """`a` cut into consecutive views of `sizes` (which sum to ``len(a)``): ``np.split`` at
    their running sums, without its per-piece overhead.

    >>> [p.tolist() for p in cut(np.arange(5), [2, 0, 3])]
    [[0, 1], [], [2, 3, 4]]
    """
    ends = list(accumulate(sizes))
    return [a[s:e] for s, e in zip([0, *ends], ends, strict=False)]  # each end, the one before
