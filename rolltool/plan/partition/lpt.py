"""Longest-processing-time greedy (LPT): each item, heaviest first, goes to the lightest part.

Exact LPT with ties broken by the lower part index, optionally with a per-part item capacity
(parts that are full drop out). Two equivalent engines:

* a heap, one Python step per item (used when k is small);
* rounds: the next b items go, heaviest first, to the b lightest parts, in one NumPy step, for as
  long as that is provably what the heap would do. Item t of a round goes to the t-th lightest
  part p_t exactly when p_t is lighter than every part the round has already fed, i.e. when
  ``load(p_t) < min_{s<t} (load(p_s) + w_s)``; the round stops before the first t that fails the
  test, and when rounds shrink the rest is left to the heap.

Example (k = 2): weights 5, 4, 3, 3 -> part 0 gets 5, part 1 gets 4, then 3 goes to part 1 (4 < 5),
then 3 to part 0 (5 < 7): loads 8 and 7.
"""

from __future__ import annotations

import heapq

import numpy as np

ROUNDS_MIN_K = 24
"""Below this many parts the heap is faster than NumPy rounds."""


def lpt_sorted(ws: np.ndarray, k: int, equal_count: bool = False) -> np.ndarray:
    """LPT over weights already sorted heaviest first: ``[n]`` float64 -> ``[n]`` int64 part.

    With ``equal_count`` a part has room while it holds fewer than ``n // k`` items, or fewer than
    ``n // k + 1`` while fewer than ``n % k`` parts hold that many: sizes end up n//k or n//k + 1.
    """
    n = len(ws)
    cap = Capacity(n // k, n % k) if equal_count else Capacity(n + 1, 0)
    labels = np.empty(n, dtype=np.int64)
    loads = np.zeros(k, dtype=np.float64)
    counts = np.zeros(k, dtype=np.int64)
    alive = np.arange(k, dtype=np.int64)
    i = 0
    if k >= ROUNDS_MIN_K:
        min_round = max(4, k // 8)
        rounds = 0  # a round feeds a part at most once: no part is full before round n // k
        while i < n:
            if len(alive) == k:
                parts = np.argsort(loads, kind="stable")
                lo = loads[parts]
            else:
                la = loads[alive]
                order = np.argsort(la, kind="stable")
                parts, lo = alive[order], la[order]
            b = min(len(parts), n - i)
            crowded = equal_count and rounds >= cap.base
            if crowded:
                # parts already holding n // k items may take only the extras that are left
                at_base = np.cumsum(counts[parts[:b]] == cap.base)
                b = min(b, int(np.searchsorted(at_base, cap.extras, side="right")))
            block = ws[i : i + b]
            t = b
            if b > 1:
                # item t may join part t iff part t is lighter than every part fed before it
                fed_loads = lo[: b - 1] + block[: b - 1]
                if not lo[b - 1] < fed_loads.min():
                    ok = lo[1:b] < np.minimum.accumulate(fed_loads)
                    t = int(ok.argmin()) + 1
            fed = parts[:t] if t < len(parts) else parts
            labels[i : i + t] = fed
            loads[fed] += block[:t]
            i += t
            if crowded:
                cap.extras -= int((counts[fed] == cap.base).sum())
            counts[fed] += 1
            rounds += 1
            if crowded or rounds >= cap.base:
                alive = alive[cap.has_room(counts[alive])]
            if t < min_round:
                break
    if i < n:
        _lpt_heap(ws, labels, loads, counts, alive, i, cap)
    return labels


class Capacity:
    """Room rule for equal counts: ``base`` items per part, ``extras`` parts may hold one more."""

    def __init__(self, base: int, extras: int) -> None:
        self.base = base
        self.extras = extras

    def has_room(self, count: np.ndarray) -> np.ndarray:
        return (count < self.base) | ((count == self.base) & (self.extras > 0))


def _lpt_heap(
    ws: np.ndarray,
    labels: np.ndarray,
    loads: np.ndarray,
    counts: np.ndarray,
    alive: np.ndarray,
    start: int,
    cap: Capacity,
) -> None:
    """Finish LPT from item ``start`` with a heap of (load, part); fills ``labels`` in place."""
    heap = [(float(loads[p]), int(p)) for p in alive]
    heapq.heapify(heap)
    out: list[int] = []
    put, replace, pop = out.append, heapq.heapreplace, heapq.heappop
    if cap.base > len(ws):  # no part can fill: no counts to keep (a third of the time)
        for x in ws[start:].tolist():
            load, p = heap[0]
            put(p)
            replace(heap, (load + x, p))
        labels[start:] = out
        return
    count = counts.tolist()
    base, extras = cap.base, cap.extras
    for x in ws[start:].tolist():
        load, p = heap[0]
        while count[p] >= base and not (count[p] == base and extras > 0):
            pop(heap)  # full (lazily: the extras ran out after it was pushed)
            load, p = heap[0]
        put(p)
        if count[p] == base:
            extras -= 1
        count[p] += 1
        if count[p] > base or (count[p] == base and extras == 0):
            pop(heap)
        else:
            replace(heap, (load + x, p))
    labels[start:] = out
