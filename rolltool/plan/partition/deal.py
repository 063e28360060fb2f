"""Deal and transfer: a vectorized split for many items per part, aimed at a given heaviest load.

``deal(ws, k, target=...)`` splits weights sorted heaviest first into k parts in a few NumPy
passes, then moves work from parts above ``target`` to parts below it. ``balance``'s ``auto``
uses it when it can prove a split optimal (integer weights: no part can weigh less than
ceil(total / k)) and keeps the result only when the heaviest part reaches that bound.

* **Serpentine deal**: block b of k consecutive items (in sorted order) goes to parts 0..k-1,
  the next block to k-1..0, and so on. Every part gets one item of each block, so counts are
  equal (n // k or n // k + 1), and the loads differ by at most about the first block's spread.
* **Transfer rounds**: each part above ``target`` has a *supply* (its load - target), each part
  below a *capacity* (target - its load). The northwest-corner rule matches them in order
  (heaviest supplier with the lightest receiver first) into at most (suppliers + receivers - 1)
  transfers of an amount d each, which would put every part at the target. A transfer becomes
  one swap: an item x of the supplier and y of the receiver with x - y as near d as the parts
  hold (or a move of x alone, y = 0), found for all transfers at once by one binary search over
  the suppliers' items (for up to ``QUERIES`` of each receiver's items, every s-th). A swap is
  applied only when it lowers the total excess Σ max(load - target, 0) (so the heaviest part
  never gets heavier) and uses no item another transfer of the round took. Rounds repeat until
  the heaviest part weighs ``target`` or less, nothing improves, or ``max_rounds``.

With many items per part the parts hold nearly every difference, so one or two rounds usually
reach the target exactly (16,384 items into 8 or 64 parts: 1-3 rounds).

Example (k = 2, weights 9, 8, 5, 4, 3, 1, target 15): the deal gives {9, 4, 3 | 8, 5, 1} = 16 | 14;
part 0 supplies 1, part 1 takes 1: swap 9 and 8 (d = 1) -> {8, 4, 3 | 9, 5, 1} = 15 | 15.

``deal_exact`` (equal counts, k dividing n) is the same plan with an exact search: every item of
the receiver, a window of acceptable differences instead of one, and each swap checked against
the loads of its moment; it answers ``None`` rather than a split above the target. ``auto`` tries
it first at 128-512 items per part, where its one or two rounds cost less than ``deal``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

__all__ = ["QUERIES", "deal", "deal_exact", "exact_pairs", "serpentine", "transfer_rounds"]

QUERIES = 64
"""Receiver items looked up per transfer (every s-th, s = items // QUERIES): enough to find a
near-exact swap when parts hold hundreds of items, and it bounds a round's work."""


def serpentine(n: int, k: int) -> np.ndarray:
    """``[n]`` int64 part of each item (sorted heaviest first): blocks of k dealt back and forth.

    >>> serpentine(7, 3).tolist()
    [0, 1, 2, 2, 1, 0, 0]
    """
    i = np.arange(n, dtype=np.int64)
    pos = i % k
    return np.where((i // k) % 2 == 0, pos, k - 1 - pos)


def deal(
    ws: np.ndarray, k: int, *, equal_count: bool, target: float, max_rounds: int = 8
) -> np.ndarray:
    """Serpentine deal, then transfer rounds towards ``target``: ``[n]`` int64 part per item.

    ``ws``: ``[n]`` float64 weights sorted heaviest first. With ``equal_count`` the part sizes
    stay n // k or n // k + 1 (moves only from a part with one item more).
    """
    labels = serpentine(len(ws), k)
    if k > 1 and len(ws):
        transfer_rounds(ws, labels, k, equal_count=equal_count, target=target,
                        max_rounds=max_rounds)  # fmt: skip
    return labels


def transfer_rounds(
    ws: np.ndarray,
    labels: np.ndarray,
    k: int,
    *,
    equal_count: bool,
    target: float,
    max_rounds: int,
) -> int:
    """Improve ``labels`` in place (see the module docstring); returns the rounds run."""
    loads = np.bincount(labels, weights=ws, minlength=k)
    sizes = np.bincount(labels, minlength=k)
    rounds = 0
    while rounds < max_rounds and loads.max() > target:
        rounds += 1
        plan = _transfers(loads, target)
        moves = not equal_count or bool(sizes.max() > sizes.min())
        swaps = _best_swaps(ws, labels, sizes, *plan, moves=moves)
        if not _apply(ws, labels, loads, sizes, plan[0], plan[1], swaps, equal_count, target):
            break
    return rounds


def _transfers(loads: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Northwest-corner transfers (supplier, receiver, amount): suppliers heaviest first,
    receivers lightest first, each transfer the smaller of what is left on either side
    (`_windows`' supplier, receiver and least amount, as arrays)."""
    src, dst, amount, _ = _windows(loads.tolist(), target)
    return (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
            np.array(amount, dtype=np.float64))  # fmt: skip


def _members(
    order: np.ndarray, start: np.ndarray, sizes: np.ndarray, parts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The items of each of ``parts`` (``order[start[p]:start[p] + sizes[p]]``, heaviest first)
    concatenated, and the position in ``parts`` each came from."""
    ln = sizes[parts]
    group = np.arange(len(parts), dtype=np.int64).repeat(ln)
    first = (start[parts] - (ln.cumsum() - ln)).repeat(ln)
    return order[first + np.arange(int(ln.sum()))], group


def _best_swaps(
    ws: np.ndarray,
    labels: np.ndarray,
    sizes: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    amount: np.ndarray,
    *,
    moves: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """For each transfer t, the swap (x, y) nearest its amount (y = -1: a move of x alone, looked
    for only with ``moves``), as two ``[T]`` int64 arrays; x = -1 where no swap or move comes
    nearer than doing nothing."""
    nt = len(src)
    xs = np.full(nt, -1, dtype=np.int64)
    ys = np.full(nt, -1, dtype=np.int64)
    if nt == 0:
        return xs, ys
    order = np.argsort(labels.astype(np.int16 if len(sizes) < 2**15 else np.int64), kind="stable")
    start = np.cumsum(sizes) - sizes
    xi, xg = _members(order, start, sizes, src)
    yi, yg = _members(order, start, sizes, dst)
    ln = sizes[dst]
    step = np.maximum(ln // QUERIES, 1).repeat(ln)
    keep = (np.arange(len(yi)) - (ln.cumsum() - ln).repeat(ln)) % step == 0
    yi, yg = yi[keep], yg[keep]
    if len(xi) == 0:
        return xs, ys
    xw, yw = ws[xi], ws[yi]
    off = 2.0 * float(ws[0]) + float(amount.max()) + 1.0  # keys of transfer t in [t·off - W, t·off]
    keys = xg * off - xw  # ascending: by transfer, then lightest x first
    # swaps: for each y, the two x nearest y + d (the first with x <= y + d, and the one before)
    gap = np.full(len(yi), np.inf)
    at = np.zeros(len(yi), dtype=np.int64)
    j = np.searchsorted(keys, yg * off - (yw + amount[yg]))
    _nearer(xw, xg, j, yw, yg, amount[yg], gap, at)
    best = np.full(nt, np.inf)
    counts = np.bincount(yg, minlength=nt)
    has = counts > 0
    if has.any():
        best[has] = np.minimum.reduceat(gap, (np.cumsum(counts) - counts)[has])
    hit = np.flatnonzero(gap == best[yg])  # ascending in yg: the first per transfer
    first = np.searchsorted(yg[hit], np.arange(nt))
    found = np.isfinite(best)
    q = hit[np.minimum(first, max(len(hit) - 1, 0))]
    xs[found] = xi[at[q[found]]]
    ys[found] = yi[q[found]]
    if not moves:
        return xs, ys
    # moves: the x nearest d; kept where nearer than the best swap
    tid = np.arange(nt, dtype=np.int64)
    mgap = np.full(nt, np.inf)
    mat = np.zeros(nt, dtype=np.int64)
    _nearer(xw, xg, np.searchsorted(keys, tid * off - amount), np.zeros(nt), tid, amount, mgap, mat)
    move = mgap < best
    xs[move] = xi[mat[move]]
    ys[move] = -1
    return xs, ys


def _nearer(
    xw: np.ndarray,
    xg: np.ndarray,
    j: np.ndarray,
    yw: np.ndarray,
    yg: np.ndarray,
    want: np.ndarray,
    gap: np.ndarray,
    at: np.ndarray,
) -> None:
    """Candidates ``j - 1`` and ``j`` (positions in the suppliers' items) for each query: keep
    in ``gap``/``at`` the one with x - y nearest ``want`` (0 < x - y < 2·want, same transfer)."""
    for c in (j - 1, j):
        cc = np.minimum(np.maximum(c, 0), len(xw) - 1)  # (np.clip costs 5x as much)
        d = xw[cc] - yw
        miss = np.abs(d - want)
        miss = np.where((xg[cc] == yg) & (d > 0) & (miss < want), miss, np.inf)
        better = miss < gap
        gap[better] = miss[better]
        at[better] = cc[better]


def _apply(
    ws: np.ndarray,
    labels: np.ndarray,
    loads: np.ndarray,
    sizes: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    swaps: tuple[np.ndarray, np.ndarray],
    equal_count: bool,
    target: float,
) -> int:
    """Apply the round's swaps in transfer order, each only if it lowers the total excess over
    ``target`` and touches no item already used this round; returns how many were applied."""
    used: set[int] = set()
    done = 0
    for a, b, x, y in zip(src.tolist(), dst.tolist(), *(s.tolist() for s in swaps), strict=True):
        if x < 0 or x in used or y in used:
            continue
        if y < 0 and equal_count and sizes[a] <= sizes[b]:
            continue
        d = ws[x] - (ws[y] if y >= 0 else 0.0)
        la, lb = loads[a], loads[b]
        before = max(la - target, 0.0) + max(lb - target, 0.0)
        if max(la - d - target, 0.0) + max(lb + d - target, 0.0) >= before:
            continue
        labels[x] = b
        used.add(x)
        if y >= 0:
            labels[y] = a
            used.add(y)
        else:
            sizes[a] -= 1
            sizes[b] += 1
        loads[a] = la - d
        loads[b] = lb + d
        done += 1
    return done


# ---------------------------------------------------------------- equal counts, exact swaps

EXACT_ROUNDS = 3
"""``deal_exact`` runs at most this many rounds (1,024 synth lengths into 8 parts: 1-3)."""

XColumn = Callable[[int, int], int]
"""``exact_pairs``' x columns: (transfer, candidate column) -> x's column in its part."""


def deal_exact(
    ws: np.ndarray, k: int, *, target: float, max_rounds: int = EXACT_ROUNDS
) -> np.ndarray | None:
    """Equal counts, k dividing n: the serpentine deal, then rounds of exact swaps towards
    ``target``: ``[k, n // k]`` int64, row p the positions in ``ws`` of part p's items, with no
    part above ``target``; or ``None`` where ``max_rounds`` rounds do not get there.

    Each round plans the northwest-corner transfers (supplier a, receiver b, amount), and for
    each looks at every pair of an item x of a and y of b (one binary search over every part's
    sorted items per item of b, all transfers at once: ``exact_pairs``) for the swap with x - y
    in a *window*: at least the amount and at most b's room (b stays at or below ``target``;
    a's rest goes to the next receiver), the smallest such; else the largest x - y below the
    amount. Swaps are applied in transfer order, each in the window of that moment (where an
    earlier swap of the round left a or b elsewhere than planned, another of the pairs found is
    taken), only if it lowers the total excess over ``target`` and touches no item swapped this
    round. Against ``transfer_rounds`` (64 sampled items of b, the swap nearest the amount):
    every item, and a window instead of one value, so most transfers land exactly (1,024 synth
    lengths into 8 parts: 39 of 40 seeds reach ``whole_bound``, 16 in one round; LPT on the
    first 4 or 8 blocks instead of the serpentine gets 25 there in one round, 38-39 in all,
    and costs as much as it saves). The loads are kept exactly (whole numbers below 2^53: the
    caller's ``whole_bound``), so a row set returned is within ``target``.
    """
    n = len(ws)
    m = n // k
    if not 2 * k * (3.0 * float(target) + 1.0) < 2.0**53:  # the search's keys exact (below)
        return None
    parts = _serpentine_rows(k, m).copy()  # parts[p]: p's items, heaviest first
    items = ws[parts]  # the items' weights, ``[k, m]``
    loads: list[float] = items.sum(axis=1).tolist()
    top = float(ws[0])
    rounds = 0
    while max(loads) > target:
        if rounds == max_rounds:
            return None
        if rounds:
            items = ws[parts]
        if not _exact_round(items, parts, loads, target, top, rows_sorted=rounds == 0):
            return None
        rounds += 1
    return parts


@lru_cache(maxsize=8)
def _serpentine_rows(k: int, m: int) -> np.ndarray:
    """``[k, m]`` read-only: row p the positions of part p's items in the serpentine deal of
    m blocks of k (``serpentine(k * m, k)`` by part), heaviest first in every row; the last
    few shapes are kept (8, an int64 per item each), as ``auto`` deals the same ones again and again.

    >>> _serpentine_rows(3, 2).tolist()
    [[0, 5], [1, 4], [2, 3]]
    """
    parts = np.arange(k * m, dtype=np.int64).reshape(m, k).T.copy()
    parts[:, 1::2] = parts[::-1, 1::2]
    parts.flags.writeable = False
    return parts


def _windows(
    loads: list[float], target: float
) -> tuple[list[int], list[int], list[float], list[float]]:
    """Northwest-corner transfers (suppliers heaviest first, receivers lightest first): supplier,
    receiver, least amount (what either side has left) and most (the receiver's room left)."""
    over = sorted([p for p, x in enumerate(loads) if x > target], key=loads.__getitem__,
                  reverse=True)  # fmt: skip
    under = sorted([p for p, x in enumerate(loads) if x < target], key=loads.__getitem__)
    src: list[int] = []
    dst: list[int] = []
    least: list[float] = []
    most: list[float] = []
    if not (over and under):
        return src, dst, least, most
    i = j = 0
    supply, room = loads[over[0]] - target, target - loads[under[0]]
    while True:
        d = supply if supply < room else room
        src.append(over[i])
        dst.append(under[j])
        least.append(d)
        most.append(room)
        supply -= d
        room -= d
        if supply <= 0:
            i += 1
            if i == len(over):
                break
            supply = loads[over[i]] - target
        if room <= 0:
            j += 1
            if j == len(under):
                break
            room = target - loads[under[j]]
    return src, dst, least, most


def _exact_round(
    items: np.ndarray,
    parts: np.ndarray,
    loads: list[float],
    target: float,
    top: float,
    *,
    rows_sorted: bool,
) -> int:
    """One round of ``deal_exact`` on ``parts`` (``[k, m]`` items of each part, ``items`` their
    weights) and ``loads``, in place (``items`` is left as it was); returns the swaps applied.
    ``top``: the largest weight; ``rows_sorted``: every part's items are heaviest first."""
    src, dst, least, most = _windows(loads, target)
    if not src:
        return 0
    cand, x_col, planned = exact_pairs(items, src, dst, least, most, rows_sorted=rows_sorted,
                                       top=top)  # fmt: skip
    swaps = _apply_in_window(src, dst, cand, x_col, planned, loads, target)
    if swaps:  # swap by flat positions: x's for y's
        m = parts.shape[1]
        fx = [a * m + x for a, x, _, _ in swaps]
        fy = [b * m + y for _, _, b, y in swaps]
        flat = parts.reshape(-1)
        flat[fx + fy] = flat[fy + fx]
    return len(swaps)


def exact_pairs(
    items: np.ndarray,
    src: list[int],
    dst: list[int],
    least: list[float],
    most: list[float],
    *,
    rows_sorted: bool = False,
    top: float | None = None,
) -> tuple[np.ndarray, XColumn, list[int]]:
    """For each transfer t (an item x of part ``src[t]`` for an item y of ``dst[t]``, x - y in
    [``least[t]``, ``most[t]``]) and each y (column c of ``items[dst[t]]``, ``items``: ``[k, m]``
    non-negative), the pair with the smallest x - y >= least (column c) and the largest below
    (column m + c), found by one binary search over the suppliers' items for every y (every
    part's where the rows are sorted: no copy to make). Exact for whole numbers while
    k · (2·top + max(most) + 1) < 2^53 (the keys' offsets).

    Returns ``cand`` ``[T, 2m]`` (x - y of each pair; inf or <= 0 where there is none),
    ``x_col`` (``x_col(t, c)``: x's column in ``items[src[t]]``) and ``planned`` (``[T]``, the
    column of ``cand`` of the best pair: in the window nearest ``least``, else the largest in
    (0, least); -1 where neither). ``rows_sorted``: each part's items heaviest first; ``top``:
    the largest item, if known.
    """
    m = items.shape[1]
    top = float(items.max()) if top is None else top
    off = 2.0 * top + max(most) + 1.0  # row r's keys lie in [r·off, r·off + top]
    if rows_sorted:  # every part's row, ascending: columns m-1 .. 0 (no copy to make)
        rows, at = items[:, ::-1], src
    else:  # the suppliers' rows only (later rounds have few transfers), each sorted
        sup = sorted(set(src))
        at = [sup.index(a) for a in src]
        order = items[sup].argsort(axis=1)
        rows = items[np.array(sup)[:, None], order]
    nr = len(rows)
    shift = np.arange(0.0, nr * off, off)[:nr, None]
    keys = np.empty(nr * m + 2)  # -inf, the keys, inf: every query falls between two
    keys[0], keys[-1] = -np.inf, np.inf
    np.add(rows, shift, out=keys[1:-1].reshape(nr, m))
    ys = items[dst]
    ys += shift[at]  # y, shifted to its supplier's row
    j = keys.searchsorted(ys + np.array(least)[:, None])  # keys[j]: the first x >= y + least
    jj = np.concatenate((j, j - 1), axis=1)  # that pair (another row's: > most), the one below
    cand = keys[jj]
    nt = len(src)
    np.subtract(cand.reshape(nt, 2, m), ys[:, None], out=cand.reshape(nt, 2, m))  # x - y
    # the smallest x - y >= least (every pair of the first half), lowest column first: in the
    # window if any is; else ``_repick`` (the largest below least)
    planned = cand[:, :m].argmin(axis=1).tolist()
    for t, c in enumerate(planned):
        if not cand[t, c] <= most[t]:
            planned[t] = _repick(cand[t], least[t], most[t])

    def x_col(row: int, c: int) -> int:
        key = int(jj[row, c]) - 1  # keys[0] is the -inf
        return (m - 1) - key % m if rows_sorted else int(order.flat[key])

    return cand, x_col, planned


def _repick(row: np.ndarray, least: float, most: float) -> int:
    """``exact_pairs``' pick for one row of candidates (x - y) and another window (least <=
    most): the column of the smallest in [least, most], else of the largest in (0, least),
    lowest column first on ties; -1 where neither.

    Two NumPy passes where masks took four: the non-negative differences row - least (the
    candidates at or above least) are, read as unsigned 64-bit integers, ordered as their
    values and below every negative one (whose sign bit is set), so ``argmin`` of them is the
    smallest candidate >= least (the first on ties); likewise least - row for the largest
    below (which is never +0 there: a candidate equal to least, <= most, ends the first
    step)."""
    c = int((row - least).view(np.uint64).argmin())
    if least <= row[c] <= most:
        return c
    c = int((least - row).view(np.uint64).argmin())
    return c if 0.0 < row[c] < least else -1


def _apply_in_window(
    src: list[int],
    dst: list[int],
    cand: np.ndarray,
    x_col: XColumn,
    planned: list[int],
    loads: list[float],
    target: float,
) -> list[tuple[int, int, int, int]]:
    """Choose the round's swaps in transfer order: (a, x's column, b, y's column). A
    transfer takes its planned pair if it lies in the window of the moment [min(a's excess,
    b's room), b's room], else the nearest of its pairs that does (or, short of it, the largest
    below); only if it lowers the total excess and touches no item swapped this round."""
    m = cand.shape[1] // 2
    used: set[tuple[int, int]] = set()
    swaps: list[tuple[int, int, int, int]] = []
    for t, (a, b, c) in enumerate(zip(src, dst, planned, strict=True)):
        la, lb = loads[a], loads[b]
        room = target - lb
        want = min(la - target, room)
        if want <= 0.0 or c < 0:
            continue
        d = float(cand[t, c])
        if not want <= d <= room:  # an earlier swap moved a or b: look again
            c = _repick(cand[t], want, room)
            if c < 0:
                continue
            d = float(cand[t, c])
        x, yc = x_col(t, c), c % m
        if (a, x) in used or (b, yc) in used:
            continue
        before = max(la - target, 0.0)
        if max(la - d - target, 0.0) + max(lb + d - target, 0.0) >= before:
            continue
        used.add((a, x))
        used.add((b, yc))
        loads[a], loads[b] = la - d, lb + d
        swaps.append((a, x, b, yc))
    return swaps
