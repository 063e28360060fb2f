"""Local refinement: lower the heaviest part by single swaps and moves between two parts.

Both engines step between a heavier part a and a lighter part b (gap g = L_a - L_b). Swapping an
item x of a with an item y of b (d = x - y) leaves the pair at max(L_a - d, L_b + d), lower than
L_a exactly when 0 < d < g and best at d = g/2; a move of x from a to b is the same with y = 0. A
move is allowed when counts are free, and with equal counts from a part with one item more to one
with one fewer (a swap with KK's zero padding). Every accepted step lowers the pair maximum and
keeps the other part below the old one, so the sorted load vector falls lexicographically: no
cycles, and the heaviest part never gets heavier.

* ``refine_pairs`` (small inputs, exhaustive): parts a in order heaviest first, for each the
  lighter parts b lightest first; the first pair (a, b) that has an improving swap or move takes
  its best one (lowest pair maximum; ties to the heaviest x, then the heaviest y, a move last),
  then the search starts again from the heaviest part. It stops when no pair of parts has an
  improving swap or move: every pair is balanced as well as one exchange can. A step is one
  NumPy matrix (a's items by the lighter parts' items): O(n²) at worst.
* ``refine`` (large inputs, under a work budget): the heaviest part h with the ``PARTNERS``
  lightest parts, all parts when those offer nothing, and when h is stuck the next heaviest parts
  with every lighter one (that changes h's candidates for the next steps; ``others=False`` stops
  where h is stuck instead); each step takes the best swap or move of its part against the
  partners, found with binary searches over the part's sorted weights (O(m log m) per step for m
  candidate items). Where h is stuck with its lightest partners, ``stuck`` first proves in one
  pass, when it can, that no part has a step left (then it ends: KK's splits of 1,024 FLOPs
  costs into 8 parts always are, and trying every part in turn took 5x as long).

Example (k = 2, free): {8, 6 | 7, 4, 5} = 14 | 16, gap 2: move nothing (no item of size 1), swap 7
and 6 (d = 1) -> {8, 7 | 6, 4, 5} = 15 | 15.
"""

from __future__ import annotations

import numpy as np

from rolltool.util.ranges import concat_ranges

PARTNERS = 2
"""How many of the lightest parts each step of ``refine`` considers as the other side."""

LOOK_COST = 2048
"""``refine_pairs`` charges a look at one part this many matrix cells besides its matrix (about
20 µs of NumPy calls, as long as 2,000 cells take)."""

STUCK_PAIRS = 1 << 11
"""``stuck`` looks at this many pairs of items at most (where parts are near-balanced there are
few: at most 227 for 1,024 FLOPs costs into 8 parts by KK, ~30 µs where trying every part took
~0.7 ms; 4,000-90,000 where it fails, 1,024-4,096 synth lengths into 64 parts)."""


def refine_pairs(
    w: np.ndarray,
    labels: np.ndarray,
    k: int,
    *,
    equal_count: bool,
    max_steps: int,
    max_work: int,
    floor: float = 0.0,
) -> np.ndarray:
    """Exhaustive pairwise refinement of ``labels`` (``[n]`` int64 part of each item, over
    ``w`` sorted heaviest first); returns new labels. At most ``max_steps`` steps, and it stops
    once the steps' matrices hold ``max_work`` cells in all (each look at a part counts
    ``LOOK_COST`` more); it stops early once the heaviest part weighs ``floor`` (a lower bound:
    nothing can do better) or less.

    ``fresh[a, p]``: part p changed since a was last found stuck, so only those partners can
    offer a new step (a stuck part is looked at again only against the parts that changed).
    """
    lab = labels.copy()
    if len(w) == 0 or k < 2:
        return lab
    loads = np.bincount(lab, weights=w, minlength=k)
    sizes = np.bincount(lab, minlength=k)
    fresh = np.ones((k, k), dtype=bool)
    work = [max_work]
    for _ in range(max_steps):
        if loads.max() <= floor or work[0] <= 0:
            break
        step = _first_pair_step(w, lab, loads, sizes, fresh, equal_count, work)
        if step is None:
            break
        x, y, b = step
        a = int(lab[x])
        d = w[x] - (w[y] if y >= 0 else 0.0)
        lab[x] = b
        if y >= 0:
            lab[y] = a
        else:
            sizes[a] -= 1
            sizes[b] += 1
        loads[a] -= d
        loads[b] += d
        fresh[:, [a, b]] = True
        fresh[[a, b]] = True
    return lab


def _first_pair_step(
    w: np.ndarray,
    lab: np.ndarray,
    loads: np.ndarray,
    sizes: np.ndarray,
    fresh: np.ndarray,
    equal_count: bool,
    work: list[int],
) -> tuple[int, int, int] | None:
    """The step of ``refine_pairs``: (x, y or -1 for a move, x's new part b), or None (also
    when ``work[0]``, the work left, runs out; it is charged here)."""
    n, k = len(w), len(loads)
    ids = np.arange(k)
    rank = np.empty(k, dtype=np.int64)
    rank[np.lexsort((ids, loads))] = ids  # lightest first, ties by part index
    for a in np.lexsort((ids, -loads)).tolist():  # heaviest first
        lighter = loads < loads[a]
        partners = lighter & fresh[a]
        if not lighter.any():
            return None  # a is a lightest part, and so is every part after it
        if not partners.any():
            continue
        if work[0] <= 0:
            return None
        work[0] -= LOOK_COST + n * int(sizes[a])
        step = _pair_step(w, lab, loads, sizes, rank, a, partners, equal_count)
        if step is not None:
            return step
        fresh[a] = False  # stuck until a or a part lighter than it changes
    return None


def _pair_step(
    w: np.ndarray,
    lab: np.ndarray,
    loads: np.ndarray,
    sizes: np.ndarray,
    rank: np.ndarray,
    a: int,
    partners: np.ndarray,
    equal_count: bool,
) -> tuple[int, int, int] | None:
    """Part a against the ``partners`` (bool per part, all lighter): the lightest partner b with
    an improving swap or move, and its best one as (x, y or -1, b); None if there is none.

    One matrix of a's items (rows, heaviest first) by the partners' items (columns grouped by
    part, lightest part first, each part's items heaviest first, then its move column)."""
    n = len(w)
    xs = np.flatnonzero(lab == a)
    if len(xs) == 0:
        return None
    ys = np.flatnonzero(partners[lab])
    vb = np.flatnonzero(partners & (sizes < sizes[a])) if equal_count else np.flatnonzero(partners)
    pos = np.concatenate([ys, np.full(len(vb), n)])  # y = n: a move to part vb
    part = np.concatenate([lab[ys], vb])
    o = np.argsort(rank[part] * (n + 1) + pos)
    pos, part = pos[o], part[o]
    yw = np.where(pos < n, w[np.minimum(pos, n - 1)], 0.0)
    lb = loads[part]
    d = w[xs][:, None] - yw[None, :]
    val = np.where((d > 0) & (d < loads[a] - lb), np.maximum(loads[a] - d, lb + d), np.inf)
    ok = val.min(axis=0) < np.inf
    if not ok.any():
        return None
    b = int(part[ok.argmax()])  # the lightest partner with an improving step
    c0, c1 = np.searchsorted(rank[part], [rank[b], rank[b] + 1]).tolist()
    xi, yj = divmod(int(val[:, c0:c1].argmin()), c1 - c0)
    y = int(pos[c0 + yj])
    return int(xs[xi]), (y if y < n else -1), b


def refine(
    w: np.ndarray,
    labels: np.ndarray,
    k: int,
    *,
    equal_count: bool,
    max_steps: int,
    max_work: int,
    others: bool = True,
    floor: float = 0.0,
) -> np.ndarray:
    """Improve ``labels`` (``[n]`` int64 part of each item of ``w``, sorted heaviest first:
    ``stuck`` relies on it); returns new labels.

    Stops after ``max_steps`` steps or once the steps have looked at ``max_work`` items in all
    (a deterministic time budget), and once the heaviest part weighs ``floor`` (a lower bound)
    or less. ``others``: when the heaviest part is stuck, balance the next heaviest ones (else
    stop there).
    """
    n = len(w)
    if n == 0 or k < 2:
        return labels
    order = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=k))[:-1]
    members = np.split(order, bounds)
    loads = np.bincount(labels, weights=w, minlength=k)
    partners = PARTNERS
    prove = True  # try ``stuck`` (until it fails once)
    for _ in range(max_steps):
        h = int(np.argmax(loads))
        if loads[h] <= floor:
            break
        light = np.argsort(loads, kind="stable")[: partners + 1]
        light = light[(light != h) & (loads[light] < loads[h])][:partners]
        if len(light) == 0 or len(members[h]) == 0 or max_work <= 0:
            break
        max_work -= len(members[h]) + sum(len(members[p]) for p in light)
        step = _best_step(w, members, loads, h, light, equal_count)
        if step is None and prove:  # once: where some part has a step, the parts keep moving
            if stuck(w, _labels(members, n), loads, equal_count=equal_count):
                break  # no part has a step: every search below would find none
            prove = False
        if step is None and partners < k - 1:  # stuck with the lightest few: try every part
            partners = k - 1
            continue
        if step is None and others:  # h is stuck: balance the next heaviest part with a lighter one
            h, step, max_work = _next_heaviest_step(w, members, loads, h, equal_count, max_work)
        if step is None:
            break
        partners = PARTNERS
        _apply(w, members, loads, h, *step)
    return _labels(members, n)


def _labels(members: list[np.ndarray], n: int) -> np.ndarray:
    """``[n]`` int64 part of each item, from each part's items."""
    out = np.empty(n, dtype=np.int64)
    for p, m in enumerate(members):
        out[m] = p
    return out


def stuck(w: np.ndarray, labels: np.ndarray, loads: np.ndarray, *, equal_count: bool) -> bool:
    """True when it is proven that no swap or move between two parts lowers their maximum: for
    no parts a, b (L_a > L_b) an item x of a and y of b, or y = 0 for a move (with equal counts
    only to a part with fewer items), have 0 < x - y < L_a - L_b. ``w`` sorted heaviest first.
    False when there is such a step, when more than ``STUCK_PAIRS`` pairs or (item, part) moves
    would be looked at, or when ``w`` is not sorted (never a wrong True: the caller searches on).

    Only pairs with x - y below the spread G = max load - min load can qualify, so each y is
    checked against the items in (y, y + 2G] (contiguous in sorted order; the factor 2 leaves
    room for rounding, the exact test is on the pairs): near-balanced parts leave few pairs."""
    if len(w) > 1 and (w[1:] > w[:-1]).any():
        return False  # not sorted heaviest first: the pair windows below would be wrong
    spread = float(loads.max() - loads.min())
    neg = -w
    first = np.searchsorted(neg, neg)  # the first item of y's run of equal weights
    lo = np.searchsorted(neg, neg - 2 * spread)  # the first item at most 2G above y
    count = first - lo
    pairs = int(count.sum())
    if pairs > STUCK_PAIRS:
        return False
    if pairs:
        y = np.repeat(np.arange(len(w)), count)
        x = concat_ranges(lo, count)
        if (w[x] - w[y] < loads[labels[x]] - loads[labels[y]]).any():
            return False
    small = np.flatnonzero((w > 0) & (w < spread))  # the only items a move can take
    if len(small) * len(loads) > STUCK_PAIRS:
        return False  # too many (item, part) moves to look at
    if len(small):
        allowed = np.ones((len(loads), len(loads)), dtype=bool)
        if equal_count:
            sizes = np.bincount(labels, minlength=len(loads))
            allowed = sizes[:, None] > sizes[None, :]
        a = labels[small]
        if (w[small][:, None] < (loads[a][:, None] - loads[None, :]))[allowed[a]].any():
            return False
    return True


def _next_heaviest_step(
    w: np.ndarray,
    members: list[np.ndarray],
    loads: np.ndarray,
    h: int,
    equal_count: bool,
    max_work: int,
) -> tuple[int, tuple[int, int, int | None] | None, int]:
    """The parts after h, heaviest first, each against every lighter part: the first part a
    with an improving step, as (a, step, work left); (h, None, work left) if none or out of
    work."""
    ids = np.arange(len(loads))
    for a in np.lexsort((ids, -loads)).tolist():
        light = np.flatnonzero(loads < loads[a])
        if a == h or len(members[a]) == 0:
            continue
        if len(light) == 0 or max_work <= 0:
            break
        max_work -= len(members[a]) + sum(len(members[p]) for p in light)
        step = _best_step(w, members, loads, a, light, equal_count)
        if step is not None:
            return a, step, max_work
    return h, None, max_work


def _best_step(
    w: np.ndarray,
    members: list[np.ndarray],
    loads: np.ndarray,
    h: int,
    light: np.ndarray,
    equal_count: bool,
) -> tuple[int, int, int | None] | None:
    """The swap (or move) between part h and a (lighter) part of ``light`` that lowers their
    pair maximum most, as (x's position in members[h], the partner part, y's position in the
    partner's members or None for a move); None when none lowers L_h. A move must beat the best
    swap strictly; with equal counts it goes only to a part with fewer items."""
    xh = members[h]
    top = float(loads[h])
    xv = w[xh]
    xo = np.argsort(xv, kind="stable")
    xs = xv[xo]
    best: tuple[float, int, int, int | None] | None = None
    sizes = [len(members[p]) for p in light]
    if sum(sizes):  # swaps: for each partner item y, the items x of h nearest y + g/2
        ys_idx = np.concatenate([members[p] for p in light])
        owner = np.repeat(np.arange(len(light)), sizes)
        val, xi, j = _nearest(xs, w[ys_idx], top - loads[light][owner], top)
        if val < top:
            o = int(owner[j])
            best = (val, xi, int(light[o]), j - sum(sizes[:o]))
    movable = light[np.array(sizes) < len(xh)] if equal_count else light
    if len(movable):  # a move is a swap with y = 0
        val, xi, j = _nearest(xs, np.zeros(len(movable)), top - loads[movable], top)
        if val < (best[0] if best is not None else top):
            best = (val, xi, int(movable[j]), None)
    if best is None:
        return None
    _, xi, p, y_at = best
    return int(xo[xi]), p, y_at


def _nearest(xs: np.ndarray, ys: np.ndarray, g: np.ndarray, top: float) -> tuple[float, int, int]:
    """Pair each y (its part g below the top) with the items of ``xs`` (sorted) nearest y + g/2;
    the best pair as (pair maximum after exchanging them, x's index in xs, y's index)."""
    hi = np.minimum(np.searchsorted(xs, ys + g / 2), len(xs) - 1)
    cand = np.concatenate([np.maximum(hi - 1, 0), hi])
    d = xs[cand] - np.concatenate([ys, ys])
    g2 = np.concatenate([g, g])
    val = np.where((d > 0) & (d < g2), np.maximum(top - d, top - g2 + d), np.inf)
    j = int(np.argmin(val))
    return float(val[j]), int(cand[j]), j % len(ys)


def _apply(
    w: np.ndarray,
    members: list[np.ndarray],
    loads: np.ndarray,
    h: int,
    x_at: int,
    p: int,
    y_at: int | None,
) -> None:
    """Swap x (members[h][x_at]) with y (members[p][y_at]), or move x to p; update the loads."""
    x_item = int(members[h][x_at])
    if y_at is not None:
        y_item = int(members[p][y_at])
        d = w[x_item] - w[y_item]
        members[h][x_at], members[p][y_at] = y_item, x_item
    else:
        d = w[x_item]
        members[h] = np.delete(members[h], x_at)
        members[p] = np.append(members[p], x_item)
    loads[h] -= d
    loads[p] += d
