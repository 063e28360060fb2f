"""A step's record: its counts, overall and per env, and the summary of its partition plan.

What `rolltool.format.StepRecord` holds beside the step's place and size, so the manifest
explains each step's cost and gradient scale without the shards: groups, rollouts and samples
trained, sampled and trainable tokens, uniform groups kept and dropped, over-long samples, reward
and advantage moments, the loss weight sum (`step_counts`, one dict of `StepCounts` fields per
env code and overall), and the plan's settings and report without its index arrays
(`plan_record`).

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports none of
groups, group_advantages, budget, step_plan, placement, step_warnings, schedule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rolltool.format import HybridRecord, PlanRecord, SharedRecord
from rolltool.plan.advantages import reward_moments
from rolltool.plan.batches import Step
from rolltool.plan.partition import StepPlan
from rolltool.schema import Rollouts


def plan_record(
    plan: StepPlan, hybrid: HybridRecord | None = None, shared: SharedRecord | None = None
) -> PlanRecord:
    """The manifest's summary of a step plan (settings and report, no index arrays), with a
    ``--hybrid-cp`` step's per-GPU figures (`rolltool.plan.hybrid_step.hybrid_record`) or a
    ``--share-prefix`` step's sharing (`rolltool.plan.prefix_step`)."""
    d = plan.to_dict(workload=False)  # recorded as a record, not as JSON
    d["workload"] = None if plan.workload is None else plan.workload.record()
    d["short"] = tuple(tuple(rc) for rc in d["short"])
    d["samples_per_rank"] = tuple(d["samples_per_rank"])
    return PlanRecord(**d, hybrid=hybrid, shared=shared)


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
    if len(env_ids) == 1 and (group_env[step.groups] == env_ids[0]).all():
        out[env_ids[0]] = dict(out[None])  # one env holds every sample and group: the same counts
        return out
    out.update({e: counts(ro.env[members] == e, e) for e in env_ids})
    return out
