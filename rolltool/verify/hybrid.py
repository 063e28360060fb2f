"""``--hybrid-cp`` invariants: each row's sub-groups, read from the shards' own arrays.

A hybrid pack's rows cut their C GPUs into aligned power-of-two sub-groups
(`rolltool.format.hybrid`). From the `Segments` tables (``row_cp_groups``, ``cp_start``):

- ``row.hybrid``: each row's sizes partition its C GPUs into aligned blocks; its segments lie in
  its blocks, each block one run in GPU order with at least one segment; in a block of k > 1
  every sample is followed by exactly its padding to a multiple of 2k and every other padding
  segment is a multiple of 2k (valid THD for the block's ring); with ``--row-len R`` every
  block holds k x R tokens;
- ``row.budget``: every GPU's tokens, CP padding counted (row-end padding not), within the
  per-GPU budget (``--micro-batch-tokens``);
- ``sample.cp``: samples.parquet's ``cp_start`` and ``cp_degree`` are where the rows hold each
  sample (`hybrid_samples`).

Each sample appearing exactly once, at its planned place, is `rolltool.verify.rows.placement`'s
(a sample sits in one segment, so in one block of one degree); equal micro-batch counts are
`rank_files`' (every rank's record), and every GPU of a row has a view (a block per GPU);
the step records' per-GPU figures (`HybridRecord`) are `rolltool.verify.steps.step_plans`',
recomputed from samples.parquet with each sample's degree (`sample_places`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from rolltool.format import PAD_SAMPLE, SAMPLES, PlanRecord
from rolltool.format.hybrid import block_problem, blocks, partition_problem
from rolltool.plan.hybrid import RingModel, gpu_tokens
from rolltool.plan.hybrid_step import gpu_costs, occupied_tokens
from rolltool.plan.partition import metrics
from rolltool.plan.workload import Workload
from rolltool.util.problems import Problem
from rolltool.verify.context import Context, Samples
from rolltool.verify.rows import at_plan
from rolltool.verify.segments import row_ids, segment_degrees


def shard_places(ctx: Context) -> tuple[np.ndarray, np.ndarray]:
    """([n] degree, [n] first GPU) of every samples.parquet row as the shards hold it (degree
    0, GPU 0 for a sample not found at its planned place: `placement` reports that)."""
    n = ctx.samples.n
    degree, start = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    seg = ctx.segments
    ok = at_plan(ctx)
    degree[seg.sample[ok]] = segment_degrees(seg, ctx.split.cp)[ok]
    start[seg.sample[ok]] = seg.cp_start[ok]
    return degree, start


def sample_places(ctx: Context) -> tuple[np.ndarray, np.ndarray]:
    """([n] degree, [n] first GPU) of every samples.parquet row: its ``cp_degree`` and
    ``cp_start`` columns (`hybrid_samples` compares them with the shards), else the shards'
    (`shard_places`) when they are missing (reported there)."""
    s = ctx.samples
    if s.cp_degree is not None and s.cp_start is not None:
        return s.cp_degree, s.cp_start
    return shard_places(ctx)


def hybrid_samples(ctx: Context) -> Iterator[Problem]:
    """``sample.cp``: a hybrid pack's samples.parquet has ``cp_start`` and ``cp_degree``, and
    every trained sample's are the sub-group the shards hold it in (an untrained one's degree
    is 0)."""
    s = ctx.samples
    if not ctx.split.hybrid:
        return
    if s.cp_degree is None or s.cp_start is None:
        text = "no cp_start and cp_degree columns (a --hybrid-cp pack's samples.parquet has them)"
        yield Problem("sample.cp", SAMPLES, text)
        return
    degree, start = shard_places(ctx)
    seen = np.zeros(s.n, dtype=bool)
    seen[ctx.segments.sample[at_plan(ctx)]] = True
    for i in np.flatnonzero(seen & ((degree != s.cp_degree) | (start != s.cp_start))):
        text = (f"cp_start {s.cp_start[i]} cp_degree {s.cp_degree[i]}, its rows hold it on "
                f"GPUs {start[i]}..{start[i] + degree[i] - 1}")  # fmt: skip
        yield Problem("sample.cp", s.where(i), text)
    for i in np.flatnonzero(~s.trained & (s.cp_degree != 0)):
        yield Problem("sample.cp", s.where(i), f"not trained, but cp_degree {s.cp_degree[i]}")


def hybrid_layout(ctx: Context) -> Iterator[Problem]:
    """``row.hybrid`` and the per-GPU ``row.budget`` of a hybrid pack (see the module
    docstring); nothing for other packs."""
    if not ctx.split.hybrid:
        return
    seg, cp = ctx.segments, ctx.split.cp
    budget = ctx.manifest.config.micro_batch_tokens
    per_gpu = None if ctx.row_len is None else ctx.row_len // cp
    bounds = np.concatenate(
        [[0], np.cumsum(np.bincount(row_ids(seg), minlength=len(seg.row_tokens)))]
    )
    for r in range(len(seg.row_tokens)):
        groups = seg.row_cp_groups[r * cp : (r + 1) * cp]
        wrong = partition_problem(groups, cp)
        if wrong is not None:
            yield Problem("row.hybrid", seg.row_where(r), wrong)
            continue
        s0, s1 = int(bounds[r]), int(bounds[r + 1])
        at = seg.cp_start[s0:s1]
        runs = np.flatnonzero(np.diff(at, prepend=-1) != 0)
        found = blocks(groups)
        if at[runs].tolist() != [a for a, _ in found]:
            text = (f"segments in sub-groups {at[runs].tolist()} in this order, the row's "
                    f"sub-groups are {[a for a, _ in found]} (each one run, in GPU order)")  # fmt: skip
            yield Problem("row.hybrid", seg.row_where(r), text)
            continue
        ends = np.append(runs[1:], len(at))
        for (a, k), b0, b1 in zip(found, runs.tolist(), ends.tolist(), strict=True):
            lens, index = seg.length[s0 + b0 : s0 + b1], seg.sample[s0 + b0 : s0 + b1]
            where = f"{seg.row_where(r)} GPUs {a}..{a + k - 1}"
            why = block_problem(lens, index, k, per_gpu, None)
            if why is not None:
                yield Problem("row.hybrid", where, why)
            real = lens[index != PAD_SAMPLE]
            held = int(gpu_tokens(real, np.full(len(real), k)).sum())
            if budget is not None and held > budget:
                text = f"{held} tokens on each GPU (CP padding counted), over the {budget}-token budget"
                yield Problem("row.budget", where, text)


RTOL = 1e-9
"""Per-GPU figures are ratios of float64 sums: equal up to the summation order."""


@dataclass(frozen=True)
class HybridGrid:
    """Each samples.parquet row's CP degree and first GPU as the shards hold them, and the
    ring settings the manifest records: what a hybrid step's per-GPU costs are recomputed
    from (the plan's formula, `rolltool.plan.hybrid`: each of k GPUs pays 1/k of the
    sample's padded cost plus the ring's exposed communication)."""

    degree: np.ndarray  # [n] int64
    start: np.ndarray  # [n] int64
    cp: int
    bandwidth: float  # bytes/s
    speed: float  # the workload's units per second

    @classmethod
    def of(cls, ctx: Context) -> HybridGrid:
        degree, start = sample_places(ctx)
        c = ctx.manifest.config
        link = c.cp_link_bandwidth if c.cp_link_bandwidth is not None else 0.0
        tflops = c.gpu_tflops if c.gpu_tflops is not None else 0.0
        return cls(degree, start, ctx.split.cp, link * 1e9, tflops * 1e12)

    def occupied(self, length: np.ndarray) -> np.ndarray:
        return occupied_tokens(length, self.degree)

    def costs(
        self, s: Samples, planned: np.ndarray, dp: int, m: int, workload: Workload
    ) -> np.ndarray:
        """[dp, m, cp] float64: each GPU's cost in each slot of a step (`gpu_costs`)."""
        ring = RingModel.for_workload(
            workload, bandwidth=self.bandwidth or 1.0, speed=self.speed or 1.0
        )
        return gpu_costs(
            s.length[planned], self.degree[planned], self.start[planned], s.rank[planned],
            s.micro_batch[planned], shape=(dp, m, self.cp), workload=workload, ring=ring,
        )  # fmt: skip

    def record_problems(
        self, s: Samples, planned: np.ndarray, step: int, plan: PlanRecord, dp: int
    ) -> Iterator[Problem]:
        """The step record's `HybridRecord` against the rows: GPUs, per-GPU lockstep overhead
        and imbalance, samples and tokens per degree."""
        if plan.hybrid is None:
            yield Problem("step.plan", f"step {step}", "no per-GPU (hybrid) figures in the plan")
            return
        k, length = self.degree[planned], s.length[planned]
        ks = sorted(set(k.tolist()))
        found: dict[str, object] = {
            "gpus": dp * self.cp,
            "split_samples": {str(x): int((k == x).sum()) for x in ks},
            "split_tokens": {str(x): int(length[k == x].sum()) for x in ks},
        }
        m = plan.micro_batches_per_rank
        if m and plan.workload is not None:
            grid = self.costs(s, planned, dp, m, Workload.from_record(plan.workload))
            per_gpu = grid.transpose(0, 2, 1).reshape(dp * self.cp, m)
            found["lockstep_overhead"] = metrics.lockstep_overhead(per_gpu)
            found["imbalance"] = metrics.imbalance(per_gpu)
        for key, value in found.items():
            recorded = getattr(plan.hybrid, key)
            if isinstance(value, float):
                off = not abs(recorded - value) <= RTOL * max(abs(recorded), abs(value))
            else:
                off = dict(recorded) != value if isinstance(value, dict) else recorded != value
            if off:
                text = f"plan hybrid.{key} is {recorded}, the rows give {value}"
                yield Problem("step.plan", f"step {step}", text)
