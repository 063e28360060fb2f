"""Exchanges of up to two items for up to two: the last refinement of small inputs.

Single swaps and moves (``refine.py``) stop where no one item, or pair of one item each, can go
between two parts. Packers that balance whole micro-batches (prime-rl's bins of several samples)
exchange several items at once and can end lighter. ``refine_subsets`` takes the heaviest part a
and, lightest first, each lighter part b (gap g = L_a - L_b), and looks at every exchange of a
set X of 0-2 items of a for a set Y of 0-2 items of b (not both empty): with d = ΣX - ΣY, the
pair ends at max(L_a - d, L_b + d), lower than L_a exactly when 0 < d < g. The first b with such
an exchange takes its best one (lowest pair maximum; ties to the larger d, then to the first X
and the first Y in the order: empty set, single items, pairs); the search starts again from the
heaviest part, until it is stuck or reaches ``floor``. With equal counts |X| = |Y|, or one more on the side of the part with one item more.

A step sorts b's subset sums once and finds, for every subset of a, the sums nearest ΣX - g/2
by binary search: O(s log s) for s = 1 + m + m(m-1)/2 subsets of a part of m items.

Example (k = 2): {8, 3, 2 | 7, 6, 2} = 13 | 15, gap 2: a lower maximum needs d = 1, and no
single swap or move has it (7 - 8, 6 - 3, 2 - 2, ...); exchanging {6} for {3, 2} does:
{8, 6 | 7, 3, 2, 2} = 14 | 14.
"""

from __future__ import annotations

import numpy as np

__all__ = ["refine_subsets"]


def refine_subsets(
    w: np.ndarray,
    labels: np.ndarray,
    k: int,
    *,
    equal_count: bool,
    max_steps: int,
    max_work: int,
    floor: float = 0.0,
) -> np.ndarray:
    """Improve ``labels`` (``[n]`` int64 part of each item of ``w``); returns new labels.

    At most ``max_steps`` exchanges, and it stops once the subset sums it looked at number
    ``max_work`` in all, or the heaviest part weighs ``floor`` or less. The heaviest part never
    gets heavier.
    """
    lab = labels.copy()
    if len(w) == 0 or k < 2:
        return lab
    loads = np.bincount(lab, weights=w, minlength=k)
    sizes = np.bincount(lab, minlength=k)
    ids = np.arange(k)
    for _ in range(max_steps):
        a = int(np.lexsort((ids, -loads))[0])
        if loads[a] <= floor or max_work <= 0:
            break
        xa = _subsets(np.flatnonzero(lab == a), w)
        step = None
        for b in np.lexsort((ids, loads)).tolist():
            if not loads[b] < loads[a] or max_work <= 0:
                break
            xb = _subsets(np.flatnonzero(lab == b), w)
            max_work -= len(xa[0]) + len(xb[0])
            step = _best(xa, xb, float(loads[a]), float(loads[b]), equal_count,
                         int(sizes[a]) - int(sizes[b]))  # fmt: skip
            if step is not None:
                moved_a, moved_b, d = step
                lab[moved_a] = b
                lab[moved_b] = a
                loads[a] -= d
                loads[b] += d
                sizes[a] += len(moved_b) - len(moved_a)
                sizes[b] += len(moved_a) - len(moved_b)
                break
        if step is None:
            break
    return lab


Subsets = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(sums, first item, second item) of every subset of 0-2 items; -1 where there is none."""


def _subsets(items: np.ndarray, w: np.ndarray) -> Subsets:
    """The empty set, each item, each pair (i < j in ``items`` order), in that order."""
    i, j = np.triu_indices(len(items), 1)
    none = np.array([-1], dtype=np.int64)
    first = np.concatenate([none, items, items[i]])
    second = np.concatenate([none, np.full(len(items), -1, dtype=np.int64), items[j]])
    sums = np.concatenate([[0.0], w[items], w[items[i]] + w[items[j]]])
    return sums, first, second


def _best(
    xa: Subsets, xb: Subsets, la: float, lb: float, equal_count: bool, more: int
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The best exchange of X (of part a, load ``la``) for Y (of b, ``lb < la``) as (X's items,
    Y's items, d), or None. ``more``: a's items minus b's (equal counts: |X| - |Y| may be 0, or
    the sign of ``more``).

    For each size of Y (0, 1, 2: contiguous in ``xb``) the sums of Y nearest ΣX - g/2 from
    below and from above are the best of their side (the pair maximum only grows away from
    it), so looking at those two per size is exhaustive."""
    sa, fa, ga = xa
    sb, fb, gb = xb
    na = (fa >= 0).astype(np.int64) + (ga >= 0)
    gap = la - lb
    m = int((fb >= 0).sum()) - int((gb >= 0).sum())  # b's items (singles) = its subsets of size 1
    cands: list[tuple[np.ndarray, ...]] = []
    for size, lo, hi in ((0, 0, 1), (1, 1, 1 + m), (2, 1 + m, len(sb))):
        if lo >= hi:
            continue
        allowed = na + size > 0
        if equal_count:
            allowed &= (na == size) | ((na - size == np.sign(more)) if more else False)
        order = lo + np.argsort(sb[lo:hi], kind="stable")
        sorted_b = sb[order]
        j = np.searchsorted(sorted_b, sa - gap / 2)
        below = np.searchsorted(sorted_b, sorted_b[np.maximum(j - 1, 0)])  # first of equal sums
        for c, ok in ((below, j > 0), (j, j < len(order))):
            y = order[np.minimum(c, len(order) - 1)]
            d = sa - sb[y]
            ok = ok & allowed & (d > 0) & (d < gap)
            x = np.flatnonzero(ok)
            cands.append((np.maximum(la - d[x], lb + d[x]), d[x], x, y[x]))
    val, d, x, y = (np.concatenate(c) for c in zip(*cands, strict=True))
    if len(val) == 0:
        return None
    i = int(np.lexsort((y, x, -d, val))[0])  # lowest maximum, larger d, first X, first Y
    moved_a = np.array([v for v in (fa[x[i]], ga[x[i]]) if v >= 0], dtype=np.int64)
    moved_b = np.array([v for v in (fb[y[i]], gb[y[i]]) if v >= 0], dtype=np.int64)
    return moved_a, moved_b, float(d[i])
