"""Undo splits that do not pay: each sub-group of a hybrid plan cut in two halves, recursively.

A sub-group of k GPUs holds samples each split k ways. `halve` tries to lay them out instead
in its two aligned halves of k/2 GPUs, each sample split k/2 ways (at k = 2: whole, one GPU
each), by longest processing time (heaviest first, to the lighter half with room): kept only
when neither half's GPUs end above the slot's most loaded GPU of the plan it started from, so no
slot's maximum rises and the step's lockstep cost Σ_j max_g never does; then each half is tried
again. A half left without samples becomes plain GPUs with empty rows. Splitting fewer ways pays
less CP padding and less exposed ring communication, so the work falls, and split tokens with
it; where the greedy placement had to split everything (the ``--cp`` candidate), this keeps the
balance and gives the short samples back to single GPUs.

Pure NumPy; `rolltool.plan.hybrid.plan_hybrid_step` runs it on every candidate.
"""

from __future__ import annotations

import itertools

import numpy as np

from rolltool.plan.hybrid_cost import RingModel, gpu_cost, gpu_tokens
from rolltool.plan.hybrid_place import HybridPlan
from rolltool.plan.workload import Workload

__all__ = ["halve"]


def halve(plan: HybridPlan, lengths: np.ndarray, workload: Workload, ring: RingModel) -> HybridPlan:
    """`plan` with its sub-groups halved where that raises no slot's maximum (module
    docstring); `plan` itself when none can be."""
    length = np.asarray(lengths, dtype=np.int64)
    split = np.flatnonzero(plan.degree > 1)
    if not len(split):
        return plan
    _, m, cp = plan.costs.shape
    cells = plan.rank[split] * (m * cp) + plan.slot[split] * cp + plan.start[split]
    by_cell = np.lexsort((split, cells))  # sub-group by sub-group, in position order
    order, cells = split[by_cell], cells[by_cell]
    bounds = [*np.flatnonzero(np.r_[True, cells[1:] != cells[:-1]]).tolist(), len(cells)]
    work = _Work(plan, length, workload, ring)
    for lo, hi in itertools.pairwise(bounds):
        work.try_block(order[lo:hi].tolist())
    return work.result() if work.changed else plan


class _Work:
    """The plan being halved: per-sample start and degree, per-GPU costs, tokens and sizes."""

    def __init__(
        self, plan: HybridPlan, length: np.ndarray, workload: Workload, ring: RingModel
    ) -> None:
        self.plan, self.length = plan, length
        self.start, self.degree = plan.start.copy(), plan.degree.copy()
        self.costs, self.tokens, self.groups = (
            plan.costs.copy(), plan.tokens.copy(), plan.groups.copy()
        )  # fmt: skip
        self.top = plan.costs.max(axis=(0, 2))  # each slot's bound: never exceeded
        cp = plan.costs.shape[2]
        widths = [1 << w for w in range(cp.bit_length())]  # 1, 2, ..., cp
        self.share_tokens = {k: gpu_tokens(length, np.full(len(length), k)) for k in widths}
        self.share_cost = {k: gpu_cost(length, np.full(len(length), k), workload, ring) for k in widths}  # fmt: skip
        self.changed = False

    def try_block(self, items: list[int]) -> None:
        i0 = items[0]
        d, j = int(self.plan.rank[i0]), int(self.plan.slot[i0])
        self._halve(d, j, int(self.start[i0]), int(self.degree[i0]), items)

    def _halve(self, d: int, j: int, a: int, k: int, items: list[int]) -> None:
        if k == 1:
            return
        h = k // 2
        t, c = self.share_tokens[h], self.share_cost[h]
        cap = self.plan.max_tokens
        if any(int(t[i]) > cap for i in items):
            return
        halves: tuple[list[int], list[int]] = ([], [])
        load, held = [0.0, 0.0], [0, 0]
        for i in sorted(items, key=lambda i: (-float(c[i]), i)):  # heaviest first
            ti, ci = int(t[i]), float(c[i])
            room = [held[s] + ti <= cap for s in (0, 1)]
            if not any(room):
                return
            s = 0 if room[0] and (not room[1] or load[0] <= load[1]) else 1
            halves[s].append(i)
            load[s] += ci
            held[s] += ti
        if max(load) > self.top[j]:
            return
        self.changed = True
        for s, members in enumerate(halves):
            g = slice(a + s * h, a + (s + 1) * h)
            self.costs[d, j, g] = load[s]
            self.tokens[d, j, g] = held[s]
            self.groups[d, j, g] = h if members else 1
            for i in members:
                self.start[i], self.degree[i] = a + s * h, h
            if members:
                self._halve(d, j, a + s * h, h, members)

    def result(self) -> HybridPlan:
        p = self.plan
        return HybridPlan(
            rank=p.rank, slot=p.slot, start=self.start, degree=self.degree, groups=self.groups,
            costs=self.costs, tokens=self.tokens, max_tokens=p.max_tokens,
        )  # fmt: skip
