"""The hybrid-CP placement: given each sample's degree k, where it goes (`place_all`).

One greedy, the same rule at every step: each sample, widest then heaviest first, goes to the
place with room where the step's lockstep cost Σ_j max_g rises least, then the least loaded one
after it, then the lowest position. Split samples (k > 1) go into a sub-group of their size
(formed already in some (group, slot), or new on aligned GPUs still free there); whole samples
onto plain GPUs; a whole sample no plain GPU has room for joins a sub-group, split over it, when
that beats one more micro-batch for every GPU. M rises from the token lower bound until every
sample finds room.

Within one slot the rise and the load after are both increasing in a place's load, so the best
place of a slot is its least loaded one with room: `_SlotHeaps` keeps one heap per slot and
looks at M places per sample, not dp x M x cp (1,460 agent samples on 8 x 4 GPUs: ~15 ms).
Where every sample is split over all cp GPUs (`--cp`'s layout), a (group, slot) holds one
sub-group, so the same heaps place samples over dp x M sub-groups.

Pure NumPy and heapq; nothing here reads files or knows the format.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.hybrid_cost import RingModel, gpu_cost, gpu_tokens
from rolltool.plan.partition.metrics import lockstep_cost
from rolltool.plan.workload import Workload

__all__ = ["HybridPlan", "place_all"]


@dataclass(frozen=True, kw_only=True)
class HybridPlan:
    """One step's hybrid-CP layout: where each sample goes, and what each GPU holds."""

    rank: np.ndarray  # [n] int64: the data-parallel group
    slot: np.ndarray  # [n] int64: the micro-batch slot j
    start: np.ndarray  # [n] int64: the first GPU of its sub-group in the group (a multiple of k)
    degree: np.ndarray  # [n] int64: k, the sub-group's size (1: whole on GPU `start`)
    groups: np.ndarray  # [dp, M, cp] int64: each GPU's sub-group size in each slot (1: plain)
    costs: np.ndarray  # [dp, M, cp] float64: each GPU's micro-batch cost
    tokens: np.ndarray  # [dp, M, cp] int64: each GPU's tokens, CP padding counted
    max_tokens: int

    @property
    def num_micro_batches(self) -> int:
        return int(self.costs.shape[1])

    @property
    def lockstep_cost(self) -> float:
        """Σ_j max over every GPU of the world of its cost in slot j."""
        dp, m, cp = self.costs.shape
        return lockstep_cost(self.costs.transpose(0, 2, 1).reshape(dp * cp, m))

    @property
    def lockstep_overhead(self) -> float:
        """`lockstep_cost` / (Σ cost / GPUs): 1.0 when perfect."""
        total = float(self.costs.sum())
        gpus = self.costs.shape[0] * self.costs.shape[2]
        return self.lockstep_cost / (total / gpus) if total else 1.0

    def split_counts(self) -> dict[int, int]:
        """Samples per degree k (k = 1: not split)."""
        ks, counts = np.unique(self.degree, return_counts=True)
        return {int(k): int(c) for k, c in zip(ks, counts, strict=True)}

    def split_tokens(self, lengths: np.ndarray) -> int:
        """Tokens of the samples split over two GPUs or more."""
        return int(np.asarray(lengths, dtype=np.int64)[self.degree > 1].sum())


def place_all(
    length: np.ndarray,
    k: np.ndarray,
    dp: int,
    cp: int,
    max_tokens: int,
    workload: Workload,
    ring: RingModel,
    max_micro_batches: int | None,
) -> HybridPlan:
    """The greedy placement at the least M from the token lower bound at which it succeeds."""
    tokens = gpu_tokens(length, k)
    cost = gpu_cost(length, k, workload, ring)
    need = int((tokens * k).sum())
    m = max(1, -(-need // (dp * cp * max_tokens))) if len(length) else 0
    limit = max_micro_batches or max(len(length), 1)
    share = _shares(length, cp, workload, ring)
    while m <= limit:
        placed = place(tokens, cost, k, dp, cp, m, max_tokens, share)
        if placed is not None and not np.array_equal(placed.degree, k) and m < limit:
            # whole samples joined sub-groups to fit M: keep that only if it beats M + 1
            wider = place(tokens, cost, k, dp, cp, m + 1, max_tokens, None)
            if wider is not None and wider.lockstep_cost < placed.lockstep_cost:
                return wider
        if placed is not None:
            return placed
        m += 1
    raise RolltoolError(f"hybrid CP: the step does not fit {limit} micro-batches per GPU")


Share = Callable[[int, int], tuple[int, float]]
"""(sample, k) -> its tokens and cost on each GPU of a k-way split."""


def _shares(length: np.ndarray, cp: int, workload: Workload, ring: RingModel) -> Share:
    widths = 1 << np.arange(cp.bit_length(), dtype=np.int64)  # 1, 2, 4, ..., cp
    grid = np.broadcast_to(widths, (len(length), len(widths)))
    spread = np.broadcast_to(length[:, None], grid.shape)
    table_tokens = gpu_tokens(spread, grid).tolist()  # [n][log2 k]: a sample's share at k
    table_cost = gpu_cost(spread, grid, workload, ring).tolist()

    def share(i: int, ki: int) -> tuple[int, float]:
        w = ki.bit_length() - 1
        return table_tokens[i][w], table_cost[i][w]

    return share


def place(
    tokens: np.ndarray,
    cost: np.ndarray,
    k: np.ndarray,
    dp: int,
    cp: int,
    m: int,
    max_tokens: int,
    share: Share | None,
) -> HybridPlan | None:
    """The greedy at M = m (module docstring); `share(i, k)` prices a whole sample joining a
    k-way sub-group (never with `share` None). None when a sample finds no room."""
    n = len(tokens)
    order = np.lexsort((np.arange(n), -cost, -k))
    if n and cp > 1 and bool((k == cp).all()):
        return _place_blocks(order, tokens, cost, dp, cp, m, max_tokens)
    grid = _Grid.empty(n, dp, m, cp, k)
    split = int(np.count_nonzero(k > 1))
    for i in order[:split].tolist():
        if not grid.split(i, int(k[i]), int(tokens[i]), float(cost[i]), max_tokens):
            return None
    whole = order[split:]
    whole = whole[np.lexsort((whole, -tokens[whole], -cost[whole]))]  # tokens non-increasing
    if not grid.whole(whole, tokens, cost, max_tokens, share):
        return None
    return HybridPlan(
        rank=grid.rank, slot=grid.slot, start=grid.start, degree=grid.degree, groups=grid.size,
        costs=grid.loads, tokens=grid.held, max_tokens=max_tokens,
    )  # fmt: skip


def _place_blocks(
    order: np.ndarray, tokens: np.ndarray, cost: np.ndarray, dp: int, cp: int, m: int, cap: int
) -> HybridPlan | None:
    """Every sample split over all cp GPUs: each (group, slot) one sub-group, placed by the
    same rule over dp x m sub-groups (what `_Grid.split` would do, with M places a sample)."""
    units = dp * m
    load, held = [0.0] * units, [0] * units
    heaps = _SlotHeaps(load, held, [[d * m + j for d in range(dp)] for j in range(m)], [0.0] * m)
    into = heaps.fill(order.tolist(), tokens.tolist(), cost.tolist(), cap)
    if into is None:
        return None
    n = len(tokens)
    unit = np.zeros(n, dtype=np.int64)
    unit[order] = into
    held_gpu = np.repeat(np.array(held, dtype=np.int64).reshape(dp, m, 1), cp, axis=2)
    return HybridPlan(
        rank=unit // m, slot=unit % m, start=np.zeros(n, dtype=np.int64),
        degree=np.full(n, cp, dtype=np.int64),
        groups=np.where(held_gpu > 0, cp, 1),  # a (group, slot) with no sample: plain, empty
        costs=np.repeat(np.array(load).reshape(dp, m, 1), cp, axis=2), tokens=held_gpu,
        max_tokens=cap,
    )  # fmt: skip


INF = float("inf")

_AFRESH = (-1.0, -1)
"""`_SlotHeaps.cand` of a slot to look at again (None: every place there is parked)."""


class _SlotHeaps:
    """Places (GPUs, or sub-groups that move as one) grouped by slot, each slot's in a heap by
    load, and each slot's most loaded GPU (`top`): the best place for a sample is the best of
    each slot's least loaded place with room. A place without room for the sample at hand is
    parked (a heap by room) until a sample small enough comes: samples come with tokens
    non-increasing, so a place is looked at again only when it can take one. `load` and `held`
    are shared with the caller, who may raise a place's entries only through `add` (or
    `raise_top` for GPUs outside)."""

    def __init__(
        self, load: list[float], held: list[int], slots: list[list[int]], top: list[float]
    ) -> None:
        self.load, self.held, self.top = load, held, top
        self.slot_of = {u: s for s, units in enumerate(slots) for u in units}
        self.heaps = [sorted((load[u], u) for u in units) for units in slots]  # sorted: a heap
        self.parked: list[list[tuple[int, int]]] = [[] for _ in slots]  # (-room, place)
        self.cand: list[tuple[float, int] | None] = [_AFRESH] * len(slots)

    def best(self, t: int, c: float, cap: int) -> tuple[float, float, int] | None:
        """(rise of Σ_j max, load after, place) of the best place with room for a sample of
        `t` tokens and cost `c`, or None. Each slot's least loaded place with room is kept
        (`cand`) until that place takes a sample, lacks room, or a parked one has room again."""
        held, top, parked_of, least = self.held, self.top, self.parked, self._least
        best_rise, best_after, best_u = INF, INF, -1
        for s, cand in enumerate(self.cand):
            parked = parked_of[s]
            if cand is None:  # every place of the slot is parked: one may have room now
                if not parked or -parked[0][0] < t:
                    continue
                cand = self.cand[s] = least(s, t, cap)
            elif cand is _AFRESH or held[cand[1]] + t > cap or (parked and -parked[0][0] >= t):
                cand = self.cand[s] = least(s, t, cap)
            if cand is None:
                continue
            after = cand[0] + c
            rise = after - top[s]
            if rise < 0.0:
                rise = 0.0
            if rise < best_rise or (
                rise == best_rise
                and (after < best_after or (after == best_after and cand[1] < best_u))
            ):
                best_rise, best_after, best_u = rise, after, cand[1]
        return None if best_u < 0 else (best_rise, best_after, best_u)

    def _least(self, s: int, t: int, cap: int) -> tuple[float, int] | None:
        """Slot s's least loaded place with room for `t` tokens (ties: the lowest), or None;
        places without room are parked, parked ones with room again come back."""
        load, held = self.load, self.held
        heap, parked = self.heaps[s], self.parked[s]
        while parked and -parked[0][0] >= t:  # room again
            u = heapq.heappop(parked)[1]
            heapq.heappush(heap, (load[u], u))
        while heap:
            entry = heap[0]
            u = entry[1]
            if entry[0] < load[u]:  # stale: that place took more since
                heapq.heappop(heap)
            elif held[u] + t > cap:
                heapq.heappop(heap)
                heapq.heappush(parked, (held[u] - cap, u))
            else:
                return entry
        return None

    def add(self, u: int, t: int, c: float) -> None:
        s = self.slot_of[u]
        self.load[u] += c
        self.held[u] += t
        heapq.heappush(self.heaps[s], (self.load[u], u))
        self.cand[s] = _AFRESH
        self.raise_top(s, self.load[u])

    def raise_top(self, s: int, value: float) -> None:
        if value > self.top[s]:
            self.top[s] = value

    def fill(
        self, order: list[int], tokens: list[int], cost: list[float], cap: int
    ) -> list[int] | None:
        """Each sample of `order` to its best place; the places in that order, or None at the
        first sample with no room."""
        into = []
        for i in order:
            found = self.best(tokens[i], cost[i], cap)
            if found is None:
                return None
            self.add(found[2], tokens[i], cost[i])
            into.append(found[2])
        return into


@dataclass
class _Grid:
    """The placement under way: per GPU [dp, m, cp] its load, tokens and sub-group size (0:
    none yet), per sample where it went."""

    loads: np.ndarray
    held: np.ndarray
    size: np.ndarray
    rank: np.ndarray
    slot: np.ndarray
    start: np.ndarray
    degree: np.ndarray

    @classmethod
    def empty(cls, n: int, dp: int, m: int, cp: int, k: np.ndarray) -> _Grid:
        def grid(dtype: type) -> np.ndarray:
            return np.zeros((dp, m, cp), dtype=dtype)

        def per_sample() -> np.ndarray:
            return np.zeros(n, dtype=np.int64)

        return cls(
            loads=grid(np.float64), held=grid(np.int64), size=grid(np.int64), rank=per_sample(),
            slot=per_sample(), start=per_sample(), degree=k.astype(np.int64),  # a copy: may widen
        )  # fmt: skip

    def split(self, i: int, k: int, t: int, c: float, max_tokens: int) -> bool:
        """Sample i over k GPUs where the step's lockstep cost rises least (then the least
        loaded, then the lowest position); False when no sub-group has room."""
        dp, m, cp = self.loads.shape
        shape = (dp, m, cp // k, k)
        block = self.size.reshape(shape)
        fits = ((block == k) | (block == 0)).all(axis=3) & (block.min(axis=3) == block.max(axis=3))
        room = fits & (self.held.reshape(shape) + t <= max_tokens).all(axis=3)
        after = self.loads.reshape(shape).max(axis=3) + c  # [dp, m, parts]
        top = self.loads.max(axis=(0, 2))[None, :, None]  # each slot's most loaded GPU
        rise = np.where(room, np.maximum(after - top, 0.0), np.inf)  # what Σ_j max_g gains
        if not np.isfinite(rise.min()):
            return False
        at = int(np.argmin(np.where(rise == rise.min(), after, np.inf)))
        d, j, a = (int(x) for x in np.unravel_index(at, shape[:3]))
        g = slice(a * k, (a + 1) * k)
        self.loads[d, j, g] += c
        self.held[d, j, g] += t
        self.size[d, j, g] = k
        self.rank[i], self.slot[i], self.start[i] = d, j, a * k
        return True

    def whole(
        self,
        order: np.ndarray,
        tokens: np.ndarray,
        cost: np.ndarray,
        max_tokens: int,
        share: Share | None,
    ) -> bool:
        """Samples `order` (tokens non-increasing), each to the plain GPU with room where the
        step's lockstep cost rises least (under its slot's most loaded GPU when one has room
        there: beside a slot's heavy samples), then the least loaded; or split into a sub-group
        (`_join`). False when one finds no room."""
        dp, m, cp = self.loads.shape
        blocks = sorted({(int(self.rank[i]) * m * cp + int(self.slot[i]) * cp + int(self.start[i]),
                          int(self.degree[i])) for i in np.flatnonzero(self.degree > 1).tolist()})  # fmt: skip
        self.size[self.size == 0] = 1  # every GPU outside a sub-group holds a plain row
        load, held = self.loads.reshape(-1).tolist(), self.held.reshape(-1).tolist()
        plain = np.flatnonzero(self.size.reshape(-1) == 1).tolist()
        slots: list[list[int]] = [[] for _ in range(m)]
        for u in plain:
            slots[u // cp % m].append(u)
        top = self.loads.max(axis=(0, 2)).tolist() if self.loads.size else [0.0] * m
        heaps = _SlotHeaps(load, held, slots, top)
        tok, cst = tokens.tolist(), cost.tolist()
        into = []
        for i in order.tolist():
            found = heaps.best(tok[i], cst[i], max_tokens)
            if found is not None:
                heaps.add(found[2], tok[i], cst[i])
                into.append(found[2])
                continue
            if share is None:
                return False
            joined = _join(i, blocks, load, held, max_tokens, share)
            if joined is None:
                return False
            b, self.degree[i] = joined
            heaps.raise_top(b // cp % m, load[b])
            into.append(b)
        self.loads = np.array(load).reshape(dp, m, cp)
        self.held = np.array(held, dtype=np.int64).reshape(dp, m, cp)
        self.rank[order], self.slot[order], self.start[order] = np.unravel_index(
            np.array(into, dtype=np.int64), (dp, m, cp)
        )
        return True


def _join(
    i: int,
    blocks: list[tuple[int, int]],
    load: list[float],
    held: list[int],
    max_tokens: int,
    share: Share,
) -> tuple[int, int] | None:
    """Sample i split over the least loaded sub-group (first GPU `b`, size k) with room for
    it, updating `load` and `held` of its GPUs; (b, k), or None when none has room."""
    best: tuple[float, int, int, int, float] | None = None
    shares: dict[int, tuple[int, float]] = {}
    for b, k in blocks:
        if k not in shares:
            shares[k] = share(i, k)
        t, c = shares[k]
        if held[b] + t <= max_tokens and (best is None or load[b] + c < best[0]):
            best = (load[b] + c, b, k, t, c)
    if best is None:
        return None
    _, b, k, t, c = best
    for g in range(b, b + k):
        load[g] += c
        held[g] += t
    return b, k
