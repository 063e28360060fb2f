"""The run plan: from light columns to every step's samples, advantages, weights and layout.

Pure: no file is read or written here. `schedule` takes the validated light columns
(`Rollouts`), optional given advantages and the pack config, and decides

- each sample's advantage (group-local over the whole input; estimators that whiten, such as
  ``reinforce_pp_baseline``, whiten over each optimizer step);
- which samples are over the token budget (an error, or dropped from training and counted);
- the optimizer steps (`rolltool.plan.batches.assemble`) and, per step, the loss weights
  (`rolltool.plan.loss`), the partition plan (`rolltool.plan.partition.plan_step`, which enforces the token
  cap and equal micro-batch counts where the plan is built) and the record that explains the
  step's cost and gradient scale (`rolltool.format.StepRecord`);
- where every sample went, or why it was not trained (``STATUSES``).

`rolltool.jobs.pack` then reads the tokens of one step at a time and writes them as this plan says.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import STATUSES, Denominators, PlanRecord, StepCounts, StepRecord
from rolltool.plan.advantages import AdvantageInput, compute_advantages, group_stats, reward_moments
from rolltool.plan.batches import Assembly, Groups, Step, assemble
from rolltool.plan.config import PackConfig
from rolltool.plan.loss import sample_weights, step_denominators
from rolltool.plan.minibatches import epoch_groups, sample_units, split_epoch
from rolltool.plan.partition import StepPlan, plan_step
from rolltool.plan.workload import Workload
from rolltool.schema import Rollouts
from rolltool.util.mapping import Mapper, serial

STATUS_CODE = {name: np.int8(i) for i, name in enumerate(STATUSES)}
"""A sample's status as the driver stores it: its index in ``STATUSES`` (one byte)."""

WHITENING = {"reinforce_pp_baseline"}


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages over the whole input, and what per-step planning needs to know about them."""

    value: np.ndarray  # [n] float32 per sample: computed group-locally, or the input's column
    uniform: np.ndarray  # [G] bool per group: two or more rollouts, all rewards equal
    whiten_env: np.ndarray  # [E] bool: the env's estimator whitens over each step
    source: str  # the estimator, or "input column 'advantage'"

    @property
    def per_step_whitening(self) -> bool:
        return bool(self.whiten_env.any())


@dataclass(frozen=True)
class PlannedStep:
    """One optimizer step, planned: what `rolltool.packing.step` lays out and writes."""

    index: int
    members: np.ndarray  # [n] int64 sample indices trained in the step (plan positions index it)
    advantage: np.ndarray  # [n] float32 (whitened over the step where the estimator whitens)
    weight: np.ndarray  # [n] float64 loss weight of each trainable token (float32 from `Schedule`)
    plan: StepPlan
    record: StepRecord  # counts, denominators and plan summary; ``ranks`` are added on write
    uniform_dropped: np.ndarray  # [u] int64 samples of uniform groups skipped while filling it
    overlong_dropped: np.ndarray  # [o] int64 samples of its groups over the token budget
    count_trimmed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """[t] int64 samples left out so that --dp divides the step's samples (--equal-count-trim)"""
    cut: str = "groups"
    """Where its mini-batch's cuts lie (`rolltool.plan.minibatches`): groups, rollouts, samples, or
    empty (its batch had fewer samples than mini-batches)."""

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def order(self) -> np.ndarray:
        """Plan positions in row order: rank 0's micro-batches first, each in plan order."""
        parts = [m for mbs in self.plan.micro_batches for m in mbs]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class GroupIndex:
    """Each group's sample indices in input order, in one CSR array (no per-group objects):
    group g's samples are ``order[starts[g]:starts[g + 1]]``.

    >>> ix = GroupIndex.of(np.array([1, 0, 1, 0, 2]), 3)
    >>> ix[1].tolist(), ix.samples(np.array([2, 0])).tolist()
    ([0, 2], [4, 1, 3])
    """

    order: np.ndarray  # [n] int32 (int64 from 2**31 samples): samples sorted by group, stably
    starts: np.ndarray  # [G+1] int64 offsets into ``order``

    @staticmethod
    def of(group: np.ndarray, num_groups: int) -> GroupIndex:
        order = np.argsort(group, kind="stable").astype(_index_dtype(len(group)))
        starts = np.zeros(num_groups + 1, dtype=np.int64)
        np.cumsum(np.bincount(group, minlength=num_groups), out=starts[1:])
        return GroupIndex(order, starts)

    def __getitem__(self, g: int) -> np.ndarray:
        """[k] int64 samples of group g, in input order."""
        return self.order[self.starts[g] : self.starts[g + 1]].astype(np.int64)

    def samples(self, groups: np.ndarray) -> np.ndarray:
        """[k] int64 sample indices of `groups` (group codes), group after group."""
        groups = np.asarray(groups, dtype=np.int64)
        lo, hi = self.starts[groups], self.starts[groups + 1]
        counts = hi - lo
        first = np.cumsum(counts) - counts  # where each group's run starts in the output
        at = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - first, counts)
        return self.order[at].astype(np.int64)


def _index_dtype(n: int) -> type[np.signedinteger]:
    """int32 for indices below 2**31, else int64."""
    return np.int32 if n < 2**31 else np.int64


@dataclass(frozen=True)
class StepOutline:
    """What the driver keeps of a planned step beside `Schedule`'s flat arrays: its record,
    plan summary and micro-batch sizes; its samples are `Schedule.rows`' run for the step."""

    index: int
    record: StepRecord
    plan: StepPlan  # ``micro_batches`` empty: rebuilt from ``sizes`` by `Schedule.steps`
    sizes: np.ndarray  # [dp, M] int32 samples in each micro-batch
    uniform_dropped: np.ndarray  # as `PlannedStep`'s
    overlong_dropped: np.ndarray
    count_trimmed: np.ndarray
    cut: str

    @staticmethod
    def of(st: PlannedStep) -> StepOutline:
        sizes = np.array([[len(m) for m in mbs] for mbs in st.plan.micro_batches], np.int32)
        return StepOutline(
            index=st.index,
            record=st.record,
            plan=dataclasses.replace(st.plan, micro_batches=[]),
            sizes=sizes.reshape(st.plan.dp, st.plan.num_micro_batches),
            uniform_dropped=st.uniform_dropped,
            overlong_dropped=st.overlong_dropped,
            count_trimmed=st.count_trimmed,
            cut=st.cut,
        )


@dataclass(frozen=True)
class Schedule:
    """The whole run's plan, as flat arrays (no per-sample or per-group Python objects).

    Per-sample arrays have one entry per samples.parquet row: E x n for E ``epochs`` (row
    ``e * n + i`` is sample i in epoch e), so n without --epochs, indexed by sample_index.
    ``rows[row_starts[s]:row_starts[s + 1]]`` are kept step s's trained samples in the order
    its rows hold them (rank 0's micro-batches first; ``outlines[s].sizes`` cut them into
    micro-batches). `steps` gives each step as a `PlannedStep`, built on access; ``status``,
    ``step``, ``rank`` and ``micro_batch`` give the samples.parquet columns, also on access.
    17 bytes per row (see `nbytes`).
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
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the per-sample and per-row arrays (what grows with the input)."""
        flat = (self.status_code, self.step_code, self.advantage, self.weight, self.rows)
        return sum(a.nbytes for a in flat) + self.advantages.value.nbytes


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
) -> Schedule:
    """Plan the run (see the module docstring); `given`: the input's own advantages, if any;
    `mapper(fn, batches)` computes ``[fn(b) for b in batches]`` in order, here by default, or in
    forked processes (`rolltool.engine.local.plan_mapper`) or on Ray (`rolltool.engine.ray`):
    the same plan whichever. Each planned step is folded into the flat arrays as it arrives, so
    the driver never holds every step's arrays."""
    adv = group_advantages(ro, config, given)
    too_long = over_budget(ro, config)
    groups = _groups(ro, ~too_long, adv.uniform)
    assembly = assemble(groups, ro.env_names, config.steps)
    if not assembly.steps:
        raise RolltoolError(
            f"the input does not fill a single step of {config.steps.batch_size} "
            f"{config.steps.batch_unit}",
            hint="lower --batch-size, or pass --keep-last to keep a partial step",
        )
    in_group = GroupIndex.of(ro.group, ro.num_groups)
    plan = functools.partial(_plan_batch, ro, config, workload, adv, in_group, too_long, groups.env)
    results: Iterable[list[PlannedStep]] = mapper(plan, assembly.steps)
    flat = placement(ro, assembly, in_group, too_long, adv.value, config.steps.epochs)
    outlines = [flat.add(st) for st in _drain(results)]
    return Schedule(
        outlines=outlines,
        assembly=assembly,
        advantages=adv,
        epochs=config.steps.epochs,
        warnings=[
            *_thin_steps(outlines, config.dp),
            *_trim_warning(outlines, config.dp),
            *_cut_warning(outlines, config.steps.mini_batches),
            *filter(
                None, [step_size_warning([s.record for s in outlines], config.steps.batch_unit)]
            ),
        ],
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


def _plan_batch(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    adv: GroupAdvantages,
    in_group: GroupIndex,
    too_long: np.ndarray,
    group_env: np.ndarray,
    batch: Step,
) -> list[PlannedStep]:
    """A batch's optimizer steps: the batch itself, or epochs x mini-batches of it (numbered
    from ``batch.index x`` steps per batch, so batches can be planned in any order)."""
    if config.steps.per_batch == 1:
        return [plan_one_step(ro, config, workload, adv, batch, in_group, too_long, group_env)]
    first = batch.index * config.steps.per_batch
    return plan_batch(ro, config, workload, adv, batch, in_group, too_long, group_env, first)


def group_advantages(ro: Rollouts, config: PackConfig, given: np.ndarray | None) -> GroupAdvantages:
    """Group-local advantages over the whole input (so steps cannot change them), or the given
    ones; with given advantages only the group statistics (uniform groups) are computed."""
    if given is not None:
        stats = group_stats(ro.group, ro.rollout, ro.reward, ro.trainable)
        no_whitening = np.zeros(len(ro.env_names), dtype=bool)
        uniform = np.zeros(ro.num_groups, dtype=bool)
        uniform[: len(stats.uniform)] = stats.uniform
        return GroupAdvantages(given, uniform, no_whitening, "input column 'advantage'")
    a = config.advantages
    computed = compute_advantages(a, AdvantageInput.from_rollouts(ro))
    uniform = np.zeros(ro.num_groups, dtype=bool)
    uniform[ro.group] = computed.group_uniform
    whiten = np.array(
        [a.env_estimators.get(e, a.estimator) in WHITENING for e in ro.env_names], dtype=bool
    )
    return GroupAdvantages(computed.advantage, uniform, whiten, a.estimator)


def over_budget(ro: Rollouts, config: PackConfig) -> np.ndarray:
    """[n] bool: samples longer than the token cap; an error unless --overlong drop."""
    cap = config.token_cap
    occupied = config.split.padded(ro.length)
    too_long = occupied > cap if cap is not None else np.zeros(ro.num_samples, dtype=bool)
    if too_long.any() and config.overlong == "error":
        i = int(np.flatnonzero(too_long)[0])
        raise RolltoolError(
            f"{ro.label(i)} has {int(ro.length[i]):,} tokens"
            + (
                f" ({int(occupied[i]):,} padded for --cp {config.cp})"
                if occupied[i] > ro.length[i]
                else ""
            )
            + f", over the {cap:,}-token budget{_budget_terms(config)} "
            f"({int(too_long.sum())} sample(s) are)",
            hint=f"raise {'--micro-batch-tokens' if config.micro_batch_tokens else '--row-len'}"
            + (
                ", or split long samples over more GPUs (--cp, --sp)"
                if cap == config.group_tokens
                else ""
            )
            + ", or pass --overlong drop to leave such samples out",
        )
    return too_long


def _budget_terms(config: PackConfig) -> str:
    """How the group's cap came about, e.g. `` (--micro-batch-tokens 8,192 x --cp 4)``."""
    kind = config.split.kind
    if kind is None:
        return ""
    what = "--micro-batch-tokens" if config.micro_batch_tokens is not None else "--row-len"
    per_gpu = config.micro_batch_tokens if config.micro_batch_tokens is not None else config.row_len
    return f" ({what} {per_gpu:,} x --{kind} {config.split.size})"


def plan_one_step(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    adv: GroupAdvantages,
    step: Step,
    in_group: GroupIndex,
    too_long: np.ndarray,
    group_env: np.ndarray,
) -> PlannedStep:
    """A batch that is one optimizer step: its trained samples, their advantages and loss
    weights, its partition plan and the record that explains its cost and gradient scale."""
    all_members = in_group.samples(step.groups)
    kept = _equal_counts(~too_long[all_members], config, step.index)
    overlong = np.concatenate([all_members[too_long[all_members]], in_group.samples(step.skipped)])
    advantage = _step_advantages(ro, config, adv, all_members, kept)
    trimmed = all_members[~too_long[all_members] & ~kept]
    if len(trimmed):
        step = _trimmed(ro, step, all_members[kept], config.steps.batch_unit)
    return _planned(
        ro, config, workload, step, all_members[kept], advantage, overlong, trimmed,
        uniform=adv.uniform, dropped=in_group.samples(step.dropped), group_env=group_env,
        place=(step.index, 0, 0),
    )  # fmt: skip


def plan_batch(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    adv: GroupAdvantages,
    batch: Step,
    in_group: GroupIndex,
    too_long: np.ndarray,
    group_env: np.ndarray,
    first: int,
) -> list[PlannedStep]:
    """A batch as epochs x mini-batches optimizer steps, numbered from `first`
    (`rolltool.plan.minibatches`): advantages once over the batch (whitening over its samples), then
    per optimizer step its own loss weights, equal-count trim, plan and record. The batch's
    dropped and over-long samples are counted at each epoch's first mini-batch."""
    sc = config.steps
    all_members = in_group.samples(batch.groups)
    fits = ~too_long[all_members]
    advantage_of = np.zeros(ro.num_samples, dtype=np.float32)
    advantage_of[all_members[fits]] = _step_advantages(ro, config, adv, all_members, fits)
    overlong = np.concatenate([all_members[~fits], in_group.samples(batch.skipped)])
    dropped, none = in_group.samples(batch.dropped), np.zeros(0, np.int64)
    out: list[PlannedStep] = []
    for epoch in range(sc.epochs):
        groups = epoch_groups(batch.groups, batch.index, epoch, sc.seed)
        order = np.concatenate([_by_rollout(ro, in_group[g]) for g in groups])
        order = order[~too_long[order]]
        units = sample_units(sc.batch_unit, ro.rollout[order], ro.length[order])
        parts = split_epoch(order, ro.group[order], ro.rollout[order], units, sc.mini_batches,
                            epoch=epoch, where=f"batch {batch.index}")  # fmt: skip
        for mb in parts:
            head, index = mb.index == 0, first + len(out)
            kept = _equal_counts(np.ones(len(mb.samples), dtype=bool), config, index)
            members = mb.samples[kept]
            step = dataclasses.replace(
                batch,
                index=index,
                groups=_in_order(ro.group[members]),  # groups that train here (after a trim)
                dropped=batch.dropped if head else none,
                skipped=batch.skipped if head else none,
            )
            out.append(_planned(
                ro, config, workload, step, members, advantage_of[members],
                overlong if head else none, mb.samples[~kept], uniform=adv.uniform,
                dropped=dropped if head else none, group_env=group_env,
                place=(batch.index, epoch, mb.index), cut=mb.level,
            ))  # fmt: skip
    return _batch_actual(ro, out, batch, sc.batch_unit)


def _by_rollout(ro: Rollouts, samples: np.ndarray) -> np.ndarray:
    """A group's samples with each rollout's branches together (rollouts in first-seen order)."""
    return samples[np.argsort(ro.rollout[samples], kind="stable")]


def _in_order(codes: np.ndarray) -> np.ndarray:
    """The distinct values of `codes` in order of first appearance."""
    _, first = np.unique(codes, return_index=True)
    return codes[np.sort(first)].astype(np.int64)


def _batch_actual(
    ro: Rollouts, steps: list[PlannedStep], batch: Step, unit: str
) -> list[PlannedStep]:
    """Every step of a batch records the batch's actual size: what its first epoch trains
    (the assembled size unless --equal-count-trim left samples out)."""
    first = [st for st in steps if st.record.epoch == 0]
    if not any(len(st.count_trimmed) for st in first):
        return steps
    members = np.concatenate([st.members for st in first])
    actual = _trimmed(ro, batch, members, unit).actual
    return [
        dataclasses.replace(st, record=dataclasses.replace(st.record, actual=actual))
        for st in steps
    ]


def _planned(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    step: Step,
    members: np.ndarray,
    advantage: np.ndarray,
    overlong: np.ndarray,
    trimmed: np.ndarray,
    *,
    uniform: np.ndarray,
    dropped: np.ndarray,
    group_env: np.ndarray,
    place: tuple[int, int, int],
    cut: str = "groups",
) -> PlannedStep:
    """One optimizer step from its trained samples (`members`, with their `advantage`): loss
    weights, plan and record; `place` is its (batch, epoch, mini-batch)."""
    weight = sample_weights(config.loss_agg, ro.trainable[members], config.loss_scale_factor)
    occupied = config.split.padded(ro.length[members])
    plan = plan_step(
        occupied,
        dp=config.dp,
        max_tokens=config.group_tokens,
        micro_batch_size=config.micro_batch_size,
        workload=per_gpu(workload, config.split.size),
        equal_count=config.equal_count,
        align=config.align,
    )
    _check_rows_fit(plan, occupied, config, step.index)
    counts = step_counts(
        ro, step, members, overlong, advantage, weight, uniform, group_env,
        gpu_budget=config.micro_batch_tokens if config.split.size > 1 else None,
    )  # fmt: skip
    batch, epoch, mini_batch = place
    record = StepRecord(
        step=step.index,
        status=step.status,
        nominal=step.nominal,
        actual=step.actual,
        batch=batch,
        epoch=epoch,
        mini_batch=mini_batch,
        **counts.pop(None),
        envs={ro.env_names[e]: StepCounts(**c) for e, c in counts.items() if e is not None},
        denominators=Denominators(
            **step_denominators(config.loss_agg, ro.trainable[members], config.loss_scale_factor)
        ),
        plan=plan_record(plan),
    )
    return PlannedStep(
        index=step.index,
        members=members,
        advantage=advantage,
        weight=weight,
        plan=plan,
        record=record,
        uniform_dropped=dropped,
        overlong_dropped=overlong,
        count_trimmed=trimmed,
        cut=cut,
    )


def per_gpu(workload: Workload, gpus: int) -> Workload:
    """The cost one GPU of a group of `gpus` pays for a micro-batch: each SP or CP GPU does
    1/gpus of every sample's linear and attention work (Ulysses splits the heads, the zigzag CP
    split evens out causal attention), so the coefficients are divided by `gpus`."""
    if gpus == 1:
        return workload
    return dataclasses.replace(
        workload,
        a=workload.a / gpus,
        b=workload.b / gpus,
        c=workload.c / gpus,
        notes={**workload.notes, "per_gpu_of": gpus},
    )


def _equal_counts(kept: np.ndarray, config: PackConfig, step: int) -> np.ndarray:
    """[n] bool: the step's samples that train. With --equal-count the count must be a multiple
    of --dp: an error, or with --equal-count-trim the last ``count % dp`` kept samples (of the
    last groups taken) are left out.

    >>> from rolltool.plan.config import PackConfig
    >>> c = PackConfig(dp=3, equal_count_trim=True)
    >>> _equal_counts(np.array([True, True, False, True, True, True]), c, 0).astype(int).tolist()
    [1, 1, 0, 1, 0, 0]
    """
    extra = int(kept.sum()) % config.dp
    if not config.equal_count or not extra:
        return kept
    if not config.equal_count_trim:
        raise RolltoolError(
            f"--equal-count: step {step} trains {int(kept.sum())} samples, not a multiple of "
            f"--dp {config.dp}",
            hint="pass --equal-count-trim to leave the last few samples of such steps out "
            "(counted), or use --batch-unit samples with a --batch-size divisible by dp "
            "that whole groups fill (--exact makes sure)",
        )
    out = kept.copy()
    out[np.flatnonzero(kept)[-extra:]] = False
    return out


def _trimmed(ro: Rollouts, step: Step, members: np.ndarray, unit: str) -> Step:
    """``step`` as it trains after trimming: only groups with a trained sample left, and its
    size in ``unit`` over the trained samples (what samples.parquet gives)."""
    actual = {
        "rollouts": lambda: len(np.unique(ro.rollout[members])),
        "samples": lambda: len(members),
        "tokens": lambda: int(ro.length[members].sum()),
    }[unit]()
    groups = step.groups[np.isin(step.groups, ro.group[members])]
    return dataclasses.replace(step, groups=groups, actual=actual)


def _step_advantages(
    ro: Rollouts,
    config: PackConfig,
    adv: GroupAdvantages,
    all_members: np.ndarray,
    kept: np.ndarray,
) -> np.ndarray:
    """[n] float32 advantages of the step's trained samples (`all_members[kept]`).

    Whitening estimators whiten over the step's trained tokens, not the whole input. Over-long
    samples stay in their group's baseline (it was computed with them) but bring no tokens into
    the whitening: their trainable count is zeroed. A step with no trained sample of a whitening
    env has nothing to whiten.
    """
    members = all_members[kept]
    base = adv.value[members]
    whiten = adv.whiten_env[ro.env[members]]
    if not whiten.any():
        return base
    step_input = AdvantageInput.from_rollouts(ro).take(all_members).without_tokens(~kept)
    sub = compute_advantages(config.advantages, step_input)
    return np.where(whiten, sub.advantage[kept], base).astype(np.float32)


@dataclass(frozen=True)
class Placement:
    """`Schedule`'s flat arrays while the steps arrive (`placement`, then `add` per step in
    order, then `arrays`)."""

    n: int  # input samples
    status_code: np.ndarray
    step_code: np.ndarray
    advantage: np.ndarray
    weight: np.ndarray
    rows: np.ndarray  # [E*n] buffer; the first ``row_starts[-1]`` entries are filled
    row_starts: list[int]

    def add(self, st: PlannedStep) -> StepOutline:
        """Where `st`'s samples went (a later step's fate overrides an earlier one's, as they
        are added in step order); the outline the schedule keeps of it."""
        at = st.epoch * self.n  # this epoch's rows
        for fate, idx in (
            ("uniform_dropped", st.uniform_dropped),
            ("overlong_dropped", st.overlong_dropped),
            ("count_trimmed", st.count_trimmed),
        ):
            self.status_code[at + idx] = STATUS_CODE[fate]
            self.step_code[at + idx] = st.index
        order = st.order
        members = st.members[order]
        self.status_code[at + members] = STATUS_CODE["trained"]
        self.step_code[at + members] = st.index
        self.weight[at + members] = st.weight[order]
        self.advantage[at + members] = st.advantage[order]
        start = self.row_starts[-1]
        self.rows[start : start + len(members)] = members
        self.row_starts.append(start + len(members))
        return StepOutline.of(st)

    def arrays(self) -> dict[str, np.ndarray]:
        """`Schedule`'s array fields."""
        return {
            "status_code": self.status_code,
            "step_code": self.step_code,
            "advantage": self.advantage,
            "weight": self.weight,
            "rows": self.rows[: self.row_starts[-1]],
            "row_starts": np.array(self.row_starts, dtype=np.int64),
        }


def placement(
    ro: Rollouts,
    assembly: Assembly,
    in_group: GroupIndex,
    too_long: np.ndarray,
    advantage: np.ndarray,
    epochs: int = 1,
) -> Placement:
    """The flat arrays before any step is added: every sample's fate outside the kept steps
    (leftover, env_unweighted, or why it could never train), arrays of length epochs x n."""
    n = ro.num_samples
    code = np.full(n, STATUS_CODE["leftover"], dtype=np.int8)
    code[in_group.samples(assembly.unweighted)] = STATUS_CODE["env_unweighted"]
    # Outside kept steps, a sample that could never train says why rather than "leftover":
    # over-long anywhere, or in a uniform group the dropped partial step skipped.
    if assembly.partial_dropped is not None:
        code[in_group.samples(assembly.partial_dropped.dropped)] = STATUS_CODE["uniform_dropped"]
    code[too_long & (code == STATUS_CODE["leftover"])] = STATUS_CODE["overlong_dropped"]
    return Placement(
        n=n,
        status_code=np.tile(code, epochs),
        step_code=np.full(epochs * n, -1, dtype=np.int32),
        advantage=np.tile(advantage.astype(np.float32, copy=False), epochs),
        weight=np.zeros(epochs * n, dtype=np.float32),
        rows=np.empty(epochs * n, dtype=_index_dtype(n)),
        row_starts=[0],
    )


def _cut_warning(steps: list[StepOutline], mini_batches: int) -> list[str]:
    """Batches with fewer groups than --mini-batches: their groups span mini-batches."""
    split = sorted({st.record.batch or 0 for st in steps if st.cut != "groups"})
    if not split:
        return []
    shown = ", ".join(map(str, split[:8])) + (", ..." if len(split) > 8 else "")
    empty = sorted({st.record.batch or 0 for st in steps if st.cut == "empty"})
    return [
        f"{len(split)} batch(es) ({shown}) have fewer groups than --mini-batches {mini_batches}: "
        "their mini-batches are cut inside groups (at rollout boundaries where there are enough)"
        + (
            f"; {len(empty)} of them have fewer samples than that, and leave their last "
            "mini-batches empty (steps that train nothing)"
            if empty
            else ""
        )
    ]


def _thin_steps(steps: list[StepOutline], dp: int) -> list[str]:
    thin = [st.index for st in steps if int(st.sizes.sum()) < dp]
    if not thin:
        return []
    return [
        f"{len(thin)} step(s) (first: step {thin[0]}) have fewer samples than --dp {dp}: "
        "some ranks get only all-padding micro-batches"
    ]


def _trim_warning(steps: list[StepOutline], dp: int) -> list[str]:
    trimmed = [st for st in steps if len(st.count_trimmed)]
    if not trimmed:
        return []
    n = sum(len(st.count_trimmed) for st in trimmed)
    return [
        f"--equal-count-trim: {n} sample(s) in {len(trimmed)} step(s) (first: step "
        f"{trimmed[0].index}) left out so that --dp {dp} divides each step's samples "
        "(status count_trimmed in samples.parquet)"
    ]


def step_size_warning(steps: Sequence[StepRecord], unit: str) -> str | None:
    """A sentence when most steps (final partial step aside) hold less than half or more than
    twice their nominal size: whole groups do not fit that step size (e.g. ``--batch-unit
    tokens --batch-size 128``, every group a step of its own). None when the sizes are fine.

    >>> from types import SimpleNamespace as S
    >>> step_size_warning([S(status="oversize", actual=900, nominal=128)] * 3, "tokens")[:31]
    '3 of 3 steps hold more than twi'
    """
    sized = [(s.actual, s.nominal) for s in steps if s.status != "partial" and s.nominal]
    off = [a for a, n in sized if not 0.5 * n <= a <= 2 * n]
    if not sized or 2 * len(off) <= len(sized):
        return None
    nominal = sized[0][1]
    median = sorted(a for a, _ in sized)[len(sized) // 2]
    side = "more than twice" if median > nominal else "less than half"
    return (
        f"{len(off):,} of {len(sized):,} steps hold {side} --batch-size {nominal:,} {unit} "
        f"(median {median:,}): whole groups do not fit this step size; choose a --batch-size "
        "of several groups"
    )


def plan_record(plan: StepPlan) -> PlanRecord:
    """The manifest's summary of a step plan (settings and report, no index arrays)."""
    d = plan.to_dict()
    d["workload"] = None if plan.workload is None else plan.workload.record()
    d["short"] = tuple(tuple(rc) for rc in d["short"])
    d["samples_per_rank"] = tuple(d["samples_per_rank"])
    return PlanRecord(**d)


def _groups(ro: Rollouts, trained: np.ndarray, uniform: np.ndarray) -> Groups:
    G = ro.num_groups
    w = trained.astype(np.int64)
    r_has = np.zeros(int(ro.rollout.max()) + 1 if len(ro.rollout) else 0, dtype=np.int64)
    np.maximum.at(r_has, ro.rollout, w)
    r_group = np.zeros(len(r_has), dtype=np.int64)
    r_group[ro.rollout] = ro.group
    env = np.zeros(G, dtype=np.int32)
    env[ro.group] = ro.env
    completed = None
    if ro.finished_at is not None:
        completed = np.full(G, -np.inf)
        np.maximum.at(completed, ro.group, ro.finished_at)
    return Groups(
        env=env,
        rollouts=np.bincount(r_group, weights=r_has, minlength=G).astype(np.int64),
        samples=np.bincount(ro.group, weights=w, minlength=G).astype(np.int64),
        tokens=np.bincount(ro.group, weights=ro.length * w, minlength=G).astype(np.int64),
        uniform=uniform,
        completed_at=completed,
    )


def _moments(x: np.ndarray) -> tuple[float | None, float | None]:
    """Mean and unbiased std; None where undefined (no value; one value for the std)."""
    mean = float(x.mean()) if len(x) else None
    return mean, float(x.std(ddof=1)) if len(x) > 1 else None


def step_counts(
    ro: Rollouts,
    step: Step,
    members: np.ndarray,
    overlong: np.ndarray,
    adv: np.ndarray,
    weight: np.ndarray,
    uniform: np.ndarray,
    group_env: np.ndarray,
    *,
    gpu_budget: int | None = None,
) -> dict[int | None, dict[str, Any]]:
    """`StepCounts` fields of a step, overall (key None) and per env code present in it.

    `members`: sample indices trained in the step; `overlong`: its dropped over-long samples;
    `adv`/`weight`: per member, advantage and per-trainable-token loss weight; `uniform` and
    `group_env`: per group code; `gpu_budget`: the per-GPU budget when sp or cp split a
    group's rows (samples over it count in ``over_gpu_budget``).
    """

    def counts(sel: np.ndarray, env: int | None) -> dict[str, Any]:
        m = members[sel]
        groups_here = step.groups if env is None else step.groups[group_env[step.groups] == env]
        dropped = step.dropped if env is None else step.dropped[group_env[step.dropped] == env]
        ov = overlong if env is None else overlong[ro.env[overlong] == env]
        _, first = np.unique(ro.rollout[m], return_index=True)
        a_mean, a_std = _moments(adv[sel].astype(np.float64))
        r_mean = reward_moments(ro.reward[m][first])["reward_mean"]
        return {
            "groups": len(groups_here),
            "rollouts": len(first),
            "samples": len(m),
            "sampled_tokens": int(ro.length[m].sum()),
            "trainable_tokens": int(ro.trainable[m].sum()),
            "uniform_groups_kept": int(uniform[groups_here].sum()),
            "uniform_groups_dropped": len(dropped),
            "overlong_dropped": len(ov),
            "over_gpu_budget": int((ro.length[m] > gpu_budget).sum()) if gpu_budget else 0,
            "reward_mean": r_mean,
            "advantage_mean": a_mean,
            "advantage_std": a_std,
            "loss_weight_sum": float((weight[sel] * ro.trainable[m]).sum()),
        }

    env_ids = sorted(
        set(ro.env[members].tolist())
        | set(group_env[step.dropped].tolist())
        | set(ro.env[overlong].tolist())
    )
    out: dict[int | None, dict[str, Any]] = {None: counts(np.ones(len(members), bool), None)}
    out.update({e: counts(ro.env[members] == e, e) for e in env_ids})
    return out


def _check_rows_fit(plan: Any, lengths: np.ndarray, config: PackConfig, step: int) -> None:
    """With --micro-batch-size, nothing bounds a micro-batch's tokens: it must fit --row-len
    (x sp or cp: the group's row; `lengths` are padded for cp)."""
    row_len = config.group_row_len
    if config.micro_batch_size is None or row_len is None:
        return
    worst = max((int(lengths[m].sum()) for mbs in plan.micro_batches for m in mbs), default=0)
    if worst > row_len:
        raise RolltoolError(
            f"step {step}: a micro-batch of --micro-batch-size {config.micro_batch_size} samples "
            f"holds {worst:,} tokens, more than the row's {row_len:,}{_budget_terms(config)}",
            hint="raise --row-len, lower --micro-batch-size, or give --micro-batch-tokens instead",
        )
