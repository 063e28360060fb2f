"""k-way Karmarkar-Karp largest differencing (KK).

A *partial partition* is k slots, each a set of items with a sum. KK starts from one partial
partition per item (the item in one slot, the other slots empty) or, with equal counts, one per
block of k consecutive items in sorted order (one item per slot). It then repeatedly takes the
two partial partitions with the largest spread (heaviest slot minus lightest slot) and merges them
slot by slot, the heaviest slot of one with the lightest of the other, until one is left.

Example (k = 2, weights 8, 7, 6, 5, 4): merge 8 and 7 -> {8 | 7} (spread 1); merge 6 and 5 ->
{6 | 5} (1); merge 4 with the older spread-1 pair -> {8 | 7, 4} (3); merge that with {6 | 5}
-> {8, 6 | 7, 4, 5}: 14 | 16. (LPT gets 17 | 13; the optimum is 15 | 15.)

Ties are broken by creation order (older first), and a merged partition's slots are ordered by a
stable sort (equal sums keep their slot order), so the result is deterministic and equal to the
textbook heap-of-lists implementation (the tests compare the two).

How it is fast (plain Python; per merge a few C-level list operations, no NumPy):

* Slots hold no item lists. A slot is named after one of its items (its *representative*); a
  merge of slots x and y keeps x's name (partition a's), or y's where a's slot is empty (-1),
  and records the link from the other name (any name of a slot's items gives the same parts). The parts are read off the links once
  at the end (NumPy pointer jumping): O(n·k) work in all.
* Sums are stored negated, so a partition is an ascending tuple (heaviest slot first) and the
  merged slot order is ``sorted(range(k), key=...)``, applied with one ``itemgetter``.
* Items waiting alone (singletons) are not in the heap: they come off the sorted weights in order
  (older and, among equal spreads, always first), compared with the heap's top.
* A singleton merged into a partition only changes that partition's lightest slot: one
  ``bisect`` instead of a sort. While the result stays the heap's top and the next singleton
  goes into it too, the rest of the heap is untouched: such a run edits two lists in place and
  sifts once.
* Without equal counts the items mostly arrive in *blocks*: two singletons merge and the result,
  whose spread is its heaviest item while it has an empty slot, takes the next singletons one by
  one into its empty slots (KK's own order). Such a run is built in one slice, when the exact
  conditions for it hold (strictly decreasing positive weights, each at least the heap's top
  spread); everything else (ties, zero weights, interruptions) goes through the general merge.
  Consecutive blocks are pushed in one call (256 synth lengths into 8 parts: 34 blocks, 30
  singleton merges in 12 runs, 36 general merges, ~19 of them after the last singleton).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from operator import add, itemgetter

import numpy as np

_INF = float("inf")

PY_MAX_K = 24
"""With equal counts and more parts than this, merges use NumPy rows instead of Python tuples."""

PY_LINKS_MAX = 2048
"""Up to this many items the parts are read off the links in plain Python (``_parts_by_links``;
at 256 items 18 µs where pointer jumping took 30, at 4,096 slower)."""


BYTE_PARTS = 256
"""Up to this many parts ``_parts_by_links`` hands NumPy its labels as bytes (256 labels: 4.5 ->
0.8 µs for the list's conversion)."""


def kk_sorted(ws: np.ndarray, k: int, equal_count: bool = False) -> np.ndarray:
    """KK over weights sorted heaviest first: ``[n]`` float64 -> ``[n]`` int64 part (0..k-1).

    With ``equal_count`` ``n`` must be a multiple of ``k`` (the caller pads with zeros).
    """
    return kk_sorted_top(ws, k, equal_count)[0]


def kk_sorted_top(ws: np.ndarray, k: int, equal_count: bool = False) -> tuple[np.ndarray, float]:
    """``kk_sorted``'s labels and the heaviest part's weight as KK summed it (its last slot
    sums): exact for whole numbers with a total below 2^53, as every order's sum is (else it
    may differ from another order's in the last bits), and with no pass over the labels."""
    n = len(ws)
    if n == 0:
        return np.empty(0, dtype=np.int64), 0.0
    if k == 1 or n == 1:  # (one item: KK puts it in the first slot)
        return np.zeros(n, dtype=np.int64), float(np.sum(ws))
    nw: list[float] = (-np.asarray(ws, dtype=np.float64)).tolist()  # ascending
    los: list[int] = []  # link los[j] -> his[j] for each pair of merged slots: the slot
    his: list[int] = []  # named los[j] (-1: an empty one, no link) joins his[j]'s
    if equal_count:
        root, top = _kk_blocks(nw, k, los, his)
    else:
        root, top = _kk_free(nw, k, los, his)
    if n <= PY_LINKS_MAX:
        return _parts_by_links(n, root, los, his), top
    # follow links to each item's representative (pointer jumping: O(log depth) passes)
    parent = np.arange(n, dtype=np.int64)
    if los:
        child = np.array(los, dtype=np.int64)
        keep = child >= 0
        parent[child[keep]] = np.array(his, dtype=np.int64)[keep]
        while True:
            up = parent[parent]
            if np.array_equal(up, parent):
                break
            parent = up
    part_of_slot = np.full(n, -1, dtype=np.int64)
    for slot, rep in enumerate(root):
        if rep >= 0:
            part_of_slot[rep] = slot
    return part_of_slot[parent], top


def _parts_by_links(n: int, root: tuple[int, ...], los: list[int], his: list[int]) -> np.ndarray:
    """Each item's part, read off the links newest first (plain Python: faster than pointer
    jumping up to ``PY_LINKS_MAX`` items).

    A name is linked to another at most once, and only while both are live names, so when link
    j is read (newest first) its parent's part is already final. Name -1 (an empty slot) reads
    and writes a spare cell at the end.
    """
    part = [0] * (n + 1)
    for slot, rep in enumerate(root):
        part[rep] = slot
    for lo, hi in zip(reversed(los), reversed(his), strict=True):
        part[lo] = part[hi]
    if len(root) <= BYTE_PARTS:  # one byte a part: bytearray converts the list in C, 5x faster
        return np.frombuffer(bytearray(part), dtype=np.uint8, count=n).astype(np.int64)
    del part[n]
    return np.array(part, dtype=np.int64)


def _kk_blocks(
    nw: list[float], k: int, los: list[int], his: list[int]
) -> tuple[tuple[int, ...], float]:
    """Equal counts: start from blocks of k consecutive items; every merge is a general one.
    Returns the last partition's slot names and its heaviest slot's sum.

    No slot is ever empty, so a merged slot keeps a's representative and links b's to it
    (``his`` gets the parent, ``los`` the child).
    """
    if k > PY_MAX_K:
        return _kk_blocks_numpy(nw, k, los, his)
    heap = []
    for b in range(0, len(nw), k):
        s = tuple(nw[b : b + k])
        heap.append((s[0] - s[-1], b, s, tuple(range(b, b + k))))
    heapq.heapify(heap)
    seq = len(nw)
    pop, replace = heapq.heappop, heapq.heapreplace
    order = range(k)
    while len(heap) > 1:
        _, _, na, ia = pop(heap)
        _, _, nb, ib = heap[0]
        nc = list(map(add, na, nb[::-1]))
        his += ia
        los += ib[::-1]
        get = itemgetter(*sorted(order, key=nc.__getitem__))
        ns = get(nc)
        replace(heap, (ns[0] - ns[-1], seq, ns, get(ia)))
        seq += 1
    return heap[0][3], -heap[0][2][0]


def _kk_blocks_numpy(
    nw: list[float], k: int, los: list[int], his: list[int]
) -> tuple[tuple[int, ...], float]:
    """``_kk_blocks`` with NumPy rows: for large k one stable argsort beats sorting in Python."""
    blocks = np.array(nw, dtype=np.float64).reshape(-1, k)
    ids = np.arange(len(nw), dtype=np.int64).reshape(-1, k)
    heap = [(float(blocks[b, 0] - blocks[b, -1]), b, blocks[b], ids[b]) for b in range(len(blocks))]
    heapq.heapify(heap)
    seq = len(nw)
    pop, replace = heapq.heappop, heapq.heapreplace
    parents: list[np.ndarray] = []
    children: list[np.ndarray] = []
    while len(heap) > 1:
        _, _, na, ia = pop(heap)
        _, _, nb, ib = heap[0]
        nc = na + nb[::-1]
        parents.append(ia)
        children.append(ib[::-1])
        o = nc.argsort(kind="stable")
        ns = nc[o]
        replace(heap, (float(ns[0] - ns[-1]), seq, ns, ia[o]))
        seq += 1
    if parents:
        his += np.concatenate(parents).tolist()
        los += np.concatenate(children).tolist()
    return tuple(heap[0][3].tolist()), -float(heap[0][2][0])


def _push_blocks(
    nw: list[float],
    i: int,
    hk: float,
    k: int,
    heap: list[tuple[float, int, tuple[float, ...], tuple[int, ...]]],
    seq: int,
) -> tuple[int, int, tuple[tuple[float, ...], tuple[int, ...]] | None]:
    """Push singletons i, i+1 and the next ones that KK would put in the same partition's empty
    slots one by one (a *block*, see the module docstring) as one partition, and the next blocks
    while KK would start another (its first two singletons both at most the heap's top key and
    negative); returns the next singleton, the next ``seq`` and ``None``. Needs ``nw[i] <=
    nw[i + 1] < 0`` and both at most the heap's top key ``hk`` (``nw`` ends with a NaN, which
    ends a block).

    A block cut short by a singleton above ``hk`` whose key (its heaviest item) is below ``hk``
    would become the heap's top, and KK's next step pops it and merges it with the old top (the
    singleton is above both): it is returned instead of pushed (its slot sums and names, its
    ``seq`` spent), for the caller to merge."""
    end = len(nw) - 1
    push = heapq.heappush
    x = nw[i]
    while True:
        j = i + k
        if j <= end and nw[j - 1] < 0.0 and nw[j - 1] <= hk and nw[i + 2] != x:
            pass  # a full block (nw ascends: every item in it is below 0 and at most hk)
        elif (j := min(end, j)) > i + 2:  # each condition on item j, once false, stays false
            j = i + 2 if nw[i + 2] == x else min(bisect_left(nw, 0.0, i + 2, j),
                                                  bisect_right(nw, hk, i + 2, j))  # fmt: skip
        m = j - i
        if m == k:
            s = tuple(nw[i:j])
            push(heap, (x - s[-1], seq, s, tuple(range(i, j))))
        else:
            s = (*nw[i:j], *(0.0,) * (k - m))
            ids = (*range(i, j), *(-1,) * (k - m))
            if x < hk < nw[j]:  # it would be the top, then popped and merged with the old top
                return j, seq + 1, (s, ids)
            push(heap, (x, seq, s, ids))
        i, seq = j, seq + 1
        hk = heap[0][0]
        x = nw[i]
        if not (x <= hk and nw[i + 1] <= hk and nw[i + 1] < 0.0):
            return i, seq, None


def _insert_run(
    nw: list[float],
    i: int,
    p: int,
    k: int,
    heap: list[tuple[float, int, tuple[float, ...], tuple[int, ...]]],
    seq: int,
    los: list[int],
    his: list[int],
) -> tuple[int, int]:
    """Singleton i into the heap's top partition at slot p, then the next singletons one by one
    while that partition stays first and the singleton second (the partition's key below the
    singleton's, which is at most both children's keys: the rest of the heap stays as it is);
    the result replaces the top. Returns the next singleton and the next ``seq`` (one a
    singleton, as one merge each)."""
    _, _, s, names = heap[0]
    ns, ids = list(s), list(names)
    c = min(heap[1][0], heap[2][0])
    x = nw[i]
    while True:
        los.append(ids.pop())
        his.append(i)
        ns.insert(p, ns.pop() + x)
        ids.insert(p, i)
        i += 1
        key = ns[0] - ns[-1]
        x = nw[i]
        if not key < x <= c:
            break
        p = bisect_right(ns, ns[-1] + x, 0, k - 1)
        seq += 1
    heapq.heapreplace(heap, (key, seq, tuple(ns), tuple(ids)))
    return i, seq + 1


def _kk_free(
    nw: list[float], k: int, los: list[int], his: list[int]
) -> tuple[tuple[int, ...], float]:
    """No count constraint: start from singletons (at least two; see the module docstring).
    Returns the last partition's slot names and its heaviest slot's sum.

    A singleton meeting a partition goes into its lightest slot (``_insert_run``): where the
    partition comes first, after slots of equal sum (the merge's stable sort keeps a's order),
    and it does come first when the singleton is at most both of the top's children; where the
    singleton comes first, as ``_singleton_first`` says. A NaN after the last singleton ends
    every comparison with it, and two sentinels with key +inf at the heap's bottom stand for
    "no partition" (no bounds checks). Once no singleton is left ``_merge_rest`` merges the
    partitions.
    """
    n = len(nw)
    nw = [*nw, float("nan")]  # compares false: "no singleton left"
    zeros = (0.0,) * (k - 1)
    empty = (-1,) * (k - 1)
    heap: list[tuple[float, int, tuple[float, ...], tuple[int, ...]]] = [
        (_INF, -2, (), ()),
        (_INF, -1, (), ()),
    ]
    push, replace = heapq.heappush, heapq.heapreplace
    slots = range(k)
    i = 0  # next singleton: key (nw[i], i), older than every partition (seq >= n)
    seq = n
    while i < n:
        hk = heap[0][0]
        x = nw[i]
        if x <= hk:  # the first is singleton i
            y = nw[i + 1]
            if y <= hk and k > 2 and y < 0.0:  # ... and singleton i + 1: a block, and the next
                i, seq, a = _push_blocks(nw, i, hk, k, heap, seq)  # that fit
                if a is None:
                    continue
                na, ia = a  # a block cut short, which KK merges with the heap's top next
            elif not y <= hk and (p := _singleton_first(heap[0][2], heap[0][3], x, k)) >= 0:
                i, seq = _insert_run(nw, i, p, k, heap, seq, los, his)  # ... and the second
                continue  # the top partition (y is NaN: none left)
            else:  # a merge: singleton i with the top partition or with singleton i + 1
                if y <= hk:
                    push(heap, (y, i + 1, (y, *zeros), (i + 1, *empty)))  # now the heap's top
                na, ia = (x, *zeros), (i, *empty)
                i += 2 if y <= hk else 1
        elif x <= heap[1][0] and x <= heap[2][0]:  # a partition, then singleton i
            p = bisect_right(heap[0][2], heap[0][2][-1] + x, 0, k - 1)
            i, seq = _insert_run(nw, i, p, k, heap, seq, los, his)
            continue
        else:
            _, _, na, ia = heapq.heappop(heap)
        _, _, nb, ib = heap[0]  # b: replaced by the merged partition (one heap sift, not two)
        # merge: slot t of a with slot k-1-t of b; a merged slot keeps a's name, or b's where
        # a's slot is empty (-1), and links the other name to it
        nc = list(map(add, na, reversed(nb)))
        get = itemgetter(*sorted(slots, key=nc.__getitem__))
        s = get(nc)
        if na[-1] == 0.0 and -1 in ia:  # (an empty slot sums to 0: it sorts last)
            names = _names_with_empty(ia, ib[::-1], los, his)
        else:  # a full partition (most merges)
            names = ia
            los += ib[::-1]
            his += ia
        replace(heap, (s[0] - s[-1], seq, s, get(names)))
        seq += 1
    return _merge_rest(heap, k, seq, los, his)


def _merge_rest(
    heap: list[tuple[float, int, tuple[float, ...], tuple[int, ...]]],
    k: int,
    seq: int,
    los: list[int],
    his: list[int],
) -> tuple[tuple[int, ...], float]:
    """``_kk_free``'s merges once no singleton is left, until one partition is left (and the
    two sentinels): the loop's merge, written out again without the singletons' checks."""
    pop, replace = heapq.heappop, heapq.heapreplace
    slots = range(k)
    while len(heap) > 3:
        _, _, na, ia = pop(heap)
        _, _, nb, ib = heap[0]
        nc = list(map(add, na, reversed(nb)))
        get = itemgetter(*sorted(slots, key=nc.__getitem__))
        s = get(nc)
        if na[-1] == 0.0 and -1 in ia:
            names = _names_with_empty(ia, ib[::-1], los, his)
        else:
            names = ia
            los += ib[::-1]
            his += ia
        replace(heap, (s[0] - s[-1], seq, s, get(names)))
        seq += 1
    return heap[0][3], -heap[0][2][0]


def _singleton_first(nb: tuple[float, ...], ib: tuple[int, ...], x: float, k: int) -> int:
    """Where a singleton x merged with partition b (the singleton older) lands among b's
    slots, kept in their order: before the slots of equal sum (the merge's stable sort puts a's
    slot first), which is the merge's order where b's only ties are its empty slots (sum 0,
    name -1); -1 where two of b's named slots tie (the merge reverses b's slots: it must run)."""
    e = ib.count(-1)
    if len(set(nb)) + max(e - 1, 0) < k:
        return -1
    return bisect_left(nb, nb[-1] + x, 0, k - 1)


def _names_with_empty(
    ia: tuple[int, ...], rb: tuple[int, ...], los: list[int], his: list[int]
) -> tuple[int, ...]:
    """The merged slots' names where partition a has empty slots (name -1) and ``rb`` are b's
    names in merge order: a's name where a's slot holds items (b's linked to it), else b's.
    The empty slots are last but for zero weights (sum 0 like them): then slot by slot, the
    larger name, -1 being empty, linking the smaller."""
    f = ia.index(-1)
    if ia.count(-1) == len(ia) - f:
        los += rb[:f]
        his += ia[:f]
        return (*ia[:f], *rb[f:])
    names = tuple(map(max, ia, rb))
    los += map(min, ia, rb)
    his += names
    return names
