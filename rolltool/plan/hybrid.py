"""Hybrid context parallelism: a CP degree per sample and per slot, planned (issue 22).

The world is ``dp`` data-parallel groups of ``cp`` GPUs, as with ``--cp``. In each micro-batch
slot j the cp GPUs of group d are partitioned into *aligned* sub-groups of power-of-two sizes k in
{1, 2, 4, ..., cp}: GPUs ``[a·k, (a+1)·k)`` of the group, so a trainer creates every sub-group's
process group once, and each GPU is in exactly one sub-group per slot (`HybridPlan.groups`). A
sub-group of size k > 1 holds a ``--cp k`` micro-batch: every sample in it zigzag-split over its k
GPUs (chunks r and 2k-1-r); a GPU in no wider sub-group (k = 1) holds a plain row of whole
samples. Every GPU has the same number of micro-batches M; each GPU's micro-batch holds at most
``max_tokens`` tokens, CP padding counted (a split sample of L tokens puts ``ceil(L / 2k) · 2``
tokens on each of its k GPUs).

**Price of a split** (`RingModel`, in the workload's units, e.g. FLOPs): each of the k GPUs does
1/k of the sample's work, ``cost(padded L) / k`` (zigzag evens the causal attention), plus the
ring's communication that compute does not hide. A ring of k GPUs takes k steps; at each the GPU
sends the K/V of its L/k tokens to the next (forward) and K/V plus their gradients back
(backward): ``3 · (L/k) · kv_bytes_per_token`` bytes a step over ``bandwidth`` bytes/s, while it
computes attention of its L/k queries against L/k keys, ``b · L² / k²`` (``b``: the workload's
per-token² coefficient) at ``speed`` units/s. Per step the slower of the two counts, so the exposed
communication is ``(k - 1) · max(0, comm_step - attention_step)``, converted to the workload's
units at ``speed``: a long sample hides it behind compute, a short one pays it.

**Objective**: the step's lockstep cost over all dp x cp GPUs, Σ_j max_(d, g) cost(d, g, j), as
the partition's ``align="lockstep"``. `plan_hybrid_step` gives every sample its least degree
``k_min`` (the smallest power of two whose per-GPU tokens fit ``max_tokens``), then widens the
heaviest sample on the GPU furthest above its slot's mean while that lowers the step's cost
(`SPLIT_TRIES`, `FAILS`), and finally compares with every sample split over all cp GPUs (today's
``--cp`` layout, placed by the same greedy), keeping the cheaper. Every candidate is placed by one
greedy: split samples first, widest and heaviest first, each into a sub-group of its size with
room (formed already, or new on free aligned GPUs) where Σ_j max rises least; then whole samples,
likewise onto plain GPUs; a whole sample no plain GPU has room for joins a sub-group when that
beats one more micro-batch. M rises from the token lower bound until the greedy places all. So a
sample that fits a GPU is split only when that lowers the step's cost, and the plan is never
costlier than the ``--cp`` layout under the same greedy. Measured: on 8 x 4 GPUs, 1,024 agent
samples (log-normal, median 6,000, sigma 0.9, up to 131,072 tokens), 1.027-1.091 against
`plan_step`'s ``--cp 4`` 1.047-1.117 (`/tmp` script of session 6; ``benchmarks/longctx.py
--hybrid`` packs it), but 0.6-2 s a step on the loaded 2-core machine, far over the 100 ms aim.
Deterministic: stable orders, ties broken by position then index.

Pure NumPy: nothing here reads files, prints, or knows the format (`rolltool.plan.hybrid_step`
maps a plan to the pipeline's, `rolltool.format.hybrid` lays it out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.partition.metrics import lockstep_cost
from rolltool.plan.workload import Workload

__all__ = ["HybridPlan", "RingModel", "cp_degrees", "gpu_tokens", "plan_hybrid_step"]


@dataclass(frozen=True, kw_only=True)
class RingModel:
    """What ring attention over k GPUs costs beyond each GPU's 1/k of the work."""

    kv_bytes_per_token: float
    """K and V bytes of one token over all layers (2 · layers · kv_heads · head_dim · bytes of
    the dtype)."""
    bandwidth: float = 100e9
    """Bytes per second of one ring link (default 100 GB/s, NVLink-class)."""
    speed: float = 400e12
    """The workload's units one GPU does per second (default 400 TFLOP/s: an H100 at ~40% of its
    bf16 peak, for the ``flops`` workload)."""

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "bandwidth", "speed"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0) or (
                name != "kv_bytes_per_token" and value == 0
            ):
                raise RolltoolError(f"ring model: {name} must be a positive number, got {value!r}")

    @classmethod
    def for_workload(cls, workload: Workload, dtype_bytes: int = 2, **kwargs: float) -> RingModel:
        """The ring of `workload`'s model shape (``flops``); no communication for the others,
        whose units are not FLOPs."""
        m = workload.model
        if m is None:
            return cls(kv_bytes_per_token=0.0, **kwargs)
        head_dim = m.head_dim or m.hidden_size // m.num_heads
        kv = 2.0 * m.num_layers * m.num_kv_heads * head_dim * dtype_bytes
        return cls(kv_bytes_per_token=kv, **kwargs)

    def exposed(self, lengths: np.ndarray, k: np.ndarray, attention: float) -> np.ndarray:
        """[n] float64: the communication each GPU of a k-way split waits for, in the workload's
        units (0 for k = 1); `attention`: the workload's per-token² coefficient ``b``."""
        length = np.asarray(lengths, dtype=np.float64)
        k = np.asarray(k, dtype=np.float64)
        chunk = length / k
        comm = 3.0 * chunk * self.kv_bytes_per_token / self.bandwidth * self.speed
        compute = attention * chunk * chunk
        return np.where(k > 1, (k - 1) * np.maximum(0.0, comm - compute), 0.0)


def gpu_tokens(lengths: np.ndarray, k: np.ndarray) -> np.ndarray:
    """[n] int64: tokens a sample puts on each GPU of its k-way split, CP padding counted
    (padded to a multiple of 2k, then 1/k of it; k = 1: the sample itself, unpadded).

    >>> gpu_tokens(np.array([10, 10, 7]), np.array([1, 2, 4])).tolist()
    [10, 6, 2]
    """
    length = np.asarray(lengths, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    padded = -(-length // (2 * k)) * 2 * k
    return np.where(k > 1, padded // k, length)


def cp_degrees(lengths: np.ndarray, cp: int, max_tokens: int) -> np.ndarray:
    """[n] int64: each sample's least degree, the smallest power of two k <= cp whose per-GPU
    tokens fit `max_tokens`; a `RolltoolError` naming the first sample that fits none."""
    length = np.asarray(lengths, dtype=np.int64)
    k = np.ones(len(length), dtype=np.int64)
    while True:
        over = gpu_tokens(length, k) > max_tokens
        if not over.any():
            return k
        wider = over & (k * 2 <= cp)
        if not np.array_equal(wider, over):
            i = int(np.flatnonzero(over & ~wider)[0])
            raise RolltoolError(
                f"sample {i} ({int(length[i])} tokens) does not fit {cp} GPUs of {max_tokens} "
                "tokens, CP padding counted",
                hint="raise --micro-batch-tokens or --cp, or drop over-long samples "
                "(--overlong drop)",
            )
        k[wider] *= 2


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


def plan_hybrid_step(
    lengths: np.ndarray,
    *,
    dp: int,
    cp: int,
    max_tokens: int,
    workload: Workload,
    ring: RingModel | None = None,
    max_micro_batches: int | None = None,
) -> HybridPlan:
    """The step's hybrid-CP layout (see the module docstring); `ring` defaults to
    `RingModel.for_workload`. Raises `RolltoolError` for a sample that fits no sub-group."""
    if cp < 1 or cp & (cp - 1):
        raise RolltoolError(f"hybrid CP: --cp must be a power of two, got {cp}")
    if dp < 1 or max_tokens < 1:
        raise RolltoolError("hybrid CP: dp and max_tokens must be at least 1")
    length = np.asarray(lengths, dtype=np.int64)
    ring = ring or RingModel.for_workload(workload)
    k = cp_degrees(length, cp, max_tokens)
    best = _place_all(length, k, dp, cp, max_tokens, workload, ring, max_micro_batches)
    tried = np.zeros(len(length), dtype=bool)
    failed = 0
    for _ in range(SPLIT_TRIES):  # widen the heaviest sample on the worst GPU while it pays
        if best.lockstep_overhead <= 1.0 + GOOD_ENOUGH or failed >= FAILS:
            break
        i = _bottleneck_sample(best, _gpu_cost(length, k, workload, ring), k < cp, tried)
        if i is None:
            break
        tried[i] = True
        wider = k.copy()
        wider[i] *= 2
        trial = _place_all(length, wider, dp, cp, max_tokens, workload, ring, max_micro_batches)
        if trial.lockstep_cost < best.lockstep_cost:
            best, k, failed = trial, wider, 0
            tried[i] = False  # it may pay to widen it again
        else:
            failed += 1
    if cp > 1 and not (best.degree == cp).all():  # today's --cp layout: every sample split
        every = np.full(len(length), cp, dtype=np.int64)
        plain_cp = _place_all(length, every, dp, cp, max_tokens, workload, ring, max_micro_batches)
        if plain_cp.lockstep_cost < best.lockstep_cost:
            return plain_cp
    return best


SPLIT_TRIES = 12
"""Widenings tried per step (each one re-places the step): about 3 ms each at 60 samples."""

WORTH = 0.5
"""Only a sample whose per-GPU cost is at least this share of its GPU's excess over the slot's
mean is tried wider: halving a smaller one cannot remove much of it."""

FAILS = 4
"""Widening stops after this many tries in a row that did not lower the step's cost."""

GOOD_ENOUGH = 1e-3
"""No widening is tried once the lockstep overhead is within this of perfect."""


def _bottleneck_sample(
    plan: HybridPlan, per_gpu: np.ndarray, widenable: np.ndarray, tried: np.ndarray
) -> int | None:
    """The heaviest sample not yet tried that can be split wider and lies on the GPU furthest
    above its slot's mean (the lockstep cost's excess), or None."""
    costs = plan.costs  # [dp, M, cp]
    if not costs.size:
        return None
    excess = costs - costs.mean(axis=(0, 2), keepdims=True)
    for at in np.argsort(-excess, axis=None, kind="stable").tolist()[: costs.size]:
        d, j, g = np.unravel_index(at, costs.shape)
        on = (
            (plan.rank == d) & (plan.slot == j) & (plan.start <= g) & (g < plan.start + plan.degree)
        )
        pick = np.flatnonzero(on & widenable & ~tried & (per_gpu >= WORTH * excess[d, j, g]))
        if len(pick):
            return int(pick[np.argmax(per_gpu[pick])])
        if excess[d, j, g] <= 0:
            return None
    return None


def _gpu_cost(length: np.ndarray, k: np.ndarray, workload: Workload, ring: RingModel) -> np.ndarray:
    """[n] float64: each sample's cost on each GPU of its k-way split."""
    padded = np.where(k > 1, gpu_tokens(length, k) * k, length)
    return workload.cost(padded) / k + ring.exposed(length, k, workload.b)


def _place_all(
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
    cost = _gpu_cost(length, k, workload, ring)
    need = int((tokens * k).sum())
    m = max(1, -(-need // (dp * cp * max_tokens))) if len(length) else 0
    limit = max_micro_batches or max(len(length), 1)

    widths = 1 << np.arange(cp.bit_length(), dtype=np.int64)  # 1, 2, 4, ..., cp
    grid = np.broadcast_to(widths, (len(length), len(widths)))
    spread = np.broadcast_to(length[:, None], grid.shape)
    table_tokens = gpu_tokens(spread, grid).tolist()  # [n][log2 k]: a sample's share at k
    table_cost = _gpu_cost(spread, grid, workload, ring).tolist()

    def share(i: int, ki: int) -> tuple[int, float]:
        w = ki.bit_length() - 1
        return table_tokens[i][w], table_cost[i][w]

    while m <= limit:
        placed = _place(tokens, cost, k, dp, cp, m, max_tokens, share)
        if placed is not None and not np.array_equal(placed.degree, k) and m < limit:
            # whole samples joined sub-groups to fit M: keep that only if it beats M + 1
            wider = _place(tokens, cost, k, dp, cp, m + 1, max_tokens, None)
            if wider is not None and wider.lockstep_cost < placed.lockstep_cost:
                return wider
        if placed is not None:
            return placed
        m += 1
    raise RolltoolError(f"hybrid CP: the step does not fit {limit} micro-batches per GPU")


def _place(
    tokens: np.ndarray,
    cost: np.ndarray,
    k: np.ndarray,
    dp: int,
    cp: int,
    m: int,
    max_tokens: int,
    share: Callable[[int, int], tuple[int, float]] | None,
) -> HybridPlan | None:
    """Each sample, widest then heaviest first, into a sub-group of its size with room (formed
    already in some (group, slot), or new on aligned GPUs still free there): split samples where
    the step's lockstep cost rises least, then the least loaded (beside the heavy samples of a
    slot rather than in a slot of their own), ties the lowest position; then whole samples, each
    to the least loaded plain GPU with room (a heap). A whole sample that no plain GPU has room
    for joins the least loaded sub-group with room, split over it (`share(i, k)`: its tokens and
    cost on each GPU of a k-way split): one more split rather than one more micro-batch for
    every GPU (never with `share` None). None when a sample finds no room."""
    grid = _Grid.empty(len(tokens), dp, m, cp, k)
    order = np.lexsort((np.arange(len(tokens)), -cost, -k))
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
        share: Callable[[int, int], tuple[int, float]] | None,
    ) -> bool:
        """Samples `order` (tokens non-increasing), each to the plain GPU with room where the
        step's lockstep cost rises least (under its slot's most loaded GPU when one has room
        there: beside a slot's heavy samples), then the least loaded; or split into a sub-group
        (`_join`). False when one finds no room."""
        dp, m, cp = self.loads.shape
        blocks = sorted({(int(self.rank[i]) * m * cp + int(self.slot[i]) * cp + int(self.start[i]),
                          int(self.degree[i])) for i in np.flatnonzero(self.degree > 1).tolist()})  # fmt: skip
        self.size[self.size == 0] = 1  # every GPU outside a sub-group holds a plain row
        load, held = self.loads.reshape(-1).copy(), self.held.reshape(-1).copy()
        plain = self.size.reshape(-1) == 1
        slot_of = np.broadcast_to(np.arange(m)[None, :, None], (dp, m, cp)).reshape(-1)
        top = self.loads.max(axis=(0, 2)) if self.loads.size else np.zeros(m)
        into = np.zeros(len(order), dtype=np.int64)
        for n_i, i in enumerate(order.tolist()):
            t, c = int(tokens[i]), float(cost[i])
            room = plain & (held + t <= max_tokens)
            if not room.any():
                if share is None:
                    return False
                lists = load.tolist(), held.tolist()
                joined = _join(i, blocks, *lists, max_tokens, share)
                if joined is None:
                    return False
                load, held = np.array(lists[0]), np.array(lists[1], dtype=np.int64)
                b, self.degree[i] = joined
                into[n_i] = b
                top[slot_of[b]] = max(top[slot_of[b]], load[b])
                continue
            after = load + c
            rise = np.where(room, np.maximum(after - top[slot_of], 0.0), np.inf)
            b = int(np.argmin(np.where(rise == rise.min(), after, np.inf)))
            load[b] += c
            held[b] += t
            top[slot_of[b]] = max(top[slot_of[b]], load[b])
            into[n_i] = b
        self.loads = load.reshape(dp, m, cp)
        self.held = held.reshape(dp, m, cp)
        self.rank[order], self.slot[order], self.start[order] = np.unravel_index(into, (dp, m, cp))
        return True


def _join(
    i: int,
    blocks: list[tuple[int, int]],
    load: list[float],
    held: list[int],
    max_tokens: int,
    share: Callable[[int, int], tuple[int, float]],
) -> tuple[int, int] | None:
    """Sample i split over the least loaded sub-group (first GPU `b`, size k) with room for
    it, updating `load` and `held` of its GPUs; (b, k), or None when none has room."""
    best: tuple[float, int, int, int, float] | None = None
    for b, k in blocks:
        t, c = share(i, k)
        if held[b] + t <= max_tokens and (best is None or load[b] + c < best[0]):
            best = (load[b] + c, b, k, t, c)
    if best is None:
        return None
    _, b, k, t, c = best
    for g in range(b, b + k):
        load[g] += c
        held[g] += t
    return b, k
