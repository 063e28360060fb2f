"""Hybrid context parallelism: a CP degree per sample and per slot, planned (issue 22).

The world is ``dp`` data-parallel groups of ``cp`` GPUs, as with ``--cp``. In each micro-batch
slot j the cp GPUs of group d form *aligned* sub-groups of power-of-two sizes k in {1, 2, 4, ...,
cp}: GPUs ``[a·k, (a+1)·k)`` of the group, so a trainer creates every sub-group's process group
once. A sample is whole on one GPU (k = 1) or zigzag-split over one sub-group of size k (chunks r
and 2k-1-r, as ``--cp``). Every GPU has the same number of micro-batches M; each GPU's micro-batch
holds at most ``max_tokens`` tokens, CP padding counted (a split sample of L tokens puts
``ceil(L / 2k) · 2`` tokens on each of its k GPUs).

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
``k_min`` (the smallest power of two whose per-GPU tokens fit ``max_tokens``), and a second
candidate in which a sample heavier than a GPU's fair share (the step's work over dp · cp · M) is
split further while that lowers its per-GPU cost; each candidate is placed by the same greedy
(splits first, widest and heaviest first, each into the aligned position whose GPUs are least
loaded and have room), M from the token lower bound upward, and the cheaper plan is kept (ties:
the one that splits less). So a sample that fits a GPU is split only when that lowers the step's
cost. Deterministic: stable orders, ties broken by position then index.

Pure NumPy: nothing here reads files, prints, or knows the format (which is not written yet).
"""

from __future__ import annotations

import heapq
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
    return best


SPLIT_TRIES = 24
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
    while m <= limit:
        placed = _place(tokens, cost, k, dp, cp, m, max_tokens)
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
) -> HybridPlan | None:
    """Each sample, widest then heaviest first, into the aligned position (group, slot, GPUs)
    with room whose most loaded GPU is the least loaded; None when one finds no room. Split
    samples (few) search the grid with NumPy; whole ones (most) take the least loaded GPU with
    room from a heap (ties: the lowest position), the same choice."""
    n = len(tokens)
    loads = np.zeros((dp, m, cp), dtype=np.float64)
    held = np.zeros((dp, m, cp), dtype=np.int64)
    rank, slot, start = (np.zeros(n, dtype=np.int64) for _ in range(3))
    order = np.lexsort((np.arange(n), -cost, -k))
    split = int(np.count_nonzero(k > 1))
    for i in order[:split].tolist():
        ki, ti = int(k[i]), int(tokens[i])
        parts = cp // ki
        room = (held.reshape(dp, m, parts, ki) + ti <= max_tokens).all(axis=3)
        score = np.where(room, loads.reshape(dp, m, parts, ki).max(axis=3), np.inf)
        at = int(np.argmin(score))
        if not np.isfinite(score.flat[at]):
            return None
        d, j, a = np.unravel_index(at, (dp, m, parts))
        g = slice(int(a) * ki, (int(a) + 1) * ki)
        loads[d, j, g] += cost[i]
        held[d, j, g] += ti
        rank[i], slot[i], start[i] = int(d), int(j), int(a) * ki
    bin_load, bin_held = loads.reshape(-1).tolist(), held.reshape(-1).tolist()
    ready = [(x, b) for b, x in enumerate(bin_load)]  # (load, bin)
    heapq.heapify(ready)
    parked: list[tuple[int, int]] = []  # (-room, bin): too full for the sample at hand
    whole = order[split:]
    whole = whole[np.lexsort((whole, -tokens[whole], -cost[whole]))]  # tokens non-increasing
    costs, toks = cost.tolist(), tokens.tolist()
    into = np.zeros(len(whole), dtype=np.int64)
    for n_i, i in enumerate(whole.tolist()):
        t = toks[i]
        while parked and -parked[0][0] >= t:  # later samples are no longer: room again
            b = heapq.heappop(parked)[1]
            heapq.heappush(ready, (bin_load[b], b))
        while ready and bin_held[ready[0][1]] + t > max_tokens:
            b = heapq.heappop(ready)[1]
            heapq.heappush(parked, (bin_held[b] - max_tokens, b))
        if not ready:
            return None
        b = heapq.heappop(ready)[1]
        bin_load[b] += costs[i]
        bin_held[b] += t
        heapq.heappush(ready, (bin_load[b], b))
        into[n_i] = b
    loads = np.array(bin_load, dtype=np.float64).reshape(dp, m, cp)
    held = np.array(bin_held, dtype=np.int64).reshape(dp, m, cp)
    rank[whole], slot[whole], start[whole] = np.unravel_index(into, (dp, m, cp))
    return HybridPlan(
        rank=rank, slot=slot, start=start, degree=k.astype(np.int64), costs=loads, tokens=held,
        max_tokens=max_tokens,
    )  # fmt: skip
