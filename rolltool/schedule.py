"""The run plan: from light columns to every step's samples, advantages, weights and layout.

Pure: no file is read or written here. `schedule` takes the validated light columns
(`Rollouts`), optional given advantages and the pack config, and decides

- each sample's advantage (group-local over the whole input; estimators that whiten, such as
  ``reinforce_pp_baseline``, whiten over each optimizer step);
- which samples are over the token budget (an error, or dropped from training and counted);
- the optimizer steps (`rolltool.steps.assemble`) and, per step, the loss weights
  (`rolltool.loss`), the partition plan (`rolltool.partition.plan_step`, its guarantees checked
  again here) and the metadata that explains the step's cost and gradient scale;
- where every sample went, or why it was not trained (``STATUSES``).

`rolltool.pack` then reads the tokens of one step at a time and writes them as this plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolltool.advantages import compute_advantages
from rolltool.config import PackConfig
from rolltool.errors import RolltoolError
from rolltool.loss import sample_weights, step_denominators
from rolltool.partition import StepPlan, plan_step
from rolltool.schema import Rollouts
from rolltool.steps import Assembly, Groups, Step, assemble
from rolltool.workload import Workload

WHITENING = {"reinforce_pp_baseline"}


@dataclass
class StepWork:
    """One planned step, between planning and writing."""

    index: int
    members: np.ndarray  # [n] sample indices trained in the step (plan positions index it)
    advantage: np.ndarray  # [n] float32
    weights: np.ndarray  # [n] float64 loss weight per trainable token
    plan: StepPlan
    meta: dict[str, Any]

    @property
    def order(self) -> np.ndarray:
        """Plan positions in row order: rank 0's micro-batches first, each in plan order."""
        parts = [m for mbs in self.plan.micro_batches for m in mbs]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


@dataclass
class Schedule:
    """The whole run's plan; arrays of length n are indexed by sample_index."""

    works: list[StepWork]  # the kept steps, in order
    assembly: Assembly  # how groups formed the steps (leftovers, dropped partial step)
    status: np.ndarray  # [n] object: one of STATUSES
    step: np.ndarray  # [n] int64 step a sample went to (or was dropped in), -1 if none
    rank: np.ndarray  # [n] int64, -1 if not trained
    micro_batch: np.ndarray  # [n] int64, -1 if not trained
    advantage: np.ndarray  # [n] float32 (per-step whitened where the estimator whitens)
    weight: np.ndarray  # [n] float64 loss weight of each trainable token, 0 if not trained
    advantage_source: str  # the estimator, or "input column 'advantage'"
    per_step_whitening: bool
    warnings: list[str] = field(default_factory=list)  # for people: what the plan had to do


def schedule(
    ro: Rollouts, config: PackConfig, workload: Workload, given: np.ndarray | None = None
) -> Schedule:
    """Plan the run (see the module docstring); `given`: the input's own advantages, if any."""
    n = ro.num_samples
    warnings: list[str] = []
    # Advantages over the whole input (group-local, so steps cannot change them) unless given.
    adv_source = "input column 'advantage'" if given is not None else config.advantages.estimator
    computed = compute_advantages(
        config.advantages,
        group=ro.group,
        rollout=ro.rollout,
        env=ro.env,
        env_names=ro.env_names,
        reward=ro.reward,
        trainable=ro.trainable,
    )
    uniform_sample = computed.group_uniform
    uniform = np.zeros(ro.num_groups, dtype=bool)
    uniform[ro.group] = uniform_sample
    whiten_envs = np.array(
        [
            config.advantages.env_estimators.get(e, config.advantages.estimator) in WHITENING
            for e in ro.env_names
        ]
    )
    per_step_whitening = given is None and bool(whiten_envs.any())
    advantage = given if given is not None else computed.advantage

    # Over-long samples.
    cap = config.token_cap
    too_long = ro.length > cap if cap is not None else np.zeros(n, dtype=bool)
    if too_long.any() and config.overlong == "error":
        i = int(np.flatnonzero(too_long)[0])
        raise RolltoolError(
            f"{ro.label(i)} has {int(ro.length[i]):,} tokens, over the {cap:,}-token budget "
            f"({int(too_long.sum())} sample(s) are)",
            hint="raise --micro-batch-tokens, or pass --overlong drop to leave such samples out",
        )
    trained_ok = ~too_long

    groups = _groups(ro, trained_ok, uniform)
    assembly = assemble(groups, ro.env_names, config.steps)
    if not assembly.steps:
        raise RolltoolError(
            f"the input does not fill a single step of {config.steps.batch_size} {config.steps.batch_unit}",
            hint="lower --batch-size, or pass --keep-last to keep a partial step",
        )
    status = np.full(n, "leftover", dtype=object)
    step_of = np.full(n, -1, dtype=np.int64)
    rank_of = np.full(n, -1, dtype=np.int64)
    mb_of = np.full(n, -1, dtype=np.int64)
    weight_of = np.zeros(n, dtype=np.float64)
    in_group = _by_group(ro)
    for g in assembly.unweighted:
        status[in_group[g]] = "env_unweighted"
    # Outside kept steps, a sample that could never train says why rather than "leftover":
    # over-long anywhere, or in a uniform group the dropped partial step skipped.
    if assembly.partial_dropped is not None:
        for g in assembly.partial_dropped.dropped:
            status[in_group[g]] = "uniform_dropped"
    status[too_long & (status == "leftover")] = "overlong_dropped"

    # Pass 1 (pure, light columns only): every step's samples, advantages, weights and plan.
    works: list[StepWork] = []
    for step in assembly.steps:
        all_members = (
            np.concatenate([in_group[g] for g in step.groups])
            if len(step.groups)
            else np.zeros(0, np.int64)
        )
        for g in step.dropped:
            status[in_group[g]] = "uniform_dropped"
            step_of[in_group[g]] = step.index
        members = all_members[trained_ok[all_members]]
        dropped_long = np.concatenate(
            [all_members[~trained_ok[all_members]], *[in_group[g] for g in step.skipped]]
        ).astype(np.int64)
        status[dropped_long] = "overlong_dropped"
        step_of[dropped_long] = step.index

        step_adv = advantage[members]
        if per_step_whitening and whiten_envs[ro.env[members]].any():
            # Whitening estimators whiten over the step's trained tokens, not the whole input.
            # Over-long samples stay in their group's baseline (it was computed with them) but
            # bring no tokens into the whitening: their trainable count is zeroed. A step with
            # no trained sample of a whitening env has nothing to whiten.
            kept = trained_ok[all_members]
            sub = compute_advantages(
                config.advantages,
                group=_dense(ro.group[all_members]),
                rollout=_dense(ro.rollout[all_members]),
                env=ro.env[all_members],
                env_names=ro.env_names,
                reward=ro.reward[all_members],
                trainable=np.where(kept, ro.trainable[all_members], 0),
            )
            step_adv = np.where(whiten_envs[ro.env[members]], sub.advantage[kept], step_adv).astype(
                np.float32
            )
            advantage[members] = step_adv
        weights = sample_weights(config.loss_agg, ro.trainable[members], config.loss_scale_factor)
        if config.equal_count and len(members) % config.dp:
            raise RolltoolError(
                f"--equal-count: step {step.index} trains {len(members)} samples, not a multiple of "
                f"--dp {config.dp}",
                hint="use --batch-unit samples with a --batch-size divisible by dp that whole groups "
                "fill (--exact makes sure), or drop --equal-count",
            )
        plan = plan_step(
            ro.length[members],
            dp=config.dp,
            max_tokens=config.micro_batch_tokens,
            micro_batch_size=config.micro_batch_size,
            workload=workload,
            equal_count=config.equal_count,
            align=config.align,
        )
        _check_plan(plan, len(members), ro.length[members], config)
        _check_rows_fit(plan, ro.length[members], config, step.index)
        for r, mbs in enumerate(plan.micro_batches):
            for j, m in enumerate(mbs):
                rank_of[members[m]] = r
                mb_of[members[m]] = j
        status[members] = "trained"
        step_of[members] = step.index
        weight_of[members] = weights
        meta = step_metadata(
            ro, step, members, dropped_long, step_adv, weights, uniform, groups.env
        )
        meta["denominators"] = step_denominators(
            config.loss_agg, ro.trainable[members], config.loss_scale_factor
        )
        meta["plan"] = _plan_summary(plan)
        works.append(StepWork(step.index, members, step_adv, weights, plan, meta))
    thin = [w.index for w in works if len(w.members) < config.dp]
    if thin:
        warnings.append(
            f"{len(thin)} step(s) (first: step {thin[0]}) have fewer samples than --dp {config.dp}: "
            "some ranks get only all-padding micro-batches"
        )

    return Schedule(
        works=works,
        assembly=assembly,
        status=status,
        step=step_of,
        rank=rank_of,
        micro_batch=mb_of,
        advantage=advantage,
        weight=weight_of,
        advantage_source=adv_source,
        per_step_whitening=per_step_whitening,
        warnings=warnings,
    )


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
    if not len(x):
        return None, None
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else 0.0


def step_metadata(
    ro: Rollouts,
    step: Step,
    members: np.ndarray,
    overlong: np.ndarray,
    adv: np.ndarray,
    weight: np.ndarray,
    uniform: np.ndarray,
    group_env: np.ndarray,
) -> dict[str, Any]:
    """Counts that explain a step's cost and gradient scale, overall and per env.

    `members`: sample indices trained in the step; `overlong`: its dropped over-long samples;
    `adv`/`weight`: per member, advantage and per-trainable-token loss weight; `uniform` and
    `group_env`: per group code.
    """

    def counts(sel: np.ndarray, env: int | None) -> dict[str, Any]:
        m = members[sel]
        groups_here = step.groups if env is None else step.groups[group_env[step.groups] == env]
        dropped = step.dropped if env is None else step.dropped[group_env[step.dropped] == env]
        ov = overlong if env is None else overlong[ro.env[overlong] == env]
        _, first = np.unique(ro.rollout[m], return_index=True)
        a_mean, a_std = _moments(adv[sel].astype(np.float64))
        r_mean, _ = _moments(ro.reward[m][first])
        return {
            "groups": len(groups_here),
            "rollouts": len(first),
            "samples": len(m),
            "sampled_tokens": int(ro.length[m].sum()),
            "trainable_tokens": int(ro.trainable[m].sum()),
            "uniform_groups_kept": int(uniform[groups_here].sum()),
            "uniform_groups_dropped": len(dropped),
            "overlong_dropped": len(ov),
            "reward_mean": r_mean,
            "advantage_mean": a_mean,
            "advantage_std": a_std,
            "loss_weight_sum": float((weight[sel] * ro.trainable[m]).sum()),
        }

    meta = {
        "step": step.index,
        "status": step.status,
        "nominal": step.nominal,
        "actual": step.actual,
    }
    meta.update(counts(np.ones(len(members), dtype=bool), None))
    env_ids = sorted(
        set(ro.env[members].tolist())
        | set(group_env[step.dropped].tolist())
        | set(ro.env[overlong].tolist())
    )
    meta["envs"] = {ro.env_names[e]: counts(ro.env[members] == e, e) for e in env_ids}
    return meta


def _dense(codes: np.ndarray) -> np.ndarray:
    return np.unique(codes, return_inverse=True)[1].astype(np.int64)


def _by_group(ro: Rollouts) -> list[np.ndarray]:
    """Sample indices of each group, in input order."""
    order = np.argsort(ro.group, kind="stable")
    bounds = np.searchsorted(ro.group[order], np.arange(ro.num_groups + 1))
    return [order[bounds[g] : bounds[g + 1]] for g in range(ro.num_groups)]


def _check_plan(plan: Any, n: int, lengths: np.ndarray, config: PackConfig) -> None:
    """The plan's guarantees, checked before anything is written (a failure is a bug)."""
    counts = {len(mbs) for mbs in plan.micro_batches}
    assert len(plan.micro_batches) == config.dp and len(counts) == 1, "unequal micro-batch counts"
    flat = np.concatenate([m for mbs in plan.micro_batches for m in mbs] or [np.zeros(0, np.int64)])
    assert len(flat) == n and np.array_equal(np.sort(flat), np.arange(n)), (
        "plan lost or repeated samples"
    )
    if config.micro_batch_tokens is not None:
        worst = max((int(lengths[m].sum()) for mbs in plan.micro_batches for m in mbs), default=0)
        assert worst <= config.micro_batch_tokens, f"micro-batch of {worst} tokens over the budget"


def _check_rows_fit(plan: Any, lengths: np.ndarray, config: PackConfig, step: int) -> None:
    """With --micro-batch-size, nothing bounds a micro-batch's tokens: it must fit --row-len."""
    if config.micro_batch_size is None or config.row_len is None:
        return
    worst = max((int(lengths[m].sum()) for mbs in plan.micro_batches for m in mbs), default=0)
    if worst > config.row_len:
        raise RolltoolError(
            f"step {step}: a micro-batch of --micro-batch-size {config.micro_batch_size} samples "
            f"holds {worst:,} tokens, more than --row-len {config.row_len:,}",
            hint="raise --row-len, lower --micro-batch-size, or give --micro-batch-tokens instead",
        )


def _plan_summary(plan: Any) -> dict[str, Any]:
    if hasattr(plan, "to_dict"):
        return plan.to_dict()
    return dict(getattr(plan, "report", {}))
