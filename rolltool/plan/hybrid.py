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
the partition's ``align="lockstep"``. `plan_hybrid_step` keeps the cheaper of two candidates,
each placed by one greedy (`rolltool.plan.hybrid_place`) and then halved (`hybrid_halve`):

1. every sample at its least degree ``k_min`` (the smallest power of two whose per-GPU tokens
   fit ``max_tokens``), then the heaviest sample on the GPU furthest above its slot's mean
   widened while that lowers the step's cost (`_tries`: 12 tries up to 128 samples, fewer
   above, 1 at 1,024; each re-places the step);
2. every sample split over all cp GPUs (today's ``--cp`` layout, under the same greedy).

The greedy places split samples first, widest and heaviest first, each into a sub-group of its
size with room where Σ_j max rises least; then whole samples likewise onto plain GPUs; a whole
sample no plain GPU has room for joins a sub-group when that beats one more micro-batch. M
rises from the token lower bound until it places all. The halving pass then cuts each
sub-group into its two halves, recursively, wherever that raises no slot's maximum, giving
samples back to fewer GPUs (less padding and ring). So the plan is never costlier than placing
every sample at its least degree, and never than the ``--cp`` layout under the same greedy; a
sample is split beyond its least degree only in a candidate that lowers the step's cost.
`rolltool.plan.hybrid_bound.lower_bound` bounds what any layout can reach.

Measured (``benchmarks/hybrid_cp.py``, ``benchmarks/longctx.py --hybrid``): WLB-LLM's documents
on 1 x 8 GPUs 1.009 of the ideal, 26% of tokens split; the agent long tail on 8 x 4 GPUs 1.050
of the ideal where its lower bound is 1.040 and `plan_step`'s ``--cp 4`` 1.067, ~90 ms a step
of 1,460 samples on this 2-core machine (the candidate 2 wins there: every GPU is full of
tokens, and splitting packs tokens finer). Deterministic: stable orders, ties broken by
position then index.

Pure NumPy: nothing here reads files, prints, or knows the format (`rolltool.plan.hybrid_step`
maps a plan to the pipeline's, `rolltool.format.hybrid` lays it out).
"""

from __future__ import annotations

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.plan.hybrid_bound import lower_bound
from rolltool.plan.hybrid_cost import RingModel, cp_degrees, gpu_cost, gpu_tokens
from rolltool.plan.hybrid_halve import halve
from rolltool.plan.hybrid_place import HybridPlan, place_all
from rolltool.plan.workload import Workload

__all__ = ["HybridPlan", "RingModel", "cp_degrees", "gpu_cost", "gpu_tokens", "plan_hybrid_step"]


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

    def placed(k: np.ndarray, most: int | None = max_micro_batches) -> HybridPlan:
        plan = place_all(length, k, dp, cp, max_tokens, workload, ring, most)
        return halve(plan, length, workload, ring)

    k = cp_degrees(length, cp, max_tokens)  # the degrees asked for; the plan's may be lower
    best = placed(k)
    enough = (1.0 + GOOD_ENOUGH) * lower_bound(
        length, dp=dp, cp=cp, max_tokens=max_tokens, workload=workload, ring=ring
    )  # no layout beats the bound: within this of it, stop looking
    tried = np.zeros(len(length), dtype=bool)
    failed = 0
    for _ in range(_tries(len(length))):  # widen the heaviest sample on the worst GPU while it pays
        if best.lockstep_overhead <= 1.0 + GOOD_ENOUGH or best.lockstep_cost <= enough:
            break
        if failed >= FAILS:
            break
        i = _bottleneck_sample(best, gpu_cost(length, best.degree, workload, ring),
                               best.degree < cp, tried)  # fmt: skip
        if i is None:
            break
        tried[i] = True
        wider = k.copy()
        wider[i] = best.degree[i] * 2
        most = best.num_micro_batches + 1  # more would not step faster: give up there
        if max_micro_batches is not None:
            most = min(most, max_micro_batches)
        try:
            trial = placed(wider, most)
        except RolltoolError:
            trial = None
        if trial is not None and trial.lockstep_cost < best.lockstep_cost:
            best, k, failed = trial, wider, 0
            tried[i] = False  # it may pay to widen it again
        else:
            failed += 1
    if cp > 1 and best.lockstep_cost > enough:  # today's --cp layout, then halved
        every = placed(np.full(len(length), cp, dtype=np.int64))
        if every.lockstep_cost < best.lockstep_cost:
            return every
    return best


def _tries(n: int) -> int:
    """Widenings tried for a step of `n` samples: `SPLIT_TRIES` up to `TRIES_FULL_UP_TO`
    samples, then fewer (each re-places the whole step; with many samples the short ones
    already even the slots out and the ``--cp`` candidate wins: the agent steps of
    ``benchmarks/longctx.py``), never fewer than `MIN_TRIES`."""
    return max(MIN_TRIES, SPLIT_TRIES * TRIES_FULL_UP_TO // max(n, TRIES_FULL_UP_TO))


SPLIT_TRIES = 12
"""Widenings tried per step of up to `TRIES_FULL_UP_TO` samples (each one re-places the step):
about 1 ms each at 60 samples, 20 ms at 1,024."""

TRIES_FULL_UP_TO, MIN_TRIES = 128, 1
"""`_tries`: the step size up to which every widening is tried, and the fewest tried."""

WORTH = 0.5
"""Only a sample whose per-GPU cost is at least this share of its GPU's excess over the slot's
mean is tried wider: halving a smaller one cannot remove much of it."""

FAILS = 4
"""Widening stops after this many tries in a row that did not lower the step's cost."""

GOOD_ENOUGH = 1e-3
"""No widening, and no ``--cp`` candidate, is tried once the plan is within this of perfect
(its lockstep overhead) or of the step's lower bound (`hybrid_bound.lower_bound`)."""


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
