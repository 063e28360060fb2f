"""k-way Karmarkar-Karp largest differencing (KK).

A *partial partition* is k slots, each a set of items with a sum. KK starts from one partial
partition per item (the item in one slot, the other slots empty) or, with equal counts, one per
block of k consecutive items in sorted order (one item per slot). It then repeatedly takes the
two partial partitions with the largest spread (heaviest slot minus lightest slot) and merges them
slot by slot, the heaviest slot of one with the lightest of the other, until one is left.

Example (k = 2, weights 8, 7, 6, 5, 4): merge 8 and 7 -> {8 | 7} (spread 1); merge 6 and 5 ->
{6 | 5} (1); merge 4 with the older spread-1 pair -> {8 | 7, 4} (3); merge that with {6 | 5}
-> {8, 6 | 7, 4, 5}: 14 | 16. (LPT gets 17 | 13; the optimum is 15 | 15.)

Ties are broken by creation order (older first), so the result is deterministic. Instead of
concatenating item lists at every merge, each merge records which slot of one side joins which
slot of the other (a union-find parent pointer from slot id to slot id; a slot is named after its
first item), and the final parts are read off the pointers once at the end: O(n·k) work in all,
O(k) NumPy per merge.
"""

from __future__ import annotations

import heapq

import numpy as np


def kk_sorted(ws: np.ndarray, k: int, equal_count: bool = False) -> np.ndarray:
    """KK over weights sorted heaviest first: ``[n]`` float64 -> ``[n]`` int64 part (0..k-1).

    With ``equal_count`` ``n`` must be a multiple of ``k`` (the caller pads with zeros).
    """
    n = len(ws)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    parent = np.arange(n, dtype=np.int64)
    sums: list[np.ndarray | None] = []
    ids: list[np.ndarray | None] = []
    heap: list[tuple[float, int]] = []
    if equal_count:
        blocks = ws.reshape(-1, k)
        for b in range(len(blocks)):
            sums.append(blocks[b].copy())
            ids.append(np.arange(b * k, (b + 1) * k, dtype=np.int64))
            heap.append((-(float(blocks[b, 0]) - float(blocks[b, -1])), b))
    else:
        # Singletons are made into arrays lazily: most are merged once and never stored.
        sums = [None] * n
        ids = [None] * n
        heap = [(-float(x), i) for i, x in enumerate(ws.tolist())]
    heapq.heapify(heap)
    empty_ids = np.full(k, -1, dtype=np.int64)

    def materialize(pid: int) -> tuple[np.ndarray, np.ndarray]:
        s, d = sums[pid], ids[pid]
        if s is None or d is None:  # a singleton: item pid alone in slot 0
            s = np.zeros(k, dtype=np.float64)
            s[0] = ws[pid]
            d = empty_ids.copy()
            d[0] = pid
        sums[pid] = ids[pid] = None  # merged away: free it
        return s, d

    pop, push = heapq.heappop, heapq.heappush
    while len(heap) > 1:
        _, pa = pop(heap)
        _, pb = pop(heap)
        sa, da = materialize(pa)
        sb, db = materialize(pb)
        # heaviest slot of a with lightest slot of b; both are stored heaviest first
        s = sa + sb[::-1]
        db = db[::-1]
        if equal_count:  # no empty slots: every slot of b joins a slot of a
            parent[db] = da
            d = da
        else:
            both = (da >= 0) & (db >= 0)
            parent[db[both]] = da[both]
            d = np.where(da >= 0, da, db)
        order = np.argsort(-s, kind="stable")
        s, d = s[order], d[order]
        pid = len(sums)
        sums.append(s)
        ids.append(d)
        push(heap, (-(float(s[0]) - float(s[-1])), pid))
    _, final_d = materialize(heap[0][1])
    # follow parent pointers to each item's root slot (pointer jumping: O(log depth) passes)
    while True:
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    part_of_slot = np.full(n, -1, dtype=np.int64)
    live = final_d >= 0
    part_of_slot[final_d[live]] = np.flatnonzero(live)
    return part_of_slot[parent]
