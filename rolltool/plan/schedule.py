"""The run plan: from light columns to every step's samples, advantages, weights and layout.

Pure: no file is read or written here. `schedule` takes the validated light columns
(`Rollouts`), optional given advantages and the pack config, and decides, in this order,

- each sample's advantage, group-local over the whole input (`rolltool.plan.group_advantages`);
- which samples are over the token budget (`rolltool.plan.budget`: an error, or dropped from
  training and counted);
- the optimizer steps (`rolltool.plan.batches.assemble`, over the groups' sizes from
  `rolltool.plan.groups`) and, per batch, its planned steps (`rolltool.plan.step_plan`: loss
  weights, partition plan, record), mapped over batches by the caller's mapper;
- where every sample went, or why it was not trained (`rolltool.plan.placement`);
- what it warns about (`rolltool.plan.step_warnings`).

The result, `Schedule`, is flat arrays (17 bytes per samples.parquet row) plus a `StepOutline`
per kept step, so a run of millions of samples plans in the driver's memory; `Schedule.steps`
builds each `PlannedStep` when it is read. `rolltool.jobs.pack` then reads the tokens of one step
at a time and writes them as this plan says.

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports groups,
group_advantages, budget, step_plan, placement and step_warnings; none of them imports it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import STATUSES
from rolltool.plan.batches import Assembly, assemble
from rolltool.plan.budget import over_budget
from rolltool.plan.config import PackConfig
from rolltool.plan.group_advantages import GroupAdvantages, group_advantages
from rolltool.plan.groups import GroupIndex, assembly_groups
from rolltool.plan.placement import StepOutline, placement
from rolltool.plan.prefix_step import GroupForest
from rolltool.plan.step_plan import PlannedStep, batch_steps
from rolltool.plan.step_warnings import step_warnings
from rolltool.plan.workload import Workload
from rolltool.schema import Rollouts
from rolltool.util.mapping import Mapper, serial


@dataclass(frozen=True)
class Schedule:
    """The whole run's plan, as flat arrays (no per-sample or per-group Python objects).

    Per-sample arrays have one entry per samples.parquet row: E x n for E ``epochs`` (row
    ``e * n + i`` is sample i in epoch e), so n without --epochs, indexed by sample_index.
    ``rows[row_starts[s]:row_starts[s + 1]]`` are kept step s's trained samples in the order
    its rows hold them (rank 0's micro-batches first; ``outlines[s].sizes`` cut them into
    micro-batches). `steps` gives each step as a `PlannedStep`, built on access; ``status``,
    ``step``, ``rank`` and ``micro_batch`` give the samples.parquet columns, also on access.
    17 bytes per row (see `nbytes`; 21 with --hybrid-cp: ``cp_start``, ``cp_degree``).
    """

    outlines: list[StepOutline]  # the kept steps, in order
    assembly: Assembly  # how groups formed the batches (leftovers, dropped partial batch)
    status_code: np.ndarray  # [E*n] int8: index into STATUSES (`STATUS_CODE`)
    step_code: np.ndarray  # [E*n] int32 step a sample went to (or was dropped in), -1 if none
    advantage: np.ndarray  # [E*n] float32 (whitened over the batch where the estimator whitens)
    weight: np.ndarray  # [E*n] float32 loss weight of each trainable token, 0 if not trained
    """(`rolltool.plan.loss` computes float64, and each step's record sums that; the shards and
    samples.parquet store float32, so the driver keeps the float32 values: the same bytes.)"""
    rows: np.ndarray  # [T] int32 (int64 from 2**31 samples): trained samples, step after step
    row_starts: np.ndarray  # [S+1] int64 offsets of each step's run in ``rows``
    advantages: GroupAdvantages
    epochs: int = 1
    warnings: list[str] = field(default_factory=list)  # for people: what the plan had to do
    cp_start: np.ndarray | None = None  # [E*n] int16 --hybrid-cp: first GPU of its sub-group
    cp_degree: np.ndarray | None = None  # [E*n] int16 --hybrid-cp: CP degree k, 0 if untrained

    @property
    def num_samples(self) -> int:
        """n, the input's samples (``len(status_code) // epochs``)."""
        return len(self.status_code) // self.epochs

    @property
    def steps(self) -> PlannedSteps:
        """The kept steps, in order, each a `PlannedStep` built from the flat arrays."""
        return PlannedSteps(self)

    @property
    def status(self) -> np.ndarray:
        """[E*n] object: each row's status name (one of STATUSES)."""
        return np.array(STATUSES, dtype=object)[self.status_code]

    @property
    def step(self) -> np.ndarray:
        """[E*n] int64 step a sample went to (or was dropped in), -1 if none."""
        return self.step_code.astype(np.int64)

    @property
    def rank(self) -> np.ndarray:
        """[E*n] int64 rank of each trained row, -1 if not trained."""
        return self._slots()[0]

    @property
    def micro_batch(self) -> np.ndarray:
        """[E*n] int64 micro-batch (on its rank) of each trained row, -1 if not trained."""
        return self._slots()[1]

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        rank = np.full(len(self.status_code), -1, dtype=np.int64)
        mb = np.full(len(self.status_code), -1, dtype=np.int64)
        for s, o in enumerate(self.outlines):
            at = (
                o.record.epoch * self.num_samples
                + self.rows[self.row_starts[s] : self.row_starts[s + 1]]
            )
            dp, m = o.sizes.shape
            rank[at] = np.repeat(np.arange(dp).repeat(m), o.sizes.ravel())
            mb[at] = np.repeat(np.tile(np.arange(m), dp), o.sizes.ravel())
        return rank, mb

    def trained(self, s: int) -> np.ndarray:
        """[k] int64 kept step s's trained samples in row order (its ``members[order]``),
        without building the step."""
        return self.rows[self.row_starts[s] : self.row_starts[s + 1]].astype(np.int64)

    def planned(self, s: int) -> PlannedStep:
        """Kept step s as a `PlannedStep`: ``members`` in row order, so ``order`` is
        ``arange`` and each micro-batch a run of consecutive positions."""
        o = self.outlines[s]
        members = self.trained(s)
        at = o.record.epoch * self.num_samples + members
        dp, m = o.sizes.shape
        runs = np.split(np.arange(len(members), dtype=np.int64), np.cumsum(o.sizes.ravel())[:-1])
        return PlannedStep(
            index=o.index,
            members=members,
            advantage=self.advantage[at],
            weight=self.weight[at],
            plan=dataclasses.replace(
                o.plan, micro_batches=[runs[r * m : (r + 1) * m] for r in range(dp)]
            ),
            record=o.record,
            uniform_dropped=o.uniform_dropped,
            overlong_dropped=o.overlong_dropped,
            count_trimmed=o.count_trimmed,
            cut=o.cut,
            hybrid=o.hybrid,
            shared=o.shared,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the per-sample and per-row arrays (what grows with the input)."""
        flat = (self.status_code, self.step_code, self.advantage, self.weight, self.rows,
                self.cp_start, self.cp_degree)  # fmt: skip
        return sum(a.nbytes for a in flat if a is not None) + self.advantages.value.nbytes


class PlannedSteps(Sequence[PlannedStep]):
    """`Schedule.steps`: a sequence of `PlannedStep`, each built when it is read (a slice is a
    list), so the driver keeps only the flat arrays."""

    def __init__(self, plan: Schedule) -> None:
        self._plan = plan

    def __len__(self) -> int:
        return len(self._plan.outlines)

    @overload
    def __getitem__(self, i: int) -> PlannedStep: ...
    @overload
    def __getitem__(self, i: slice) -> list[PlannedStep]: ...
    def __getitem__(self, i: int | slice) -> PlannedStep | list[PlannedStep]:
        if isinstance(i, slice):
            return [self._plan.planned(s) for s in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._plan.planned(i % len(self))

    def __iter__(self) -> Iterator[PlannedStep]:
        return (self._plan.planned(s) for s in range(len(self)))


def schedule(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    given: np.ndarray | None = None,
    *,
    mapper: Mapper = serial,
    prefixes: Mapping[int, GroupForest] | None = None,
) -> Schedule:
    """Plan the run (see the module docstring); `given`: the input's own advantages, if any;
    `mapper(fn, batches)` computes ``[fn(b) for b in batches]`` in order, here by default, or in
    forked processes (`rolltool.engine.local.plan_mapper`) or on Ray (`rolltool.engine.ray`):
    the same plan whichever. Each planned step is folded into the flat arrays as it arrives, so
    the driver never holds every step's arrays. `prefixes`: with ``--share-prefix``, each
    group's prefixes from the token pass (`rolltool.fetch.prefixes`; none given: none found)."""
    adv = group_advantages(ro, config, given)
    too_long = over_budget(ro, config)
    groups = assembly_groups(ro, ~too_long, adv.uniform)
    assembly = assemble(groups, ro.env_names, config.steps)
    if not assembly.steps:
        raise RolltoolError(
            f"the input does not fill a single step of {config.steps.batch_size} "
            f"{config.steps.batch_unit}",
            hint="lower --batch-size, or pass --keep-last to keep a partial step",
        )
    in_group = GroupIndex.of(ro.group, ro.num_groups)
    plan = functools.partial(
        batch_steps, ro, config, workload, adv, in_group, too_long, groups.env,
        prefixes=prefixes or {},
    )  # fmt: skip
    results: Iterable[list[PlannedStep]] = mapper(plan, assembly.steps)
    flat = placement(
        ro, assembly, in_group, too_long, adv.value, config.steps.epochs, config.hybrid_cp
    )
    outlines = [flat.add(st) for st in _drain(results)]
    return Schedule(
        outlines=outlines,
        assembly=assembly,
        advantages=adv,
        epochs=config.steps.epochs,
        warnings=step_warnings(outlines, config),
        **flat.arrays(),
    )


def _drain(results: Iterable[list[PlannedStep]]) -> Iterator[PlannedStep]:
    """Every step of every batch's result, in order; a list's entries are let go once read."""
    if not isinstance(results, list):
        for batch in results:
            yield from batch
        return
    for i, batch in enumerate(results):
        results[i] = None
        yield from batch
