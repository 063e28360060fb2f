"""Local refinement: lower the heaviest part by one swap (or move) at a time.

Each step looks at the heaviest part h and the ``PARTNERS`` lightest parts p (all parts when
those offer nothing) (gap g = L_h - L_p).
Swapping an item x of h with an item y of p (d = x - y) leaves the pair at max(L_h - d, L_p + d),
best at d = g/2; moving x from h to p is the same with y = 0 (only when counts may change). The
step takes the single swap or move that lowers that pair maximum the most, found with binary
searches over h's sorted weights (O(m log m) NumPy per step for m candidate items), and stops
when no swap or move lowers L_h. Every accepted step lowers the heaviest load and keeps the
partner below it, so the sorted load vector falls lexicographically: no cycles.

Example (k = 2, free): {8, 6 | 7, 4, 5} = 14 | 16, gap 2: move nothing (no item of size 1), swap 7
and 6 (d = 1) -> {8, 7 | 6, 4, 5} = 15 | 15.
"""

from __future__ import annotations

import numpy as np

PARTNERS = 2
"""How many of the lightest parts each step considers as the other side."""


def refine(
    w: np.ndarray, labels: np.ndarray, k: int, *, allow_moves: bool, max_steps: int, max_work: int
) -> np.ndarray:
    """Improve ``labels`` (``[n]`` int64 part of each item); returns new labels.

    Stops after ``max_steps`` steps or once the steps have looked at ``max_work`` items in all
    (a deterministic time budget).
    """
    n = len(w)
    if n == 0 or k < 2:
        return labels
    order = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=k))[:-1]
    members = np.split(order, bounds)
    loads = np.bincount(labels, weights=w, minlength=k)
    partners = PARTNERS
    for _ in range(max_steps):
        h = int(np.argmax(loads))
        light = np.argsort(loads, kind="stable")[: partners + 1]
        light = light[(light != h) & (loads[light] < loads[h])][:partners]
        if len(light) == 0 or len(members[h]) == 0 or max_work <= 0:
            break
        max_work -= len(members[h]) + sum(len(members[p]) for p in light)
        step = _best_step(w, members, loads, h, light, allow_moves)
        if step is None:
            if partners < k - 1:  # stuck with the lightest few: look at every part once
                partners = k - 1
                continue
            break
        partners = PARTNERS
        _apply(w, members, loads, h, *step)
    out = np.empty(n, dtype=np.int64)
    for p, m in enumerate(members):
        out[m] = p
    return out


def _best_step(
    w: np.ndarray,
    members: list[np.ndarray],
    loads: np.ndarray,
    h: int,
    light: np.ndarray,
    allow_moves: bool,
) -> tuple[int, int, int | None] | None:
    """The swap (or move) between the heaviest part h and a part of ``light`` that lowers their
    pair maximum most, as (x's position in members[h], the partner part, y's position in the
    partner's members or None for a move); None when none lowers L_h. A move must beat the best
    swap strictly."""
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
    if allow_moves:  # a move is a swap with y = 0
        val, xi, j = _nearest(xs, np.zeros(len(light)), top - loads[light], top)
        if val < (best[0] if best is not None else top):
            best = (val, xi, int(light[j]), None)
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
