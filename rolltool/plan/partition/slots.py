"""Lockstep slots: bins -> a ``[dp][M]`` grid, and the slot-aware refill that keeps a plan balanced
when the cost model is off.

Under FSDP/ZeRO-3 or tensor parallelism the ranks meet at every micro-batch, so a step costs
Σ_j max_r cost(r, j): slot j (the j-th micro-batch of every rank) waits for its costliest bin. Bins
of one slot need equal cost, not bins of different slots.

* ``bins_to_slots``: bins sorted by cost, dealt into M slots of dp bins, then each slot's bins
  spread over the ranks (``slots_to_grid``) so that rank totals stay even too.
* ``refill``: the robust variant. Equal cost can hide unequal tokens: a bin with one long sample
  and a bin of many short ones cost the same under ``a·L + b·L²`` and not under ``a·L + 2b·L²``.
  ``refill`` takes the shortest samples out, groups the remaining bins into slots by Σ L² (so a
  slot's bins hold similar long samples), and puts the short samples back one by one (longest
  first) where they raise Σ_j max_r cost the least, counting as raised what a slot's bins can
  no longer reach under the cap, and preferring a bin whose slot max they stay under. The bins
  of a slot end with about equal cost *and* equal Σ L², hence equal tokens: any cost
  a'·L + b'·L² near the planning model stays balanced.
* ``choose``: the plan with the lowest lockstep cost, except that among plans within
  ``ROBUST_TOLERANCE`` of it the one with the lowest lockstep cost in tokens wins.

Example (dp 2, cost L + L²/10, lengths 10, 9, 4, 3, 3, 2, 1, cap 12): the grid with slots
{10 | 9, 1} (20 | 18.2) and {4, 3, 3, 2 | -} (15.8 | 0) steps in 35.8 (ideal 27.0). ``refill``
with 4 short samples out (3, 3, 2, 1) leaves {10}, {9}, {4}, {} grouped by Σ L² into {10 | 9} and
{4 | -}, and puts them back: slots {10, 1 | 9, 3} (21.1 | 21.0) and {4 | 3, 2} (5.6 | 6.3): 27.4.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rolltool.plan.partition import metrics
from rolltool.plan.partition.balance import split_labels
from rolltool.util.ranges import cut

__all__ = [
    "FEW_FILLS",
    "FEW_PER_BIN",
    "FILL_PER_BIN",
    "ROBUST_TOLERANCE",
    "Grid",
    "bins_to_slots",
    "choose",
    "members",
    "refill",
    "slots_to_grid",
]

# A grid is [dp][M] lists of sample-index arrays: grid[r][j] is rank r's micro-batch j.
Grid = list[list[np.ndarray]]

FILL_PER_BIN = 0.5
"""``refill``'s candidate for every step: take out this many short samples per bin (on average)
and put them back. Cheap, and enough when bins hold many samples (one per bin did no better on
the benchmark's synth steps, a quarter worse)."""

FEW_PER_BIN = 4
"""Samples per bin (on average) up to which a step is heavy-tailed enough for ``FEW_FILLS``."""

FEW_FILLS = (1.0, 4.0)
"""``refill`` candidates for a step with up to ``FEW_PER_BIN`` samples per bin, the first of
them also for a second round on the chosen grid: four per bin regroups nearly every sample from
scratch (two and three per bin never did better on the benchmark's agent steps)."""

RAISE_FIRST = 8
"""``refill``: bins whose raise is priced exactly first (the lowest lower bounds)."""

ROBUST_TOLERANCE = 5e-4
"""``choose`` trades up to this much lockstep cost (of the ideal) for the best balance in tokens:
a model off by 2x in its L² term costs far more than 0.05% on the planning model."""


def members(labels: np.ndarray, order: np.ndarray | None, nb: int) -> list[np.ndarray]:
    """Sample indices of each bin, ascending: ``labels[i]`` is the bin of sample ``order[i]``
    (``order=None``: of sample ``i``)."""
    if order is None:  # samples in index order: the labels' own split
        return split_labels(labels, nb)
    if len(order) and int(order.max()) + 1 == len(order):  # every sample 0..n-1 (each once):
        in_order = np.empty(len(order), dtype=labels.dtype)  # the labels in sample order,
        in_order[order] = labels  # split by one radix sort (~2x faster than the key sort)
        return split_labels(in_order, nb)
    if len(order):  # (bin, sample) as one int64 key, unique: any sort orders it alike
        by_bin = order[np.argsort(labels * (int(order.max()) + 1) + order)]
    else:
        by_bin = order
    return cut(by_bin, np.bincount(labels, minlength=nb).tolist())


def bins_to_slots(labels: np.ndarray, order: np.ndarray, cost: np.ndarray, dp: int, m: int) -> Grid:
    """Bins (labels over ``order``) -> ``[dp][m]`` grid: slots of dp similar-cost bins.

    Bins are sorted by cost, dealt into m slots of dp (``slots_to_grid``).
    """
    nb = dp * m
    bin_cost = np.bincount(labels, weights=cost[order], minlength=nb)
    by_cost = np.argsort(-bin_cost, kind="stable").reshape(m, dp)  # slot j: bins by_cost[j]
    return slots_to_grid(members(labels, order, nb), bin_cost, by_cost)


def slots_to_grid(bins: Sequence[np.ndarray], bin_cost: np.ndarray, slots: np.ndarray) -> Grid:
    """``[m, dp]`` bin numbers per slot -> ``[dp][m]`` grid; rank totals kept even.

    Slots with the widest spread go first; within a slot the heaviest bin goes to the rank with
    the lightest total so far. Permuting bins within a slot leaves the lockstep cost unchanged.
    """
    m, dp = slots.shape
    heavy_first = (-bin_cost[slots]).argsort(axis=1, kind="stable")
    heavy_first += np.arange(0, m * dp, dp)[:, None]  # flat positions (take_along_axis: 3x slower)
    slots = slots.ravel()[heavy_first]
    slot_costs = bin_cost[slots]
    grid: Grid = [[np.empty(0, dtype=np.int64)] * m for _ in range(dp)]
    spread = slot_costs[:, 0] - slot_costs[:, -1] if m else np.empty(0)
    # Python floats and a stable sort of dp of them: the same sums and order as NumPy's, faster
    totals = [0.0] * dp
    cost_rows, slot_rows = slot_costs.tolist(), slots.tolist()
    for j in np.argsort(-spread, kind="stable").tolist():
        ranks = sorted(range(dp), key=totals.__getitem__)
        for r, c, b in zip(ranks, cost_rows[j], slot_rows[j], strict=True):
            totals[r] += c
            grid[r][j] = bins[b]
    return grid


def grid_labels(grid: Grid, n: int) -> np.ndarray:
    """``[n]`` int64: bin number ``j·dp + r`` of each sample of the grid."""
    dp = len(grid)
    labels = np.empty(n, dtype=np.int64)
    flat = [mb for row in grid for mb in row]  # rank-major: cell r·M + j
    if flat:
        m = len(grid[0])
        cell = np.arange(len(flat))
        sizes = np.fromiter((len(mb) for mb in flat), dtype=np.int64, count=len(flat))
        where = np.concatenate(flat).astype(np.int64, copy=False)
        labels[where] = np.repeat(cell % m * dp + cell // m, sizes)
    return labels


def refill(
    grid: Grid,
    length: np.ndarray,
    cost: np.ndarray,
    cap: int,
    fillers: int,
    order: np.ndarray | None = None,
) -> Grid | None:
    """Regroup a grid's bins into slots by Σ L² after taking out its ``fillers`` shortest samples,
    then put those back where they raise the lockstep cost least (see the module docstring).
    ``order``: the samples longest first, ties by index, if the caller has it (else sorted here).

    ``None`` if some sample finds no bin with room (then keep the grid as it was). Bins never
    exceed ``cap`` tokens; the micro-batch count stays the same.
    """
    dp, m, n = len(grid), len(grid[0]), len(length)
    nb = dp * m
    if order is None:
        order = np.argsort(-length, kind="stable")
    short = order[n - min(fillers, n) :]  # longest first
    labels = grid_labels(grid, n)
    keep = np.ones(n, dtype=bool)
    keep[short] = False
    sq = np.bincount(labels[keep], weights=length[keep].astype(np.float64) ** 2, minlength=nb)
    slots = np.argsort(-sq, kind="stable")  # new bin b = old bin slots[b]; slot of b: b // dp
    where = np.empty(nb, dtype=np.int64)
    where[slots] = np.arange(nb)
    labels = where[labels]
    # float64 even when every sample is out (bincount of nothing is int64: costs truncated,
    # and an int64 overflow past 9.2e18, a flops cost of a ~4 M-token sample)
    c = np.bincount(labels[keep], weights=cost[keep], minlength=nb).astype(np.float64, copy=False)
    t = np.bincount(labels[keep], weights=length[keep], minlength=nb)
    if not _put_back(short, length, cost, cap, labels, c, t, dp):
        return None
    bins = members(labels, None, nb)
    return slots_to_grid(bins, c, np.arange(nb).reshape(m, dp))


def _put_back(
    items: np.ndarray,
    length: np.ndarray,
    cost: np.ndarray,
    cap: int,
    labels: np.ndarray,
    c: np.ndarray,
    t: np.ndarray,
    dp: int,
) -> bool:
    """Place ``items`` (longest first) into bins ``b`` (slot ``b // dp``), updating ``labels``
    and the bins' costs ``c`` in place (``t``, their tokens, is read); False when one fits
    nowhere.

    A bin's *ceiling* is the cost it would reach filled to the cap with the cheapest tokens
    (``unit`` per token); a bin whose ceiling is under its slot's max is *short* by the
    difference, for good. A sample goes under a slot's max if it can: to the short bin it lifts
    most (a longer sample raises a bin's ceiling), else where it fits tightest under the max.
    Otherwise it raises a slot's max where that adds least to (the max + its bins' shortfall).
    """
    unit = _unit_cost(items, length, cost)
    room = cap - t
    top = np.repeat(c.reshape(-1, dp).max(axis=1), dp)  # per bin: its slot's max
    short = np.maximum(top - c - unit * room, 0.0)
    # ufuncs and methods called directly: the same arithmetic, fewer Python layers per call
    add, sub, mul, maximum, minimum = np.add, np.subtract, np.multiply, np.maximum, np.minimum
    where, any_of, top_of = np.where, np.logical_or.reduce, np.maximum.reduce
    over = np.empty(len(c))  # float64, as c + ci - top is
    for i, ti, ci in zip(items.tolist(), length[items].tolist(), cost[items].tolist(), strict=True):
        ok = room >= ti
        sub(add(c, ci, out=over), top, out=over)  # <= 0: stays under the slot's max
        free = ok & (over <= 0)
        if any_of(free):
            lift = where(free, minimum(short, ci - unit * ti), -1.0)
            most = float(top_of(lift))
            b = int(where(lift >= most, over, -np.inf).argmax())
        elif any_of(ok):
            b = _least_raise(ok, over, c, room, short, ci, unit, dp)
        else:
            return False
        labels[i] = b
        c[b] += ci
        room[b] -= ti
        j = b - b % dp
        if c[b] > top[b]:
            top[j : j + dp] = c[b]
        tj, cj, rj = top[j : j + dp], c[j : j + dp], room[j : j + dp]
        maximum(sub(sub(tj, cj), mul(unit, rj)), 0, out=short[j : j + dp])
    return True


def _least_raise(
    ok: np.ndarray,
    over: np.ndarray,
    c: np.ndarray,
    room: np.ndarray,
    short: np.ndarray,
    ci: float,
    unit: float,
    dp: int,
) -> int:
    """The bin where a sample that fits under no slot's max raises (that max + the shortfall of
    the slot's other bins) least; ties to the most room, then the first bin.

    A raise costs at least ``over - short`` of its bin (the other bins' shortfalls only grow), so
    the exact figure is needed only where that bound is under the best exact one found: the
    ``RAISE_FIRST`` lowest bounds first, then every bin whose bound is not above their best.
    """
    bins = ok.nonzero()[0]
    bound = over[bins] - short[bins]
    tol = 1e-9 * max(abs(ci), 1.0)
    look = bins
    if len(bins) > RAISE_FIRST:
        pick = bound.argpartition(RAISE_FIRST)[:RAISE_FIRST]
        pen = _raise_costs(bins[pick], c, room, over, short, ci, unit, dp)
        need = bound <= float(np.minimum.reduce(pen)) + tol
        if np.count_nonzero(need) == np.count_nonzero(need[pick]):  # each that could win priced
            priced = np.full(len(bins), np.inf)
            priced[pick] = pen
            look, pen = bins[need], priced[need]
        else:
            look = bins[need]
            pen = _raise_costs(look, c, room, over, short, ci, unit, dp)
    else:
        pen = _raise_costs(look, c, room, over, short, ci, unit, dp)
    near = pen <= np.minimum.reduce(pen) + tol
    return int(look[np.where(near, room[look], -1).argmax()])


def _raise_costs(
    bins: np.ndarray,
    c: np.ndarray,
    room: np.ndarray,
    over: np.ndarray,
    short: np.ndarray,
    ci: float,
    unit: float,
    dp: int,
) -> np.ndarray:
    """What raising each of ``bins``' slot max adds: the raise, plus how much more the slot's
    other bins fall short of the new max than of the old (a bin's own shortfall is gone)."""
    new = c[bins] + ci
    slot = (bins - bins % dp)[:, None] + np.arange(dp)  # [k, dp] the bins of each one's slot
    after = np.maximum(new[:, None] - c[slot] - unit * room[slot], 0.0)
    after[slot == bins[:, None]] = 0.0
    return over[bins] + np.add.reduce(after, axis=1) - np.add.reduce(short[slot], axis=1)


def _unit_cost(items: np.ndarray, length: np.ndarray, cost: np.ndarray) -> float:
    """The cheapest cost per token among ``items`` (0.0 if none has tokens)."""
    pos = length[items] > 0
    return float((cost[items][pos] / length[items][pos]).min()) if pos.any() else 0.0


def choose(
    grids: Sequence[Grid],
    cost: np.ndarray,
    length: np.ndarray,
    extra: Sequence[float] | None = None,
) -> int:
    """Index of the grid to keep: the lowest Σ_j max_r cost (plus ``extra[i]``, a charge per
    grid), or, among grids within ``ROBUST_TOLERANCE`` (of the ideal) of it, the lowest
    Σ_j max_r tokens; ties to the lower cost, then the earlier grid."""
    costs = [metrics.grid_costs(g, cost) for g in grids]
    step = [metrics.lockstep_cost(x) + (extra[i] if extra else 0.0) for i, x in enumerate(costs)]
    ideal = metrics.ideal(costs[0]) if len(grids[0]) else 0.0
    near = [i for i, s in enumerate(step) if s <= min(step) + ROBUST_TOLERANCE * ideal]
    if len(near) == 1:  # no tokens to weigh (84% of the choices of lognormal synth steps)
        return near[0]
    tokens = {i: metrics.lockstep_cost(metrics.grid_costs(grids[i], length)) for i in near}
    return min(near, key=lambda i: (tokens[i], step[i], i))
