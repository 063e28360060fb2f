"""Planning one batch: its optimizer steps, each with samples, advantages, weights and layout.

A batch (`rolltool.plan.batches.Step`) is one optimizer step, or with --mini-batches/--epochs
epochs x mini-batches of them (`rolltool.plan.minibatches`). Each step, as a `PlannedStep`:

- its trained samples (int64 sample indices), less its over-budget ones and, with
  --equal-count-trim, the last few that --dp does not divide (``count_trimmed``);
- their advantages: the whole input's (`rolltool.plan.group_advantages`), or whitened over the
  step's trained tokens where the env's estimator whitens;
- their loss weights per trainable token (`rolltool.plan.loss`, float64);
- its partition plan (`rolltool.plan.partition.plan_step`: ranks x micro-batches under the token
  cap, per GPU of an --sp/--cp group, equal micro-batch counts where the plan is built; with
  --hybrid-cp `rolltool.plan.hybrid_step`: a CP degree per sample, every GPU balanced);
- its record (`rolltool.plan.step_records`).

A batch's plan depends only on the light columns, the config and the batch, so `batch_steps` is
what the run plan maps over batches, here, in forked processes or as Ray tasks, in any order.

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports groups,
group_advantages, budget, hybrid_step and step_records; placement, step_warnings and schedule import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.format import Denominators, StepCounts, StepRecord
from rolltool.plan.advantages import AdvantageInput, compute_advantages
from rolltool.plan.batches import Step
from rolltool.plan.budget import budget_terms
from rolltool.plan.config import PackConfig
from rolltool.plan.group_advantages import GroupAdvantages
from rolltool.plan.groups import GroupIndex
from rolltool.plan.hybrid_step import HybridLayout, hybrid_record, hybrid_step
from rolltool.plan.loss import sample_weights, step_denominators
from rolltool.plan.minibatches import epoch_groups, sample_units, split_epoch
from rolltool.plan.partition import StepPlan, plan_step
from rolltool.plan.prefix_step import GroupForest, SharedPlan, plan_shared_step
from rolltool.plan.step_records import plan_record, step_counts
from rolltool.plan.workload import Workload
from rolltool.schema import Rollouts


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
    hybrid: HybridLayout | None = None
    """``--hybrid-cp``: each slot's sub-groups and each sample's first GPU (row order), what
    its rows are laid out by (`rolltool.plan.hybrid_step`); None otherwise."""
    shared: SharedPlan | None = None
    """``--share-prefix``: each micro-batch's stored segments (`rolltool.plan.prefix_step`),
    what its rows are laid out by; None otherwise."""

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def order(self) -> np.ndarray:
        """Plan positions in row order: rank 0's micro-batches first, each in plan order."""
        parts = [m for mbs in self.plan.micro_batches for m in mbs]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def batch_steps(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    adv: GroupAdvantages,
    in_group: GroupIndex,
    too_long: np.ndarray,
    group_env: np.ndarray,
    batch: Step,
    *,
    prefixes: Mapping[int, GroupForest] | None = None,
) -> list[PlannedStep]:
    """A batch's optimizer steps: the batch itself, or epochs x mini-batches of it (numbered
    from ``batch.index x`` steps per batch, so batches can be planned in any order).
    `prefixes`: ``--share-prefix``'s groups with prefixes (`rolltool.fetch.prefixes`)."""
    found = prefixes if prefixes is not None else {}
    if config.steps.per_batch == 1:
        return [plan_one_step(ro, config, workload, adv, batch, in_group, too_long, group_env,
                              prefixes=found)]  # fmt: skip
    first = batch.index * config.steps.per_batch
    return plan_batch(ro, config, workload, adv, batch, in_group, too_long, group_env, first,
                      prefixes=found)  # fmt: skip


def plan_one_step(
    ro: Rollouts,
    config: PackConfig,
    workload: Workload,
    adv: GroupAdvantages,
    step: Step,
    in_group: GroupIndex,
    too_long: np.ndarray,
    group_env: np.ndarray,
    *,
    prefixes: Mapping[int, GroupForest] | None = None,
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
        place=(step.index, 0, 0), prefixes=prefixes,
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
    *,
    prefixes: Mapping[int, GroupForest] | None = None,
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
                place=(batch.index, epoch, mb.index), cut=mb.level, prefixes=prefixes,
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
    prefixes: Mapping[int, GroupForest] | None = None,
) -> PlannedStep:
    """One optimizer step from its trained samples (`members`, with their `advantage`): loss
    weights, plan and record; `place` is its (batch, epoch, mini-batch)."""
    weight = sample_weights(config.loss_agg, ro.trainable[members], config.loss_scale_factor)
    length = ro.length[members].astype(np.int64)  # int32 in Rollouts: L² and sums in int64
    layout, per_gpus, shared = None, None, None
    if config.share_prefix:  # prefix trees placed whole (`rolltool.plan.prefix_step`)
        assert config.micro_batch_tokens is not None and config.share_min is not None
        plan, shared = plan_shared_step(
            members, length, ro.group[members].astype(np.int64), advantage, ro.env[members],
            ro.env_names, prefixes or {}, dp=config.dp, max_tokens=config.micro_batch_tokens,
            workload=workload, share_min=config.share_min,
        )  # fmt: skip
    elif config.hybrid_cp:  # a CP degree per sample (`rolltool.plan.hybrid_step`)
        assert config.micro_batch_tokens is not None
        plan, layout, hp = hybrid_step(
            length, dp=config.dp, cp=config.cp, max_tokens=config.micro_batch_tokens,
            workload=workload, ring=config.ring(workload),
        )  # fmt: skip
        per_gpus = hybrid_record(hp, length)
    else:
        occupied = config.split.padded(length)
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
        plan=plan_record(plan, per_gpus, None if shared is None else shared.record),
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
        hybrid=layout,
        shared=shared,
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
            f"holds {worst:,} tokens, more than the row's {row_len:,}{budget_terms(config)}",
            hint="raise --row-len, lower --micro-batch-size, or give --micro-batch-tokens instead",
        )
