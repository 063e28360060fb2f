"""`schedule` as a pure function: light columns + config in, every sample's fate out.

The CLI tests (test_pack_*.py) check the contract end to end; these check the plan's invariants
directly on many random inputs, without writing a file: every sample has exactly one status,
trained samples sit in exactly one (step, rank, micro-batch) that the step's plan agrees with,
loss weights sum to the recorded denominators, and the record's counts equal recounts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from pack_helpers import G, rollouts

from rolltool.errors import RolltoolError
from rolltool.format import STATUSES
from rolltool.input.resolve import resolve_inputs
from rolltool.plan.advantages import AdvantageConfig
from rolltool.plan.batches import StepConfig
from rolltool.plan.config import PackConfig
from rolltool.plan.group_advantages import group_advantages
from rolltool.plan.schedule import Schedule, schedule
from rolltool.plan.workload import make_workload
from rolltool.schema import Rollouts, scan


def _light(tmp: Path, groups: list[G], **kw: bool) -> Rollouts:
    path = tmp / "in.parquet"
    pq.write_table(rollouts(groups, **kw), path)
    return scan(resolve_inputs([str(path)]), {})


def _random_groups(rng: np.random.Generator) -> list[G]:
    out = []
    for _ in range(int(rng.integers(3, 12))):
        k = int(rng.integers(1, 6))
        rewards = rng.integers(0, 2, k).astype(float) if rng.random() < 0.7 else rng.random(k)
        env = ["math", "code"][int(rng.integers(0, 2))]
        out.append(G(env, rewards.tolist(), rng.integers(3, 300, k).tolist()))
    return out


def _check(ro: Rollouts, plan: Schedule, config: PackConfig) -> int:
    """Every invariant of a schedule; returns the number of trained samples checked."""
    n = ro.num_samples
    assert set(plan.status.tolist()) <= set(STATUSES) and len(plan.status) == n
    trained = plan.status == "trained"
    seen = np.zeros(n, dtype=np.int64)
    for st in plan.steps:
        assert st.record.step == st.index and len(st.plan.micro_batches) == config.dp
        assert len({len(mbs) for mbs in st.plan.micro_batches}) == 1  # same count per rank
        for r, mbs in enumerate(st.plan.micro_batches):
            for j, m in enumerate(mbs):
                idx = st.members[m]
                seen[idx] += 1
                assert np.all(plan.rank[idx] == r) and np.all(plan.micro_batch[idx] == j)
                assert np.all(plan.step[idx] == st.index)
                if config.micro_batch_tokens is not None:
                    assert ro.length[idx].sum() <= config.micro_batch_tokens
        members = st.members
        assert np.array_equal(plan.weight[members], st.weight)
        assert np.array_equal(plan.advantage[members], st.advantage)
        d = st.record.denominators
        assert d.trainable_tokens == ro.trainable[members].sum() == st.record.trainable_tokens
        assert d.trained_samples == int((ro.trainable[members] > 0).sum())
        assert (st.weight * ro.trainable[members]).sum() == pytest.approx(d.weight_sum)
        assert st.record.samples == len(members) == sum(e.samples for e in st.record.envs.values())
        assert st.record.sampled_tokens == ro.length[members].sum()
        assert np.all(plan.status[st.overlong_dropped] == "overlong_dropped")
        assert np.all(plan.status[st.uniform_dropped] == "uniform_dropped")
    assert np.array_equal(seen, trained.astype(np.int64))  # trained = placed exactly once
    assert np.all(plan.weight[~trained] == 0) and np.all(plan.rank[~trained] == -1)
    cap = config.token_cap
    if cap is not None:
        assert np.all(plan.status[ro.length > cap] == "overlong_dropped")
    return int(trained.sum())


@settings(max_examples=25, deadline=None)
@given(
    seed=hs.integers(0, 2**31),
    dp=hs.integers(1, 4),
    unit=hs.sampled_from(["rollouts", "samples", "tokens"]),
    uniform=hs.sampled_from(["keep", "drop"]),
    agg=hs.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_every_sample_has_one_fate_and_trained_ones_one_place(
    tmp_path_factory: pytest.TempPathFactory, seed: int, dp: int, unit: str, uniform: str, agg: str
) -> None:
    rng = np.random.default_rng(seed)
    ro = _light(tmp_path_factory.mktemp("s"), _random_groups(rng))
    size = {"rollouts": 6, "samples": 6, "tokens": 900}[unit]
    config = PackConfig(
        dp=dp,
        steps=StepConfig(batch_size=size, batch_unit=unit, uniform=uniform, keep_last=True),
        micro_batch_tokens=400,
        overlong="drop",
        loss_agg=agg,
    )
    try:
        plan = schedule(ro, config, make_workload("tokens"))
    except RolltoolError as e:  # everything dropped: the only allowed refusal here
        assert "does not fill a single step" in str(e)
        return
    assert plan.steps and _check(ro, plan, config) > 0


def test_per_step_whitening_differs_from_whole_input_and_keeps_group_order(tmp_path: Path) -> None:
    groups = [G("math", [0, 1, 1, 0], [20, 30, 40, 50]) for _ in range(4)]
    ro = _light(tmp_path, groups)
    config = PackConfig(
        dp=2,
        steps=StepConfig(batch_size=8),
        advantages=AdvantageConfig(estimator="reinforce_pp_baseline"),
        micro_batch_tokens=200,
    )
    plan = schedule(ro, config, make_workload("tokens"))
    assert plan.advantages.per_step_whitening and len(plan.steps) == 2
    for st in plan.steps:  # whitened over the step's trainable tokens: zero mean per step
        t = ro.trainable[st.members]
        assert abs(float((st.advantage * t).sum() / t.sum())) < 1e-5
    assert _check(ro, plan, config) == ro.num_samples


def test_given_advantages_compute_only_group_statistics(tmp_path: Path) -> None:
    ro = _light(tmp_path, [G("math", [1, 1], [10, 12]), G("math", [0, 1], [9, 9])], advantage=True)
    assert ro.advantage is not None
    # An estimator override for an env the input lacks is not even looked at.
    config = PackConfig(
        dp=1,
        steps=StepConfig(batch_size=4),
        advantages=AdvantageConfig(env_estimators={"nosuchenv": "rloo"}),
    )
    adv = group_advantages(ro, config, ro.advantage)
    assert adv.source == "input column 'advantage'" and not adv.per_step_whitening
    assert adv.uniform.tolist() == [True, False]
    assert np.array_equal(adv.value, ro.advantage)


def test_over_budget_is_an_error_naming_the_sample_unless_dropped(tmp_path: Path) -> None:
    ro = _light(tmp_path, [G("math", [0, 1], [10, 500]), G("math", [1, 0], [10, 10])])
    config = PackConfig(dp=1, steps=StepConfig(batch_size=2), micro_batch_tokens=100)
    with pytest.raises(RolltoolError, match=r"math/g000/r1/b0.*500 tokens, over the 100"):
        schedule(ro, config, make_workload("tokens"))
    drop = PackConfig(dp=1, steps=StepConfig(batch_size=2), micro_batch_tokens=100, overlong="drop")
    plan = schedule(ro, drop, make_workload("tokens"))
    assert plan.status.tolist().count("overlong_dropped") == 1
    assert plan.steps[0].record.overlong_dropped == 1
    assert _check(ro, plan, drop) == 3
