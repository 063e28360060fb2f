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
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUERIES", "deal", "serpentine", "transfer_rounds"]

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
    receivers lightest first, each transfer the smaller of what is left on either side."""
    over = np.flatnonzero(loads > target)
    over = over[np.argsort(-loads[over], kind="stable")]
    under = np.flatnonzero(loads < target)
    under = under[np.argsort(loads[under], kind="stable")]
    supply = (loads[over] - target).tolist()
    room = (target - loads[under]).tolist()
    src: list[int] = []
    dst: list[int] = []
    amount: list[float] = []
    i = j = 0
    while i < len(supply) and j < len(room):
        d = min(supply[i], room[j])
        src.append(int(over[i]))
        dst.append(int(under[j]))
        amount.append(d)
        supply[i] -= d
        room[j] -= d
        i += supply[i] <= 0
        j += room[j] <= 0
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
