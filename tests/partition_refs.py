"""Slow, obvious partition references shared by the partition tests; not a test module."""

from __future__ import annotations

import heapq

import numpy as np


def _sorted_padded(
    weights: list[float], k: int, equal_count: bool
) -> tuple[list[float], list[int]]:
    """Weights heaviest first (ties by index) and their item indices; -1 marks zero padding."""
    idx = sorted(range(len(weights)), key=lambda i: -weights[i])
    ws = [float(weights[i]) for i in idx]
    while equal_count and len(ws) % k:
        ws.append(0.0)
        idx.append(-1)
    return ws, idx


def reference_kk(weights: list[float], k: int, equal_count: bool) -> list[set[int]]:
    """Textbook k-way largest differencing with lists of (sum, items) slots."""
    ws, idx = _sorted_padded(weights, k, equal_count)
    if not ws:
        return [set() for _ in range(k)]
    if equal_count:
        starts = [[(ws[b + s], [idx[b + s]]) for s in range(k)] for b in range(0, len(ws), k)]
    else:
        starts = [[(ws[i], [idx[i]])] + [(0.0, [])] * (k - 1) for i in range(len(ws))]
    heap = [(-(p[0][0] - p[-1][0]), seq, p) for seq, p in enumerate(starts)]
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[t][0] + b[k - 1 - t][0], a[t][1] + b[k - 1 - t][1]) for t in range(k)]
        merged.sort(key=lambda slot: -slot[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1
    return [{i for i in slot[1] if i >= 0} for slot in heap[0][2]]


def deal_at_random(
    rng: np.random.Generator, length: np.ndarray, bins: int, cap: int
) -> np.ndarray | None:
    """Labels of `length`'s samples dealt at random into `bins` bins under `cap` tokens, longest
    first (each into any bin it fits); None when one fits nowhere."""
    labels = np.empty(len(length), dtype=np.int64)
    room = np.full(bins, cap)
    for i in np.argsort(-length, kind="stable"):
        fits = np.flatnonzero(room >= length[i])
        if not len(fits):
            return None
        labels[i] = fits[int(rng.integers(len(fits)))]
        room[labels[i]] -= length[i]
    return labels


def reference_lockstep_bound(length: np.ndarray, a: float, b: float, dp: int, cap: int) -> float:
    """`bound.lockstep_bound` as a plain loop over (block end, block size): the long samples
    (> cap/2), sorted, in consecutive blocks of at most dp, each block's slot waiting for its
    first sample's cost C(s) where its bins cost at most U(f) (U_s for a bin no long one leads)."""
    s = sorted((float(x) for x in length), reverse=True)
    ideal = sum(x * (a + b * x) for x in s) / dp

    def most(ell: float) -> float:
        rest = cap - ell
        return a * cap + b * (ell * ell + rest * min(rest, ell))

    long = [x for x in s if x > cap / 2]
    short = [x for x in s if x <= cap / 2]
    u_short = most(short[0]) if short else 0.0
    best = [0.0] + [float("inf")] * len(long)
    for i in range(1, len(long) + 1):
        for g in range(1, min(dp, i) + 1):
            top = long[i - g] * (a + b * long[i - g])
            wait = sum(max(top - most(f), 0.0) for f in long[i - g : i])
            wait += (dp - g) * max(top - u_short, 0.0)
            best[i] = min(best[i], best[i - g] + wait)
    return best[-1] / dp / ideal if ideal > 0 else 0.0
