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
        top = float(loads[h])
        light = np.argsort(loads, kind="stable")[: partners + 1]
        light = light[(light != h) & (loads[light] < top)][:partners]
        xh = members[h]
        if len(light) == 0 or len(xh) == 0 or max_work <= 0:
            break
        xv = w[xh]
        xo = np.argsort(xv, kind="stable")
        xs = xv[xo]
        best = top
        op: tuple[str, int, int, np.ndarray | None, list[int] | None] | None = None
        # swaps: for each partner item y, the items x of h nearest y + g/2
        sizes = [len(members[p]) for p in light]
        max_work -= len(xh) + sum(sizes)
        if sum(sizes):
            ys_idx = np.concatenate([members[p] for p in light])
            ys = w[ys_idx]
            owner = np.repeat(np.arange(len(light)), sizes)
            g = top - loads[light][owner]
            hi = np.minimum(np.searchsorted(xs, ys + g / 2), len(xs) - 1)
            cand = np.concatenate([np.maximum(hi - 1, 0), hi])
            d = xs[cand] - np.concatenate([ys, ys])
            g2 = np.concatenate([g, g])
            val = np.where((d > 0) & (d < g2), np.maximum(top - d, top - g2 + d), np.inf)
            j = int(np.argmin(val))
            if val[j] < best:
                j2 = j % len(ys)
                best, op = float(val[j]), ("swap", int(cand[j]), j2, owner, sizes)
        if allow_moves:
            g = top - loads[light]
            hi = np.minimum(np.searchsorted(xs, g / 2), len(xs) - 1)
            cand = np.concatenate([np.maximum(hi - 1, 0), hi])
            d = xs[cand]
            g2 = np.concatenate([g, g])
            val = np.where((d > 0) & (d < g2), np.maximum(top - d, top - g2 + d), np.inf)
            j = int(np.argmin(val))
            if val[j] < best:
                best, op = float(val[j]), ("move", int(cand[j]), j % len(light), None, None)
        if op is None:
            if partners < k - 1:  # stuck with the lightest few: look at every part once
                partners = k - 1
                continue
            break
        partners = PARTNERS
        kind, xi, j, op_owner, op_sizes = op
        x_at = int(xo[xi])  # position of x inside members[h]
        x_item = int(xh[x_at])
        if kind == "swap":
            assert op_owner is not None and op_sizes is not None
            p = int(light[op_owner[j]])
            y_at = j - sum(op_sizes[: op_owner[j]])
            y_item = int(members[p][y_at])
            d = w[x_item] - w[y_item]
            members[h][x_at], members[p][y_at] = y_item, x_item
        else:
            p = int(light[j])
            d = w[x_item]
            members[h] = np.delete(members[h], x_at)
            members[p] = np.append(members[p], x_item)
        loads[h] -= d
        loads[p] += d
    out = np.empty(n, dtype=np.int64)
    for p, m in enumerate(members):
        out[m] = p
    return out
