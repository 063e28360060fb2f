"""Split weighted items into k parts so that the heaviest part is as light as possible.

``balance(weights, k)`` is multiway number partitioning (makespan on identical machines), used to
give data-parallel ranks equal work. Methods, by name in ``METHODS``:

* ``kk``: k-way Karmarkar-Karp largest differencing (see ``kk.py``);
* ``lpt``: longest-processing-time greedy (see ``lpt.py``);
* ``refined``: LPT and, when it is cheap, KK; the lighter of the two is then improved by swaps
  and moves between the heaviest part and the others, then between the next heaviest parts and
  lighter ones, under a work budget (``refine`` in ``refine.py``). Up to ``EXHAUSTIVE_UP_TO``
  items LPT's and KK's results are also each refined by the exhaustive pairwise search
  (``refine_pairs``: until no swap or move between any two parts lowers their maximum), and the
  lightest of the three wins: never heavier than KK followed by that search. It runs KK when KK
  needs at most ``KK_AUTO_MERGES`` merges: with equal counts when n/k <= 1024, without them when
  n <= 1024. This was ``auto`` before issue 23; the lockstep planner keeps it for its rank-first
  candidates (it judges a split by Σ_j max_r, so a split that is merely as light is no better).
* ``auto``: the best of those and more, and faster, by proving optimality. With whole-number
  weights no part can weigh less than ``whole_bound`` (ceil(total / k), rounded up to a multiple
  of the weights' gcd), so the first labelling that reaches it is kept: with equal counts and
  ``EXACT_PER_PART`` items per part first ``deal_exact`` (one item of each block per part, then
  rounds of exact swaps, ``deal.py``); with at least ``DEAL_PER_PART`` items per part a
  vectorized serpentine deal and transfer rounds (``deal.py``), finished by the budgeted
  refinement; else ``refined``, stopping at the first of LPT, KK or a
  refinement that reaches the bound. Up to ``EXHAUSTIVE_UP_TO`` items a result still above it is
  refined by exchanges of up to two items for up to two (``exchange.py``), which is what lets
  ``align="total"`` beat packers that balance whole micro-batches (prime-rl's). ``auto`` never
  returns a heavier split than ``refined``; its labels differ from ``refined``'s only where it
  found a lighter split or an optimal one (the tests hold it to that).

``equal_count=True`` gives every part the same number of items; when k does not divide n, part
sizes are ``n // k`` or ``n // k + 1`` (KK pads the last block with zero-weight items, one per
part; LPT lets only ``n % k`` parts take the extra item; refinement swaps, and moves an item only
from a part with one item more to one with one fewer).

Example::

    >>> parts = balance(np.array([8.0, 7, 6, 5, 4]), 2)
    >>> [p.tolist() for p in parts], part_loads(np.array([8.0, 7, 6, 5, 4]), parts).tolist()
    ([[2, 3, 4], [0, 1]], [15.0, 15.0])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.partition.deal import deal, deal_exact
from rolltool.plan.partition.exchange import refine_subsets
from rolltool.plan.partition.kk import kk_sorted, kk_sorted_top
from rolltool.plan.partition.lpt import lpt_sorted
from rolltool.plan.partition.refine import refine, refine_pairs
from rolltool.util.ranges import cut

__all__ = [
    "METHODS",
    "balance",
    "balance_labels",
    "lower_bound",
    "part_loads",
    "refined_and_lpt_labels",
]

KK_AUTO_MERGES = 1024
"""``auto`` runs KK when KK needs at most this many merges (a few µs each, see ``kk.py``)."""

DEAL_PER_PART = 64
"""With whole-number weights and at least this many items per part, ``auto`` first tries
``deal`` (serpentine deal, transfer rounds, then the budgeted refinement) and keeps it when it
reaches ``whole_bound``; with fewer items per part it rarely does (4,096 into 64 parts: 17 of 20
steps do, 256 into 8: 5 of 20)."""

EXACT_PER_PART = (128, 512)
"""With equal counts, k dividing n, whole-number weights and this many items per part (both
ends included) ``auto`` first tries ``deal_exact`` (serpentine deal, rounds of exact swaps) and
keeps it when it reaches ``whole_bound``: 1,024 synth lengths into 8 parts 36 of 40 seeds in
~0.15 ms where ``deal`` took 0.3-0.4. Fewer items per part leave fewer exact swaps (4,096 into
64: none of 10 seeds); more make each round's search cost more than ``deal``'s sampled one
(16,384 into 8)."""

REFINE_STEPS, REFINE_WORK = 64, 1 << 14
"""``auto`` refines for at most ``2k + REFINE_STEPS`` swaps or moves, and stops once they have
looked at ``REFINE_WORK`` items in all (a step looks at the items of 3 parts, rarely of all)."""

SUBSET_WORK = 1 << 18
"""Up to ``EXHAUSTIVE_UP_TO`` items, a result above the bound is then refined by exchanges of up
to two items for up to two (``refine_subsets``), looking at this many subset sums at most."""

EXHAUSTIVE_UP_TO, PAIR_STEPS, PAIR_WORK = 256, 4, 1 << 19
"""Up to this many items ``auto`` refines both LPT's and KK's result with the exhaustive pairwise
search (``refine_pairs``, at most ``PAIR_STEPS · (n + k)`` steps and ``PAIR_WORK`` matrix cells
each, a few ms; not when the budgeted refinement already reached ``lower_bound``) and keeps
the lightest: never heavier than KK followed by that search when it ends within those limits
(it does on every test input; at n = 256, k = 64 it may not)."""


def _lpt(ws: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    return lpt_sorted(ws, k, equal_count)


def _kk(ws: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    n = len(ws)
    if equal_count and n % k:  # zero-weight padding: one per slot of the last block
        return kk_sorted(np.concatenate([ws, np.zeros(k - n % k)]), k, equal_count)[:n]
    return kk_sorted(ws, k, equal_count)


def _max_load(ws: np.ndarray, labels: np.ndarray, k: int) -> float:
    return float(np.bincount(labels, weights=ws, minlength=k).max())


def _lightest(ws: np.ndarray, k: int, candidates: list[np.ndarray]) -> tuple[np.ndarray, float]:
    """The candidate labelling with the lightest heaviest part (the first on ties), and that
    part's weight."""
    loads = [_max_load(ws, c, k) for c in candidates]
    top = min(loads)
    return candidates[loads.index(top)], top


def _auto(ws: np.ndarray, k: int, equal_count: bool) -> np.ndarray:
    """``auto``'s labels: ``_auto_split``'s, rows turned into labels."""
    return _as_labels(_auto_split(ws, k, equal_count))


def _as_labels(split: np.ndarray) -> np.ndarray:
    """A split (``[n]`` labels, or ``[k, m]`` rows of the items of each part) as ``[n]`` labels."""
    if split.ndim == 1:
        return split
    labels = np.empty(split.size, dtype=np.int64)
    labels[split] = np.arange(len(split))[:, None]
    return labels


def _auto_split(ws: np.ndarray, k: int, equal_count: bool, *, whole: bool = False) -> np.ndarray:
    """``auto`` on weights sorted heaviest first: ``[n]`` labels, or ``[k, n // k]`` where
    ``deal_exact`` reaches the bound (row p: the positions of part p's items), which
    ``balance`` turns into parts without labels. ``whole``: the weights are known to be whole
    numbers (the sort found it: no pass to check)."""
    floor, fits = _whole_bound(ws, k, equal_count=equal_count, whole=whole)  # None: not whole
    if floor is not None and fits and equal_count and _exact_fits(ws, k):
        rows = deal_exact(ws, k, target=floor)  # (exact loads: within the floor when not None)
        if rows is not None:
            return rows
    dealt = None
    if floor is not None and len(ws) >= DEAL_PER_PART * k:
        dealt = _deal(ws, k, equal_count, floor)
        if _max_load(ws, dealt, k) <= floor:
            return dealt
    out, top = _refined_top(ws, k, equal_count, floor)
    if floor is not None and top <= floor:
        return out
    bound = max(lower_bound(ws, k, equal_count=equal_count), floor or 0.0)
    if len(ws) <= EXHAUSTIVE_UP_TO and top > bound:  # exchanges of 2 for 2
        more = refine_subsets(ws, out, k, equal_count=equal_count, max_steps=len(ws) + k,
                              max_work=SUBSET_WORK, floor=bound)  # fmt: skip
        if _max_load(ws, more, k) < top:
            out, top = more, _max_load(ws, more, k)
    if dealt is not None and _max_load(ws, dealt, k) < top:
        return dealt
    return out


def _exact_fits(ws: np.ndarray, k: int) -> bool:
    """Whether ``auto`` tries ``deal_exact`` first, given that the whole-number bound is not
    the largest item's part (the largest item with the n/k - 1 smallest: the serpentine cannot
    get there; ``_whole_bound``'s ``fits``): equal counts (the caller's), k dividing n and
    ``EXACT_PER_PART`` items per part."""
    n = len(ws)
    lo, hi = EXACT_PER_PART
    return n % k == 0 and lo <= n // k <= hi


def _refined(
    ws: np.ndarray,
    k: int,
    equal_count: bool,
    floor: float | None = None,
    lpt: np.ndarray | None = None,
) -> np.ndarray:
    """``_refined_top``'s labels."""
    return _refined_top(ws, k, equal_count, floor, lpt)[0]


def _refined_top(
    ws: np.ndarray,
    k: int,
    equal_count: bool,
    floor: float | None = None,
    lpt: np.ndarray | None = None,
) -> tuple[np.ndarray, float]:
    """LPT and KK (when cheap), the lighter refined under a budget, and up to
    ``EXHAUSTIVE_UP_TO`` items both refined by the exhaustive pairwise search; the lightest.

    With a ``floor`` (a bound no split can beat) it stops at the first labelling that reaches
    it; without one it is ``auto`` as it was before issue 23, labelling for labelling.
    ``lpt``: LPT's labels of ``ws`` if the caller has them (`refined_and_lpt_labels`).
    Returns the labels and their heaviest part's weight.
    """
    with_kk = (len(ws) // k if equal_count else len(ws)) <= KK_AUTO_MERGES
    # The candidates are [LPT, KK] in that order, but the one likelier to reach the floor is
    # computed first: KK without equal counts (LPT when the largest item is the floor: it puts
    # that item alone), LPT with them (KK's blocks rarely reach it).
    first_kk = with_kk and not equal_count and floor is not None and floor > ws[0]

    def lpt_labels() -> np.ndarray:
        return lpt if lpt is not None else _lpt(ws, k, equal_count)

    if first_kk:  # (whole numbers: KK's own sums are the parts' weights exactly)
        first, top = kk_sorted_top(ws, k)
    else:
        first = lpt_labels()
        top = _max_load(ws, first, k) if floor is not None else 0.0
    starts = [first]
    if floor is not None and top <= floor:
        return first, top
    if first_kk:
        starts.insert(0, lpt_labels())
    elif with_kk:
        starts.append(_kk(ws, k, equal_count))
    best, top = _lightest(ws, k, starts)
    if floor is not None and top <= floor:
        return best, top
    reached = floor or 0.0
    small = len(ws) <= EXHAUSTIVE_UP_TO
    refined = [
        refine(ws, best, k, equal_count=equal_count, max_steps=2 * k + REFINE_STEPS,
               max_work=REFINE_WORK, others=not small, floor=reached)
    ]  # fmt: skip
    bound = max(lower_bound(ws, k, equal_count=equal_count), reached) if small else 0.0
    if small and _max_load(ws, refined[0], k) > bound:  # also the exhaustive pair search
        steps = PAIR_STEPS * (len(ws) + k)
        refined += [
            refine_pairs(ws, s, k, equal_count=equal_count, max_steps=steps, max_work=PAIR_WORK,
                         floor=bound)
            for s in starts
        ]  # fmt: skip
    better, better_top = _lightest(ws, k, refined)
    return (better, better_top) if better_top <= top else (best, top)


def _deal(ws: np.ndarray, k: int, equal_count: bool, floor: float) -> np.ndarray:
    """``deal`` towards ``floor``, finished by the budgeted refinement if it stops short."""
    labels = deal(ws, k, equal_count=equal_count, target=floor)
    if _max_load(ws, labels, k) > floor:
        labels = refine(ws, labels, k, equal_count=equal_count, max_steps=2 * k + REFINE_STEPS,
                        max_work=REFINE_WORK, floor=floor)  # fmt: skip
    return labels


def whole_bound(ws: np.ndarray, k: int, *, equal_count: bool) -> float | None:
    """``lower_bound`` rounded up, for whole-number weights (sorted heaviest first) whose total
    is below 2^53 (so every part's sum is exact); ``None`` for other weights.

    Every part's sum is a multiple of g, the weights' greatest common divisor, so the heaviest
    weighs at least ceil(total / k) rounded up to a multiple of g: a split that reaches this
    bound is optimal. Example: weights 64, 128, 192 (g = 64) into 2 parts: 384 / 2 = 192.
    """
    return _whole_bound(ws, k, equal_count=equal_count)[0]


def _whole_bound(
    ws: np.ndarray, k: int, *, equal_count: bool, whole: bool = False
) -> tuple[float | None, bool]:
    """``whole_bound``, and whether it lies above the largest item's part with equal counts
    (that item with the n/k - 1 smallest; always when there is no such part to count).
    ``whole``: the weights are known to be whole numbers."""
    total = float(ws.sum())
    if not total < 2.0**53:
        return None, False
    if not (whole or (ws.astype(np.int64) == ws).all()):
        return None, False
    bound = max(-(-int(total) // k), int(ws[0]) if len(ws) else 0)
    m = len(ws) // k
    least_part = 0
    if equal_count and m > 1:  # the largest item's part holds m - 1 others, at least the smallest
        least_part = int(ws[0] + ws[len(ws) - (m - 1) :].sum())
        bound = max(bound, least_part)
    g = math.gcd(*map(int, ws[:GCD_FIRST].tolist()))  # (plain Python: a rare ufunc costs more)
    if g != 1 and len(ws) > GCD_FIRST:  # (the gcd of all divides that of the first few)
        g = int(np.gcd.reduce(ws.astype(np.int64)))
    floor = -(-bound // g) * g if g > 1 else bound
    return float(floor), least_part < floor


GCD_FIRST = 16
"""``whole_bound`` takes the gcd of the first this many weights first: when it is 1 (lengths,
almost always) so is the gcd of all."""


METHODS: dict[str, Callable[[np.ndarray, int, bool], np.ndarray]] = {
    "auto": _auto,
    "kk": _kk,
    "lpt": _lpt,
    "refined": _refined,
}
"""Partitioners by name: ``(weights sorted heaviest first, k, equal_count) -> [n] part``."""


def _check(weights: np.ndarray, k: int, method: str) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise RolltoolError(f"weights must be one-dimensional, got shape {w.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RolltoolError(f"the number of parts must be an integer >= 1, got {k!r}")
    if method not in METHODS:
        raise RolltoolError(
            f"unknown partition method {method!r}",
            hint=f"choose one of {', '.join(sorted(METHODS))}",
        )
    if len(w) > STABLE_SORT_MAX or k == 1:  # else the sort's ends tell (``_sorted``)
        _check_values(w)
    return w


def _check_values(w: np.ndarray) -> None:
    """Raise unless every weight is finite and >= 0."""
    if len(w) and not (w.min() >= 0.0 and w.max() < np.inf):  # (a NaN fails the first)
        i = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
        raise RolltoolError(f"weight of item {i} is {w[i]!r}; weights must be finite and >= 0")


def _sorted(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``descending_order(w)``, the weights in that order and whether the sort learnt that they
    are whole numbers (``_descending``), raising unless every weight is finite and >= 0: up to
    ``STABLE_SORT_MAX`` weights every path of ``descending_order`` sorts any floats (a NaN
    last), so the ends tell, without a pass for the least and the largest (``_check`` makes
    that pass for more weights, whose packed keys assume proper ones)."""
    order, whole = _descending(w)
    ws = w[order]
    if len(ws) and not (ws[-1] >= 0.0 and ws[0] < np.inf):  # (a NaN fails the first)
        _check_values(w)
    return order, ws, whole


def balance_labels(
    weights: np.ndarray, k: int, *, equal_count: bool = False, method: str = "auto"
) -> np.ndarray:
    """Like ``balance`` but returns ``[n]`` int64: the part (0..k-1) of each item."""
    return _as_labels(_split(weights, k, equal_count, method))


def _split(weights: np.ndarray, k: int, equal_count: bool, method: str) -> np.ndarray:
    """``balance_labels``' labels, or ``[k, n // k]`` item indices of each part (in no order
    within a row) where ``auto`` found them so (``_auto_split``)."""
    w = _check(weights, k, method)
    n, k = len(w), int(k)
    if n == 0 or k == 1:
        return np.zeros(n, dtype=np.int64)
    order, ws, whole = _sorted(w)
    if method == "auto":
        split = _auto_split(ws, k, equal_count, whole=whole)
        if split.ndim == 2:
            return order[split]
    else:
        split = METHODS[method](ws, k, equal_count)
    labels = np.empty(n, dtype=np.int64)
    labels[order] = split
    return labels


def refined_and_lpt_labels(
    weights: np.ndarray, k: int, *, equal_count: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``balance_labels`` by ``refined`` and by ``lpt``, the same labels as two calls, with one
    sort and one LPT (``refined`` starts from LPT): the lockstep planner's two rank splits."""
    w = _check(weights, k, "refined")
    n, k = len(w), int(k)
    if n == 0 or k == 1:
        zero = np.zeros(n, dtype=np.int64)
        return zero, zero.copy()
    order, ws, _ = _sorted(w)
    lpt_sorted_labels = _lpt(ws, k, equal_count)
    out = []
    for sorted_labels in (_refined(ws, k, equal_count, lpt=lpt_sorted_labels), lpt_sorted_labels):
        labels = np.empty(n, dtype=np.int64)
        labels[order] = sorted_labels
        out.append(labels)
    return out[0], out[1]


def balance(
    weights: np.ndarray, k: int, *, equal_count: bool = False, method: str = "auto"
) -> list[np.ndarray]:
    """Split item indices ``0..n-1`` into ``k`` parts, minimizing the heaviest part's weight.

    ``weights``: ``[n]`` non-negative finite numbers (tokens, FLOPs...). Returns ``k`` int64
    arrays of item indices, each ascending; every index appears in exactly one part; parts may
    be empty when ``n < k``. With ``equal_count`` part sizes differ by at most one (exactly equal
    when k divides n). Deterministic: the same input gives the same parts.
    """
    split = _split(weights, k, equal_count, method)
    if split.ndim == 2:  # each part's items at once: no labels to split
        return list(np.sort(split, axis=1))
    return split_labels(split, int(k))


STABLE_SORT_MAX = 2048
"""``descending_order`` sorts up to this many weights with one stable sort (measured faster)."""

RADIX_FROM = 1024
"""From this many weights ``descending_order`` tries 16-bit keys (a radix sort; below, the
stable sort of the weights is as fast)."""


def descending_order(w: np.ndarray) -> np.ndarray:
    """Indices that sort ``w`` heaviest first, ties by index: a stable sort, done faster
    (``_descending``)."""
    return _descending(w)[0]


def _descending(w: np.ndarray) -> tuple[np.ndarray, bool]:
    """``descending_order(w)``, and True where it learnt on the way that every weight is a
    whole number (16-bit keys below a whole largest weight; False: not known).

    Whole-number weights within 65,535 of the largest (token lengths) from ``RADIX_FROM`` items:
    a stable sort of the 16-bit keys largest - weight, which NumPy does by radix (1,024 synth
    lengths 30 -> 18 µs, 16,384: 1.3 -> 0.18 ms), where every weight is exactly largest - key
    (a weight far below the largest's precision, 1e-17 beside 3, would share 0's key). Else up to ``STABLE_SORT_MAX`` items a stable
    sort is fastest. Beyond that a plain (unstable) sort is several times faster than a stable
    one, on unique integer keys, which any sort orders alike: (largest - weight, index) packed in
    one int64 when the weights are whole numbers (2x faster at 16,384), else (value rank, index)
    after a first sort when there are ties.
    """
    n = len(w)
    if n >= RADIX_FROM:
        top = float(w.max())
        if top - float(w.min()) < 2.0**16:
            key = (top - w).astype(np.uint16)
            if (top - key == w).all():  # every weight is top - key exactly: the same order
                return np.argsort(key, kind="stable"), top.is_integer()
    if n <= STABLE_SORT_MAX:
        return np.argsort(-w, kind="stable"), False
    top = float(w.max())
    if top * n < 2.0**62 and np.array_equal(w, np.trunc(w)):
        return np.argsort((top - w).astype(np.int64) * n + np.arange(n)), True
    order = np.argsort(-w)
    s = w[order]
    new = np.empty(n, dtype=bool)
    new[:1] = True
    np.not_equal(s[1:], s[:-1], out=new[1:])
    if new.all():
        return order, False
    key = np.empty(n, dtype=np.int64)
    key[order] = (np.cumsum(new) - 1) * n
    key += np.arange(n)
    return np.argsort(key), False


def split_labels(labels: np.ndarray, k: int) -> list[np.ndarray]:
    """``[n]`` part per item -> ``k`` ascending index arrays (the inverse of a labelling)."""
    # a stable sort of 16-bit keys is a radix sort: several times faster than on int64
    keys = labels.astype(np.int16) if k <= INT16_MAX else labels
    order = np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    return cut(order, np.bincount(labels, minlength=k).tolist())


INT16_MAX = 32767
"""The largest 16-bit key (``np.iinfo(np.int16).max``, which builds an object per call)."""


def part_loads(weights: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """``[k]`` float64: the summed weight of each part."""
    w = np.asarray(weights, dtype=np.float64)
    return np.array([float(w[p].sum()) for p in parts], dtype=np.float64)


def lower_bound(weights: np.ndarray, k: int, *, equal_count: bool = False) -> float:
    """A lower bound on the heaviest part of any split into k parts.

    ``max(total / k, largest item)``; with equal counts also the largest item plus the
    ``n // k - 1`` smallest others (the part holding the largest item has that many more).
    """
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0:
        return 0.0
    bound = max(float(w.sum()) / k, float(w.max()))
    if equal_count:
        m = max(len(w) // k, 1)
        s = np.sort(w)
        bound = max(bound, float(s[-1] + s[: m - 1].sum()))
    return bound
