"""Bin packing under a hard token cap: first-fit decreasing, and cost-balanced packing.

Both take items already sorted longest first (with a cost that never falls as length grows,
that is also costliest first) and return ``[n]`` int64 bin labels. Neither ever puts more than ``cap``
tokens in a bin.

* ``ffd``: first-fit decreasing by tokens, the classic few-bins packer (at most 11/9·OPT + 6/9
  bins). A segment tree over the bins' free space finds the first bin that fits in O(log bins).
* ``pack_balanced``: exactly ``bins`` bins, each item to the *cheapest* bin (by cost so far) that
  still has room for it; ``None`` when some item fits nowhere. Equal-cost bins are what lockstep
  execution wants; the cap is respected first.

* ``first_fit_fits``: whether FFD (any first fit) needs at most ``bins`` bins, from the free
  space alone: the planner's FFD count without the FFD, where it is the token bound's.

* ``split_tokens``: exactly ``bins`` bins balanced by *tokens* (LPT or Karmarkar-Karp, the peers'
  way), ``None`` when a bin ends up over the cap. At a tight cap an even token split can fit where
  neither FFD nor cost-balanced packing does (the count search in ``plan.py`` tries all three).

Example (cap 8, tokens 7 ×8, the peer's bad case): FFD -> 8 bins of 7 tokens; ``pack_balanced``
into 4 bins -> ``None`` (no two 7s fit together), never a 14-token bin.

Example (cap 300, 20 lengths summing to 1,491, issue 10): FFD needs 6 bins; KK by tokens into 5
bins gives 298, 298, 299, 298, 298 tokens, so ``split_tokens(..., 5, "kk")`` fits.
"""

from __future__ import annotations

import heapq

import numpy as np

from rolltool.plan.partition.kk import kk_sorted
from rolltool.plan.partition.lpt import lpt_sorted

SPLITTERS = {"kk": kk_sorted, "lpt": lpt_sorted}
"""Token splitters by name: ``(weights sorted heaviest first, k) -> [n] part``."""


def ffd(tokens: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
    """First-fit decreasing: ``[n]`` tokens (sorted longest first, each <= cap) -> (labels, bins)."""
    n = len(tokens)
    if n == 0:
        return np.empty(0, dtype=np.int64), 0
    # First fit leaves at most one bin half full or less (an item of a later such bin would
    # have fitted the earlier one), so it opens at most 2 · tokens / cap + 1 bins: the tree
    # needs that many leaves, not n (a rank's 128 samples into 5 bins: depth 3, not 7)
    most = min(n, 2 * int(tokens.sum()) // cap + 2)
    if most <= LINEAR_UP_TO:
        return _ffd_linear(tokens.tolist(), cap)
    size = 1
    while size < most:
        size *= 2
    # free[size + b] = free tokens of bin b (unopened bins are empty: cap free); inner nodes: max
    free = [cap] * (2 * size)
    labels: list[int] = []
    put = labels.append
    opened = 0
    for t in tokens.tolist():
        node = 2  # down to the leftmost leaf with free >= t (the root always qualifies)
        while node < size:
            if free[node] < t:
                node += 1
            node += node
        if free[node] < t:
            node += 1
        b = node - size
        put(b)
        if b == opened:
            opened += 1
        room = free[node] - t
        free[node] = room
        while node > 1:  # up while a parent's max changes: max(its children)
            sibling = free[node ^ 1]
            if sibling > room:
                room = sibling
            node >>= 1
            if free[node] == room:
                break
            free[node] = room
    return np.array(labels, dtype=np.int64), opened


def first_fit_fits(tokens: np.ndarray, cap: int, bins: int) -> bool:
    """Whether first fit puts ``[n]`` tokens (in this order, each <= cap) into at most ``bins``
    bins, mostly told by the free space alone: before item j the bins have
    ``bins · cap - (tokens before j)`` free tokens in all, and when that is more than
    ``bins · (t_j - 1)`` some bin has ``t_j`` free (pigeonhole): item j cannot open bin
    ``bins + 1``. The items where that does not hold are packed (``ffd``) up to the last of them
    when they are among the first quarter (a few samples as long as the cap, typically): if
    those fit the bins, the rest cannot fail. False: it may or may not fit (the caller runs
    ``ffd``). So the planner has FFD's count, where it is the token bound's, without its FFD.

    Example: tokens 7, 5, 3, 2 into 2 bins of 10: free before each 20, 13, 8, 5 > 12, 8, 4, 2:
    True (FFD: {7, 3}, {5, 2}). Tokens 10, 10, 2, 2, 2, 1, 1, 1 into 3 bins of 10: free 30, 20,
    10, 8, 6, 4, 3, 2 against 27, 27, 3, 3, 3, 0, 0, 0: only the second 10 is unsure; packed,
    the two 10s take 2 bins <= 3: True. Tokens 6, 6, 6 into 2 bins of 10: False (FFD needs 3).
    """
    if bins < 1:
        return len(tokens) == 0
    t = np.asarray(tokens, dtype=np.int64)
    before = np.cumsum(t) - t  # tokens placed before each item
    unsure = np.flatnonzero(bins * cap - before <= bins * (t - 1))
    if not len(unsure):
        return True
    if int(t[unsure].max()) > cap:  # an item over the cap is always unsure: ffd's count of
        return False  # it would mean nothing (the planner refuses such items before)
    upto = int(unsure[-1]) + 1
    return upto <= len(t) // 4 and ffd(t[:upto], cap)[1] <= bins


LINEAR_UP_TO = 40
"""`ffd` scans the open bins in order, not a segment tree, when it can open at most this many
(a rank's bins in a step, typically): the same first fit in fewer Python steps per item (128
samples, at most 25 bins: 54 against 58 µs; 256 samples, at most 48: 159 against 136 µs)."""


def _ffd_linear(tokens: list[int], cap: int) -> tuple[np.ndarray, int]:
    free: list[int] = []
    labels: list[int] = []
    put = labels.append
    for t in tokens:
        for b, room in enumerate(free):
            if room >= t:
                free[b] = room - t
                put(b)
                break
        else:
            put(len(free))
            free.append(cap - t)
    return np.array(labels, dtype=np.int64), len(free)


def pack_balanced(costs: np.ndarray, tokens: np.ndarray, cap: int, bins: int) -> np.ndarray | None:
    """Each item to the cheapest of ``bins`` bins with room for it; ``None`` if one fits nowhere.

    ``[n]`` float64 costs and ``[n]`` int tokens, sorted longest first (then costs are
    non-increasing too) -> ``[n]`` int64 bin labels. Ties go to the lower bin index.

    Bins too full for the current item wait in a second heap keyed by free room and come back
    when the items get short enough, so each bin is looked at O(1) times per item it receives.
    """
    n = len(costs)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    ts = tokens.tolist()
    # a bin with less room than the shortest item is closed for good (one bound for every item,
    # not the shortest still to come: a waiting bin comes back only for an item that fits it,
    # so a looser bound gives the same labels, and the items come longest first anyway)
    least = int(np.minimum.reduce(tokens))
    ready = [(0.0, b) for b in range(bins)]  # (cost so far, bin): bins with room for the item
    waiting: list[tuple[int, float, int]] = []  # (-room, cost so far, bin)
    room = [cap] * bins
    labels: list[int] = []
    put = labels.append
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for c, t in zip(costs.tolist(), ts, strict=True):
        while waiting and -waiting[0][0] >= t:
            _, load, b = pop(waiting)
            push(ready, (load, b))
        while ready:
            load, b = ready[0]
            if room[b] >= t:
                break
            pop(ready)
            if room[b] >= least:
                push(waiting, (-room[b], load, b))
        else:
            return None
        put(b)
        room[b] -= t
        replace(ready, (load + c, b))
    return np.array(labels, dtype=np.int64)


def split_tokens(tokens: np.ndarray, cap: int, bins: int, method: str) -> np.ndarray | None:
    """``[n]`` tokens (sorted longest first) split into ``bins`` parts of about equal tokens by
    ``method`` (``kk`` or ``lpt``) -> ``[n]`` int64 bin labels, or ``None`` if a bin holds more
    than ``cap`` tokens."""
    if len(tokens) == 0:
        return np.empty(0, dtype=np.int64)
    labels = SPLITTERS[method](np.asarray(tokens, dtype=np.float64), bins)
    if np.bincount(labels, weights=tokens, minlength=bins).max() > cap:
        return None
    return labels
