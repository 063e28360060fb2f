"""A ``--hybrid-cp`` step's plan in the pipeline's terms: `plan_hybrid_step`'s layout as the
`StepPlan` every stage reads, the sub-groups the packer lays out, and the record's figures.

`rolltool.plan.hybrid.plan_hybrid_step` places each sample of a step in a (group, slot) and a
sub-group of that slot's cp GPUs (its first GPU ``start`` and size k). The rest of the pipeline
reads a step as ``micro_batches[rank][slot]``, one group row each (`StepPlan`); here each group
row lists its samples **sub-group by sub-group in GPU order**, within one in plan position
order, which is the order the row stores them (`rolltool.format.hybrid`): so the step's row
order (`PlannedStep.order`), samples.parquet's rank and micro-batch, the fetch and the loss
weights are those of any other pack. What a ``--cp`` row does not say is kept beside it, in
`HybridLayout`: each GPU's sub-group size per slot and each sample's first GPU.

Worked example: cp 4, a slot of group 0 with groups ``[2, 2, 1, 1]``, sample a split over GPUs
0-1, b whole on GPU 3, c whole on GPU 2 and d split over 0-1: its micro-batch is ``[a, d, c,
b]`` (GPU 0's sub-group, then GPU 2, then GPU 3) and ``cp_start`` ``[0, 0, 2, 3]``.

The `StepPlan`'s figures are per group, as for ``--cp``: ``tokens`` a group row's sample tokens
with each sample's own CP padding (k = 1: none), ``costs`` the group's slowest GPU in the slot,
``max_tokens`` the group's budget (cp x the per-GPU one); `hybrid_record` adds what only the
GPUs show (lockstep overhead over every GPU, samples and tokens per degree).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolltool.format import HybridRecord
from rolltool.plan.hybrid import HybridPlan, RingModel, gpu_tokens, plan_hybrid_step
from rolltool.plan.partition import StepPlan
from rolltool.plan.partition.metrics import imbalance, lockstep_overhead
from rolltool.plan.workload import Workload


@dataclass(frozen=True)
class HybridLayout:
    """What a hybrid step's rows need beside its `StepPlan`'s micro-batches."""

    groups: np.ndarray  # [dp, M, cp] int16: each GPU's sub-group size per slot (1: a plain row)
    cp_start: np.ndarray  # [n] int16: each sample's first GPU, in the step's row order

    def degree(self, rank: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """[n] int64 each sample's CP degree k (row order; `rank` and `slot` per sample)."""
        return self.groups[rank, slot, self.cp_start.astype(np.int64)].astype(np.int64)


def hybrid_step(
    lengths: np.ndarray, *, dp: int, cp: int, max_tokens: int, workload: Workload, ring: RingModel
) -> tuple[StepPlan, HybridLayout, HybridPlan]:
    """The step's hybrid plan (`plan_hybrid_step`, ``max_tokens`` per GPU), as the pipeline's
    `StepPlan` (positions index `lengths`), its `HybridLayout` and the planner's own result."""
    length = np.asarray(lengths, dtype=np.int64)
    hp = plan_hybrid_step(length, dp=dp, cp=cp, max_tokens=max_tokens, workload=workload, ring=ring)
    m = hp.num_micro_batches
    # row order: group, slot, sub-group (its first GPU), then position
    order = np.lexsort((np.arange(len(length)), hp.start, hp.slot, hp.rank))
    cells = hp.rank[order] * m + hp.slot[order]
    bounds = np.searchsorted(cells, np.arange(dp * m + 1), side="left")
    grid = [[order[bounds[r * m + j] : bounds[r * m + j + 1]] for j in range(m)] for r in range(dp)]
    occupied = np.where(hp.degree > 1, gpu_tokens(length, hp.degree) * hp.degree, length)
    tokens = np.zeros(dp * m, dtype=np.int64)
    np.add.at(tokens, hp.rank * m + hp.slot, occupied)
    need = int(occupied.sum())
    plan = StepPlan(
        micro_batches=grid,
        costs=hp.costs.max(axis=2) if m else np.zeros((dp, 0)),
        tokens=tokens.reshape(dp, m),
        empty=(np.diff(bounds) == 0).reshape(dp, m),
        num_micro_batches=m,
        ffd_micro_batches=None,
        min_micro_batches=max(1, -(-need // (dp * cp * max_tokens))) if len(length) else 0,
        max_tokens=max_tokens * cp,
        micro_batch_size=None,
        align="lockstep",
        workload=workload,
    )
    layout = HybridLayout(
        groups=hp.groups.astype(np.int16), cp_start=hp.start[order].astype(np.int16)
    )
    return plan, layout, hp


def hybrid_record(hp: HybridPlan, lengths: np.ndarray) -> HybridRecord:
    """The step record's per-GPU figures of a hybrid plan (`HybridRecord`)."""
    dp, m, cp = hp.costs.shape
    per_gpu = hp.costs.transpose(0, 2, 1).reshape(dp * cp, m)
    length = np.asarray(lengths, dtype=np.int64)
    ks = sorted(set(hp.degree.tolist()))
    return HybridRecord(
        gpus=dp * cp,
        lockstep_overhead=lockstep_overhead(per_gpu),
        imbalance=imbalance(per_gpu),
        split_samples={str(k): int((hp.degree == k).sum()) for k in ks},
        split_tokens={str(k): int(length[hp.degree == k].sum()) for k in ks},
    )


def occupied_tokens(lengths: np.ndarray, degree: np.ndarray) -> np.ndarray:
    """[n] int64 tokens each sample takes in its group row: padded to a multiple of 2k when
    split k > 1 ways, itself when whole (k = 1).

    >>> occupied_tokens(np.array([10, 10, 7]), np.array([1, 2, 4])).tolist()
    [10, 12, 8]
    """
    length = np.asarray(lengths, dtype=np.int64)
    k = np.asarray(degree, dtype=np.int64)
    return np.where(k > 1, gpu_tokens(length, np.maximum(k, 1)) * k, length)


def gpu_costs(
    lengths: np.ndarray,
    degree: np.ndarray,
    start: np.ndarray,
    rank: np.ndarray,
    slot: np.ndarray,
    *,
    shape: tuple[int, int, int],
    workload: Workload,
    ring: RingModel,
) -> np.ndarray:
    """[dp, M, cp] float64 each GPU's cost per slot of a step laid out as given (per sample its
    degree, first GPU, group and slot), by the plan's own formula (`rolltool.plan.hybrid`: each
    of k GPUs pays 1/k of the padded sample's cost plus the ring's exposed communication): what
    ``stats`` and ``verify`` recompute from samples.parquet."""
    length = np.asarray(lengths, dtype=np.int64)
    k = np.maximum(np.asarray(degree, dtype=np.int64), 1)
    a = np.asarray(start, dtype=np.int64)
    cost = workload.cost(occupied_tokens(length, k)) / k + ring.exposed(length, k, workload.b)
    grid = np.zeros(shape)
    for offset in range(shape[2]):
        on = (k > offset) & (a + offset < shape[2])
        np.add.at(grid, (rank[on], slot[on], a[on] + offset), cost[on])
    return grid
