"""Advantages over the whole input: each sample's, group-local, before any step is planned.

An advantage comes only from the sample's own group (`rolltool.plan.advantages`), so it is
computed once over the whole input: which step a group lands in cannot change it. The input's own
``advantage`` column, when given, is taken as is (float32 per sample); only the group statistics
(which groups are uniform: two or more rollouts, all rewards equal) are computed then.
Estimators that whiten (``WHITENING``, such as ``reinforce_pp_baseline``) whiten over each
optimizer step instead, so `GroupAdvantages` records which envs do; the step's planning
(`rolltool.plan.step_plan`) whitens them.

Imports inside plan/ go one way (see `rolltool.plan.groups`): this module imports none of
groups, budget, step_records, step_plan, placement, step_warnings, schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rolltool.plan.advantages import AdvantageInput, group_stats, rollout_advantages
from rolltool.plan.config import PackConfig
from rolltool.schema import Rollouts

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


def group_advantages(ro: Rollouts, config: PackConfig, given: np.ndarray | None) -> GroupAdvantages:
    """Group-local advantages over the whole input (so steps cannot change them), or the given
    ones; with given advantages only the group statistics (uniform groups) are computed."""
    if given is not None:
        stats = group_stats(ro.group, ro.rollout, ro.reward, None)  # uniform groups only
        no_whitening = np.zeros(len(ro.env_names), dtype=bool)
        uniform = np.zeros(ro.num_groups, dtype=bool)
        uniform[: len(stats.uniform)] = stats.uniform
        return GroupAdvantages(given, uniform, no_whitening, "input column 'advantage'")
    a = config.advantages
    per = rollout_advantages(a, AdvantageInput.from_rollouts(ro))
    uniform = np.zeros(ro.num_groups, dtype=bool)
    uniform[: len(per.stats.uniform)] = per.stats.uniform
    whiten = np.array(
        [a.env_estimators.get(e, a.estimator) in WHITENING for e in ro.env_names], dtype=bool
    )
    # float32 per rollout, then per sample: the values of `compute_advantages`' column
    # (a cast per element commutes with the gather), without its per-sample float64 copy,
    # and with the per-rollout statistics let go first
    value = per.value
    del per  # the statistics go before the float32 copy is made
    per_rollout = value.astype(np.float32)
    del value
    return GroupAdvantages(per_rollout[ro.rollout], uniform, whiten, a.estimator)
