"""Group advantages: hand-computed cases, a slow reference vs the vectorized code, output columns.

The reference below is written from the verl 0.9.1 formulas in issue 2 with plain Python loops
over dicts; it never calls rolltool code.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rolltool.errors import RolltoolError
from rolltool.jobs.advantages import run_advantages
from rolltool.plan.advantages import ESTIMATORS, AdvantageConfig, AdvantageInput, compute_advantages

EPS = 1e-6
# A sample: (group_id, rollout_id, env, reward, trainable tokens).
Row = tuple[Any, Any, str, float, int]


def _codes(keys: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """Dense codes in order of first appearance."""
    seen: dict[Any, int] = {}
    codes = [seen.setdefault(k, len(seen)) for k in keys]
    return np.array(codes, dtype=np.int64), list(seen)


def compute(
    rows: list[Row],
    estimator: str = "grpo",
    env_estimators: dict[str, str] | None = None,
    std_eps: float = EPS,
) -> Any:
    config = AdvantageConfig(
        estimator=estimator, env_estimators=env_estimators or {}, std_eps=std_eps
    )
    return compute_advantages(config, _input(rows))


def _input(rows: list[Row]) -> AdvantageInput:
    group, _ = _codes([r[0] for r in rows])
    rollout, _ = _codes([(r[0], r[1]) for r in rows])
    env, env_names = _codes([r[2] for r in rows])
    return AdvantageInput(
        group=group,
        rollout=rollout,
        env=env.astype(np.int32),
        env_names=env_names,
        reward=np.array([r[3] for r in rows], dtype=np.float64),
        trainable=np.array([r[4] for r in rows], dtype=np.int64),
    )


# --------------------------------------------------------------------------------------------
# The slow, obvious reference.


def reference(
    rows: list[Row], estimator: str, env_estimators: dict[str, str], eps: float
) -> dict[str, list]:
    """Per-row advantage and group columns, from the issue's formulas, with loops over dicts.

    Raises ValueError where verl's masked_whiten does (fewer than 2 trainable tokens).
    """
    rollouts: dict[tuple, dict] = {}
    for g, r, env, reward, trainable in rows:
        ro = rollouts.setdefault((g, r), {"group": g, "env": env, "reward": reward, "len": 0})
        ro["len"] += trainable  # a rollout's trainable tokens: all its branches
    groups: dict[Any, list[tuple]] = defaultdict(list)
    for key, ro in rollouts.items():
        groups[ro["group"]].append(key)

    stats: dict[Any, dict] = {}
    adv: dict[tuple, float] = {}
    for g, keys in groups.items():
        rs = [rollouts[k]["reward"] for k in keys]
        n = len(rs)
        # An all-equal group's mean is the reward itself (sum/n can be an ulp off, and with
        # eps 0 grpo would then divide rounding noise by rounding noise): rolltool's rule.
        mean = rs[0] if min(rs) == max(rs) else sum(rs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / (n - 1)) if n > 1 else 0.0
        stats[g] = {
            "size": n,
            "mean": mean,
            "std": std,
            "uniform": n >= 2 and min(rs) == max(rs),
        }
        name = env_estimators.get(rollouts[keys[0]]["env"], estimator)
        lengths = [rollouts[k]["len"] for k in keys]
        for k in keys:
            adv[k] = _reference_one(name, rollouts[k]["reward"], rs, lengths, mean, std, eps)

    whitened = _reference_whitening(rows, adv, estimator, env_estimators)
    out: dict[str, list] = defaultdict(list)
    for g, r, *_ in rows:
        out["advantage"].append(whitened.get((g, r), adv[(g, r)]))
        for name in ("size", "mean", "std", "uniform"):
            out[name].append(stats[g][name])
    return out


def _reference_one(
    name: str, r: float, rs: list[float], lengths: list[int], mean: float, std: float, eps: float
) -> float:
    """One rollout's advantage (before whitening): reward r in a group of rewards rs and
    trainable lengths, with the group's mean and unbiased std."""
    n = len(rs)
    if name == "grpo":
        if n == 1:
            return (r - 0.0) / (1.0 + eps)
        # A uniform group with eps 0: verl gives 0/0 = nan, rolltool 0.
        return (r - mean) / (std + eps) if std + eps > 0 else 0.0
    if name in ("dr_grpo", "reinforce_pp_baseline"):  # the latter is whitened afterwards
        return r - mean if n > 1 else r
    if name == "rloo":
        return n / (n - 1) * (r - mean) if n > 1 else r
    if name == "opo":
        if n == 1:
            return r
        num = sum(ln * x for ln, x in zip(lengths, rs, strict=True))
        den = sum(lengths)
        # verl gives 0/0 = nan here; rolltool keeps b = 0 (no token is trained).
        return r - (num / den if den else 0.0)
    raise AssertionError(name)


def _reference_whitening(
    rows: list[Row], adv: dict[tuple, float], estimator: str, env_estimators: dict[str, str]
) -> dict[tuple, float]:
    """Token-level whitening over every trainable token of the samples whose env uses it."""
    whitens = [env_estimators.get(row[2], estimator) == "reinforce_pp_baseline" for row in rows]
    if not any(whitens):
        return {}
    tokens = []
    for (g, r, _, _, trainable), w in zip(rows, whitens, strict=True):
        if w:
            tokens.extend([adv[(g, r)]] * trainable)
    if len(tokens) < 2:
        raise ValueError("masked_whiten needs at least 2 tokens")
    m = math.fsum(tokens) / len(tokens)
    var = math.fsum((t - m) ** 2 for t in tokens) / (len(tokens) - 1)
    return {
        (g, r): (adv[(g, r)] - m) / math.sqrt(var + 1e-8)
        for (g, r, *_), w in zip(rows, whitens, strict=True)
        if w
    }


def assert_matches_reference(
    rows: list[Row], estimator: str, env_estimators: dict[str, str], eps: float = EPS
) -> None:
    try:
        ref = reference(rows, estimator, env_estimators, eps)
    except ValueError:
        with pytest.raises(RolltoolError, match="at least 2"):
            compute(rows, estimator, env_estimators, eps)
        return
    got = compute(rows, estimator, env_estimators, eps)
    assert got.advantage.dtype == np.float32
    np.testing.assert_allclose(got.advantage, ref["advantage"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.group_size, ref["size"])
    np.testing.assert_allclose(got.group_reward_mean, ref["mean"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.group_reward_std, ref["std"], rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(got.group_uniform, ref["uniform"])


def whitened(a: list[float], tokens: list[int]) -> np.ndarray:
    """(a - m) / sqrt(v + 1e-8), m and v the mean and unbiased variance of a repeated per token."""
    values = np.repeat(np.asarray(a, dtype=np.float64), tokens)
    return (np.asarray(a) - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8)


def rows_of(table: pa.Table) -> list[Row]:
    """A rollout-schema table as reference rows (trainable tokens counted from loss_mask)."""
    columns = [table[c].to_pylist() for c in ("group_id", "rollout_id", "env", "reward")]
    trainable = [sum(m) for m in table["loss_mask"].to_pylist()]
    return list(zip(*columns, trainable, strict=True))


# --------------------------------------------------------------------------------------------
# Hand-computed cases. One group of three rollouts, rewards 1, 2, 3: mean 2, unbiased std 1,
# trainable tokens 1, 1, 2.

THREE = [("g", 0, "e", 1.0, 1), ("g", 1, "e", 2.0, 1), ("g", 2, "e", 3.0, 2)]


def test_grpo_by_hand() -> None:
    got = compute(THREE, "grpo")
    np.testing.assert_allclose(got.advantage, [-1 / (1 + EPS), 0.0, 1 / (1 + EPS)], rtol=1e-7)
    assert got.group_size.tolist() == [3, 3, 3]
    np.testing.assert_allclose(got.group_reward_mean, [2.0] * 3)
    np.testing.assert_allclose(got.group_reward_std, [1.0] * 3)
    assert not got.group_uniform.any()


def test_grpo_std_eps_zero_keeps_uniform_groups_at_zero() -> None:
    rows = [("u", 0, "e", 0.3, 1), ("u", 1, "e", 0.3, 1), *THREE]
    got = compute(rows, "grpo", std_eps=0.0)
    np.testing.assert_allclose(got.advantage, [0.0, 0.0, -1.0, 0.0, 1.0])
    assert np.isfinite(got.advantage).all()


def test_grpo_std_eps() -> None:
    got = compute(THREE, "grpo", std_eps=0.5)
    np.testing.assert_allclose(got.advantage, [-1 / 1.5, 0.0, 1 / 1.5], rtol=1e-7)
    single = compute([("s", 0, "e", 0.7, 3)], "grpo", std_eps=0.25)
    np.testing.assert_allclose(single.advantage, [0.7 / 1.25], rtol=1e-7)


def test_dr_grpo_by_hand() -> None:
    np.testing.assert_allclose(compute(THREE, "dr_grpo").advantage, [-1.0, 0.0, 1.0])


def test_rloo_by_hand() -> None:
    # n/(n-1) * (r - mean) = 1.5 * (r - 2): the mean of the *other* rollouts as the baseline.
    np.testing.assert_allclose(compute(THREE, "rloo").advantage, [-1.5, 0.0, 1.5])


def test_opo_by_hand() -> None:
    # b = (1*1 + 1*2 + 2*3) / (1 + 1 + 2) = 9/4.
    np.testing.assert_allclose(compute(THREE, "opo").advantage, [-1.25, -0.25, 0.75])


def test_reinforce_pp_baseline_by_hand() -> None:
    # a = r - mean = -1, 0, 1; tokens: -1, 0, 1, 1 -> m = 1/4,
    # var = ((-1.25)^2 + (-0.25)^2 + 2 * 0.75^2) / 3 = 2.75 / 3.
    got = compute(THREE, "reinforce_pp_baseline")
    want = (np.array([-1.0, 0.0, 1.0]) - 0.25) / np.sqrt(2.75 / 3 + 1e-8)
    np.testing.assert_allclose(got.advantage, want, rtol=1e-6)
    # Whitened over tokens: the token-weighted advantages have mean 0 and unbiased variance ~1.
    tokens = np.repeat(got.advantage.astype(np.float64), [1, 1, 2])
    assert abs(tokens.mean()) < 1e-6
    assert tokens.var(ddof=1) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize(
    ("estimator", "want"),
    [
        ("grpo", 0.7 / (1 + EPS)),  # mean 0, std 1
        ("dr_grpo", 0.7),
        ("rloo", 0.7),
        ("opo", 0.7),  # baseline 0
    ],
)
def test_singleton_group_gets_its_raw_reward(estimator: str, want: float) -> None:
    got = compute([("s", 0, "e", 0.7, 5)], estimator)
    np.testing.assert_allclose(got.advantage, [want], rtol=1e-7)
    assert got.group_size.tolist() == [1]
    assert got.group_reward_std.tolist() == [0.0]
    assert got.group_uniform.tolist() == [False]  # a singleton group is never uniform


def test_singleton_groups_under_reinforce_pp_baseline() -> None:
    # Singletons keep a = r (mean 0), then are whitened with everyone else.
    rows = [("s1", 0, "e", 1.0, 1), ("s2", 0, "e", 3.0, 1)]
    got = compute(rows, "reinforce_pp_baseline")
    # tokens 1, 3: m = 2, var = 2 -> (1 - 2)/sqrt(2), (3 - 2)/sqrt(2)
    np.testing.assert_allclose(got.advantage, [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "opo"])
@pytest.mark.parametrize("reward", [0.0, 1.0, 0.1, 0.7, -2.3])
def test_uniform_group_has_exactly_zero_advantage(estimator: str, reward: float) -> None:
    rows = [("u", i, "e", reward, 3 + i) for i in range(3)] + [("x", 0, "e", 5.0, 1)]
    got = compute(rows, estimator)
    assert got.group_uniform.tolist() == [True, True, True, False]
    assert got.advantage[:3].tolist() == [0.0, 0.0, 0.0]
    assert got.group_reward_std[:3].tolist() == [0.0, 0.0, 0.0]
    assert got.group_reward_mean[:3].tolist() == [reward] * 3


def test_uniform_group_under_reinforce_pp_baseline_is_shifted_by_the_whitening() -> None:
    rows = [
        ("u", 0, "e", 1.0, 2),
        ("u", 1, "e", 1.0, 2),
        ("g", 0, "e", 0.0, 1),
        ("g", 1, "e", 1.0, 3),
    ]
    got = compute(rows, "reinforce_pp_baseline")
    # a = 0, 0, -0.5, 0.5 on 2, 2, 1, 3 tokens -> m = 1/8
    want = whitened([0, 0, -0.5, 0.5], [2, 2, 1, 3])
    np.testing.assert_allclose(got.advantage, want, rtol=1e-6)
    assert got.group_uniform.tolist() == [True, True, False, False]


def test_branches_count_once_per_rollout() -> None:
    # Rollout a has 3 branches (trainable 2, 3, 5 = 10), rollout b one (trainable 30).
    rows = [
        ("g", "a", "e", 1.0, 2),
        ("g", "a", "e", 1.0, 3),
        ("g", "b", "e", 0.0, 30),
        ("g", "a", "e", 1.0, 5),  # branches need not be adjacent
    ]
    grpo = compute(rows, "grpo")
    # two rollouts: mean 0.5 (not 0.75), std sqrt(0.5)
    std = math.sqrt(0.5)
    np.testing.assert_allclose(
        grpo.advantage, np.array([0.5, 0.5, -0.5, 0.5]) / (std + EPS), rtol=1e-6
    )
    assert grpo.group_size.tolist() == [2] * 4
    np.testing.assert_allclose(grpo.group_reward_mean, [0.5] * 4)
    np.testing.assert_allclose(grpo.group_reward_std, [std] * 4)
    # rloo: n = 2 rollouts -> 2 * (r - 0.5)
    np.testing.assert_allclose(compute(rows, "rloo").advantage, [1.0, 1.0, -1.0, 1.0])
    # opo: len(a) = 10 over its branches, len(b) = 30 -> b = 10/40
    np.testing.assert_allclose(compute(rows, "opo").advantage, [0.75, 0.75, -0.25, 0.75])
    # reinforce_pp_baseline: a = 0.5 on 10 tokens, -0.5 on 30 tokens.
    want = whitened([0.5, -0.5], [10, 30])[[0, 0, 1, 0]]
    np.testing.assert_allclose(compute(rows, "reinforce_pp_baseline").advantage, want, rtol=1e-6)


def test_rollout_ids_restart_in_every_group() -> None:
    # rollout 0 of group g1 and rollout 0 of group g2 are different rollouts.
    rows = [("g1", 0, "e", 1.0, 1), ("g1", 1, "e", 0.0, 1), ("g2", 0, "e", 0.0, 1)]
    got = compute(rows, "dr_grpo")
    np.testing.assert_allclose(got.advantage, [0.5, -0.5, 0.0])
    assert got.group_size.tolist() == [2, 2, 1]


def test_groups_only_see_their_own_rewards() -> None:
    rows = [(g, i, "e", float(g * 10 + i), 1) for g in range(3) for i in range(4)]
    got = compute(rows, "dr_grpo")
    np.testing.assert_allclose(got.advantage, [-1.5, -0.5, 0.5, 1.5] * 3)


def test_mixed_envs_with_overrides() -> None:
    rows = [
        ("m", 0, "math", 1.0, 1),
        ("m", 1, "math", 0.0, 1),
        ("c", 0, "code", 0.2, 1),
        ("c", 1, "code", 0.8, 1),
        ("c", 2, "code", 0.5, 1),
        ("a", 0, "agent", 1.0, 4),
        ("a", 1, "agent", 0.0, 2),
    ]
    got = compute(rows, "grpo", {"code": "rloo", "agent": "reinforce_pp_baseline"})
    std = math.sqrt(0.5)
    np.testing.assert_allclose(got.advantage[:2], [0.5 / (std + EPS), -0.5 / (std + EPS)])
    np.testing.assert_allclose(got.advantage[2:5], [1.5 * -0.3, 1.5 * 0.3, 0.0], atol=1e-7)
    # agent is whitened over its own tokens only: 0.5 x4, -0.5 x2
    np.testing.assert_allclose(got.advantage[5:], whitened([0.5, -0.5], [4, 2]), rtol=1e-6)
    assert got.estimator.tolist() == ["grpo"] * 2 + ["rloo"] * 3 + ["reinforce_pp_baseline"] * 2


def test_env_estimator_for_an_env_not_in_the_input_is_an_error() -> None:
    with pytest.raises(RolltoolError, match="nope"):
        compute(THREE, "grpo", {"nope": "rloo"})


def test_unknown_estimator_and_bad_eps_are_rejected() -> None:
    with pytest.raises(RolltoolError, match="unknown estimator"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(RolltoolError, match="unknown estimator"):
        AdvantageConfig(env_estimators={"math": "ppo"})
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(RolltoolError, match="std-eps"):
            AdvantageConfig(std_eps=eps)


def test_reinforce_pp_baseline_needs_two_trainable_tokens() -> None:
    with pytest.raises(RolltoolError, match="at least 2"):
        compute([("g", 0, "e", 1.0, 1), ("g", 1, "e", 0.0, 0)], "reinforce_pp_baseline")


def test_every_estimator_has_a_hand_case() -> None:
    # Guards this file against a new estimator added without tests.
    assert sorted(ESTIMATORS) == ["dr_grpo", "grpo", "opo", "reinforce_pp_baseline", "rloo"]


# --------------------------------------------------------------------------------------------
# The reference vs the vectorized code on many random datasets.

REWARDS = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, -1.0]),  # ties are common in real rewards
    st.integers(-40, 40).map(lambda k: k / 8),
    st.floats(-100, 100, allow_nan=False, allow_infinity=False, allow_subnormal=False),
)
ENVS = ["math", "code", "agent"]


@st.composite
def datasets(draw: st.DrawFn) -> list[Row]:
    """Random groups of random sizes, some rollouts with several branches, rows shuffled."""
    rows: list[Row] = []
    n_groups = draw(st.integers(1, 6))
    for g in range(n_groups):
        env = draw(st.sampled_from(ENVS))
        for r in range(draw(st.integers(1, 5))):
            reward = draw(REWARDS)
            for _ in range(draw(st.integers(1, 3))):  # branches share the rollout's reward
                rows.append((f"g{g}", r, env, reward, draw(st.integers(0, 6))))
    return draw(st.permutations(rows))


ESTIMATOR_NAMES = st.sampled_from(sorted(ESTIMATORS))


@settings(max_examples=300, deadline=None)
@example(  # a uniform group whose sum/n is an ulp off its reward
    rows=[("g0", r, "math", 85.84412072601427, 0) for r in (0, 1, 1, 2)],
    estimator="grpo",
    overrides={},
    eps=0.0,
)
@given(
    rows=datasets(),
    estimator=ESTIMATOR_NAMES,
    overrides=st.dictionaries(st.sampled_from(ENVS), ESTIMATOR_NAMES, max_size=2),
    eps=st.sampled_from([1e-6, 0.0, 0.1]),
)
def test_vectorized_matches_reference(
    rows: list[Row], estimator: str, overrides: dict[str, str], eps: float
) -> None:
    present = {r[2] for r in rows}
    overrides = {k: v for k, v in overrides.items() if k in present}
    assert_matches_reference(rows, estimator, overrides, eps)


def _table(rows: list[Row], id_type: str) -> pa.Table:
    """A rollout-schema table whose samples have the given trainable counts."""
    ids, masks = [], []
    for i, (*_, trainable) in enumerate(rows):
        prompt = 1 + i % 3
        ids.append(list(range(prompt + trainable)))
        masks.append([0] * prompt + [1] * trainable)
    conv = (lambda x: str(x)) if id_type == "str" else (lambda x: int(str(x).lstrip("g")))
    return pa.table(
        {
            "group_id": [conv(r[0]) for r in rows],
            "rollout_id": [conv(r[1]) for r in rows],
            "env": [r[2] for r in rows],
            "reward": [r[3] for r in rows],
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.int8())),
            "extra": [f"row{i}" for i in range(len(rows))],
        }
    )


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=datasets(), estimator=ESTIMATOR_NAMES, id_type=st.sampled_from(["str", "int"]))
def test_run_advantages_end_to_end_matches_reference(
    rows: list[Row], estimator: str, id_type: str
) -> None:
    """Through Parquet, `scan` and the writer: ids as strings or ints, groups interleaved."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.parquet", Path(tmp) / "out.parquet"
        table = _table(rows, id_type)
        pq.write_table(table, src)
        config = AdvantageConfig(estimator=estimator)
        try:
            ref = reference(rows, estimator, {}, EPS)
        except ValueError:
            with pytest.raises(RolltoolError):
                run_advantages([src], dst, config)
            assert not dst.exists()
            return
        run_advantages([src], dst, config)
        out = pq.read_table(dst)
    assert out.select(table.column_names).equals(table)  # rows and order carried through
    np.testing.assert_allclose(out["advantage"].to_numpy(), ref["advantage"], rtol=1e-5, atol=1e-5)
    assert out["group_size"].to_pylist() == ref["size"]
    assert out["group_uniform"].to_pylist() == ref["uniform"]


# --------------------------------------------------------------------------------------------
# AdvantageInput: one record instead of six keyword arrays.


@settings(max_examples=150, deadline=None)
@given(rows=datasets(), estimator=ESTIMATOR_NAMES, data=st.data())
def test_take_is_the_subset_computed_on_its_own(
    rows: list[Row], estimator: str, data: st.DataObject
) -> None:
    """Whole groups taken from the input give what those rows alone give (the reference on
    them): dense codes again, env names kept."""
    groups = sorted({r[0] for r in rows})
    kept = data.draw(st.sets(st.sampled_from(groups), min_size=1))
    idx = np.array([i for i, r in enumerate(rows) if r[0] in kept])
    sub = _input(rows).take(idx)
    assert sorted(set(sub.group.tolist())) == list(range(len(kept)))
    assert sorted(set(sub.rollout.tolist())) == list(range(len({rows[i][:2] for i in idx})))
    assert list(sub.env_names) == list(_input(rows).env_names) and len(sub) == len(idx)
    try:
        alone = compute([rows[i] for i in idx], estimator)
    except RolltoolError:
        return
    got = compute_advantages(AdvantageConfig(estimator=estimator, std_eps=EPS), sub)
    # equal up to the order of whitening's sums (codes are numbered differently)
    np.testing.assert_allclose(got.advantage, alone.advantage, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got.group_size, alone.group_size)


def test_without_tokens_keeps_the_group_and_leaves_the_whitening() -> None:
    """Zeroed samples stay in their group's mean (their reward counts) but bring no tokens into
    reinforce_pp_baseline's whitening: the same as rows whose trainable count is 0."""
    rows = [
        ("a", 0, "e", 1.0, 3),
        ("a", 1, "e", 0.0, 5),
        ("b", 0, "e", 2.0, 4),
        ("b", 1, "e", 0.5, 9),
    ]
    mask = np.array([False, True, False, False])
    zeroed = [(*r[:4], 0 if m else r[4]) for r, m in zip(rows, mask, strict=True)]
    config = AdvantageConfig(estimator="reinforce_pp_baseline")
    got = compute_advantages(config, _input(rows).without_tokens(mask))
    want = compute(zeroed, "reinforce_pp_baseline")
    np.testing.assert_array_equal(got.advantage, want.advantage)
    np.testing.assert_array_equal(got.group_reward_mean, compute(rows).group_reward_mean)
    assert not np.array_equal(got.advantage, compute(rows, "reinforce_pp_baseline").advantage)


# --------------------------------------------------------------------------------------------
# The columns `rolltool advantages` writes.


def test_output_columns(synth_path: Path, synth_table: pa.Table, tmp_path: Path, run_cli) -> None:
    table = synth_table.append_column(
        "note", pa.array([f"n{i}" for i in range(synth_table.num_rows)])
    )
    src = tmp_path / "with_note.parquet"
    pq.write_table(table, src)
    dst = tmp_path / "adv.parquet"
    result = run_cli("advantages", src, "-o", dst, "--estimator", "grpo", "--json")
    assert result.exit_code == 0, result.output
    out = pq.read_table(dst)
    # Input columns first, untouched and in the same row order; then the new ones.
    new = ["advantage", "group_size", "group_reward_mean", "group_reward_std", "group_uniform"]
    assert out.column_names == table.column_names + new
    assert out.select(table.column_names).equals(table)
    assert out.schema.field("advantage").type == pa.float32()
    assert out.schema.field("group_size").type == pa.int64()
    assert out.schema.field("group_reward_mean").type == pa.float64()
    assert out.schema.field("group_reward_std").type == pa.float64()
    assert out.schema.field("group_uniform").type == pa.bool_()

    # The same as the reference, with trainable tokens counted from the loss mask.
    ref = reference(rows_of(table), "grpo", {}, EPS)
    np.testing.assert_allclose(out["advantage"].to_numpy(), ref["advantage"], rtol=1e-5, atol=1e-6)
    assert out["group_size"].to_pylist() == ref["size"]
    np.testing.assert_allclose(out["group_reward_mean"].to_numpy(), ref["mean"], rtol=1e-12)
    np.testing.assert_allclose(out["group_reward_std"].to_numpy(), ref["std"], rtol=1e-9)
    assert out["group_uniform"].to_pylist() == ref["uniform"]

    # Invariants over the synthetic data: branches of a rollout share their advantage, uniform
    # groups exist and have zero advantage under grpo, math groups have 16 rollouts.
    by_rollout: dict[str, set] = defaultdict(set)
    for rid, a in zip(out["rollout_id"].to_pylist(), out["advantage"].to_pylist(), strict=True):
        by_rollout[rid].add(a)
    assert all(len(v) == 1 for v in by_rollout.values())
    assert len(by_rollout) < out.num_rows  # the fixture really has branches
    uniform = out["group_uniform"].to_numpy(zero_copy_only=False)
    assert uniform.any()
    assert (out["advantage"].to_numpy()[uniform] == 0).all()
    math_rows = np.array(out["env"].to_pylist()) == "math"
    assert math_rows.any()
    assert set(out["group_size"].to_numpy()[math_rows].tolist()) == {16}

    report = json.loads(result.stdout)
    assert report["samples"] == table.num_rows
    assert report["groups"] == len(set(table["group_id"].to_pylist()))


def test_env_estimator_overrides_through_the_cli(synth_path: Path, tmp_path: Path, run_cli) -> None:
    dst = tmp_path / "adv.parquet"
    result = run_cli(
        "advantages",
        synth_path,
        "-o",
        dst,
        "--estimator",
        "grpo",
        "--env-estimator",
        "code=rloo",
        "--env-estimator",
        "agent=opo",
        "--std-eps",
        "0.01",
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    estimators = {r["env"]: r["estimator"] for r in report["envs"]}
    assert estimators == {"math": "grpo", "code": "rloo", "agent": "opo"}
    assert report["overall"]["env"] is None and report["overall"]["estimator"] is None
    assert report["config"] == {
        "estimator": "grpo",
        "env_estimators": {"code": "rloo", "agent": "opo"},
        "std_eps": 0.01,
    }
    out = pq.read_table(dst)
    ref = reference(rows_of(out), "grpo", {"code": "rloo", "agent": "opo"}, 0.01)
    np.testing.assert_allclose(out["advantage"].to_numpy(), ref["advantage"], rtol=1e-5, atol=1e-6)
    # The per-env summary is computed over that env's rows only.
    env = np.array(out["env"].to_pylist())
    adv = out["advantage"].to_numpy().astype(np.float64)
    for r in [*report["envs"], report["overall"]]:
        sel = env == r["env"] if r["env"] is not None else np.ones(len(env), bool)
        assert r["samples"] == int(sel.sum())
        assert r["advantage_min"] == pytest.approx(adv[sel].min())
        assert r["advantage_max"] == pytest.approx(adv[sel].max())
        assert r["advantage_mean"] == pytest.approx(adv[sel].mean(), abs=1e-9)
        groups = {g for g, keep in zip(out["group_id"].to_pylist(), sel, strict=True) if keep}
        assert r["groups"] == len(groups)
        per_rollout = {
            ro: w
            for ro, w, keep in zip(
                out["rollout_id"].to_pylist(), out["reward"].to_pylist(), sel, strict=True
            )
            if keep
        }
        assert r["rollouts"] == len(per_rollout)
        rewards = np.array(list(per_rollout.values()))
        assert r["reward_mean"] == pytest.approx(rewards.mean())
        assert r["reward_std"] == pytest.approx(rewards.std(ddof=1))
        uniform = {
            g
            for g, u, keep in zip(
                out["group_id"].to_pylist(), out["group_uniform"].to_pylist(), sel, strict=True
            )
            if keep and u
        }
        assert r["uniform_groups"] == len(uniform)
        assert r["uniform_share"] == pytest.approx(len(uniform) / len(groups))


def test_rerun_on_its_own_output_replaces_the_columns(synth_path: Path, run_cli) -> None:
    a, b = synth_path.with_name("a.parquet"), synth_path.with_name("b.parquet")
    first = run_cli("advantages", synth_path, "-o", a, "--estimator", "opo")
    assert first.exit_code == 0, first.output
    once = pq.read_table(a)
    again = run_cli("advantages", a, "-o", b, "--estimator", "opo")
    assert again.exit_code == 0, again.output
    assert "replaced" in again.stderr
    twice = pq.read_table(b)
    assert twice.column_names == once.column_names  # no duplicated columns
    assert twice.equals(once)
    # Writing over the input itself is refused, even with --force, before any work.
    before = a.read_bytes()
    same = run_cli("advantages", a, "-o", a, "--force", "--estimator", "opo")
    assert same.exit_code == 1 and "is one of the inputs" in same.stderr
    assert a.read_bytes() == before


def test_an_input_advantage_column_is_replaced_unchecked(
    synth_table: pa.Table, tmp_path: Path
) -> None:
    """`rolltool advantages` replaces an input 'advantage' column: one pack would refuse (not
    a number, not finite) is neither read nor checked, and the output is as without it."""
    n = synth_table.num_rows
    for bad in (pa.array(["x"] * n), pa.array([float("nan")] * n)):
        src = tmp_path / "bad.parquet"
        pq.write_table(synth_table.append_column("advantage", bad), src)
        report = run_advantages([src], tmp_path / "out.parquet", AdvantageConfig(), force=True)
        assert any("replaced" in w for w in report["warnings"])
        pq.write_table(synth_table, tmp_path / "plain.parquet")
        run_advantages(
            [tmp_path / "plain.parquet"], tmp_path / "want.parquet", AdvantageConfig(), force=True
        )
        assert pq.read_table(tmp_path / "out.parquet").equals(
            pq.read_table(tmp_path / "want.parquet")
        )


def test_an_estimator_without_samples_in_the_subset_is_skipped() -> None:
    """A step (a subset of the input) may hold no sample of an env: its estimator has nothing to
    do, even one that whitens and would need 2 trainable tokens."""
    config = AdvantageConfig(estimator="grpo", env_estimators={"code": "reinforce_pp_baseline"})
    adv = compute_advantages(
        config,
        AdvantageInput(
            group=np.array([0, 0]),
            rollout=np.array([0, 1]),
            env=np.array([0, 0]),
            env_names=["math", "code"],
            reward=np.array([1.0, 0.0]),
            trainable=np.array([3, 4]),
        ),
    )
    a = 0.5 / (math.sqrt(0.5) + EPS)  # grpo: (r - mean) / (unbiased std + eps)
    assert adv.advantage.tolist() == pytest.approx([a, -a], rel=1e-6)
    assert adv.estimator.tolist() == ["grpo", "grpo"]
    # With samples that have too few trainable tokens, it is still an error.
    with pytest.raises(RolltoolError, match="at least 2"):
        compute_advantages(
            config,
            AdvantageInput(
                group=np.array([0, 1]),
                rollout=np.array([0, 1]),
                env=np.array([0, 1]),
                env_names=["math", "code"],
                reward=np.array([1.0, 0.0]),
                trainable=np.array([3, 1]),
            ),
        )


def test_an_env_called_all_is_an_env_like_any_other(write_parquet, run_cli, tmp_path) -> None:
    import json

    data = {
        "group_id": ["a", "a", "b", "b"],
        "env": ["all", "all", "other", "other"],
        "reward": [1.0, 0.0, 1.0, 1.0],
        "input_ids": [[1, 2], [1, 3], [4, 5], [4, 6]],
        "loss_mask": [[0, 1]] * 4,
    }
    src = write_parquet(data)
    result = run_cli("advantages", src, "-o", tmp_path / "out.parquet", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["env"] for r in report["envs"]] == ["all", "other"]
    assert report["envs"][0]["samples"] == 2 and report["overall"]["samples"] == 4


def _random_input(rng: np.random.Generator, n: int, envs: int, huge: bool) -> AdvantageInput:
    """n samples in groups of 1-9 rollouts of 1-3 branches, rewards with ties (and with `huge`,
    rewards past `SAFE_REWARD` in groups of 2 or more: only grpo keeps their advantages in
    float32's range)."""
    group, rollout, g, r = [], [], 0, 0
    while len(group) < n:
        for _ in range(int(rng.integers(1 + huge, 10))):  # a huge singleton overflows
            k = int(rng.integers(1, 4))
            group += [g] * k
            rollout += [r] * k
            r += 1
        g += 1
    group_a, rollout_a = np.array(group[:n]), np.array(rollout[:n])
    choices = np.array([0.0, 1.0, 0.1, -2.3, 0.7] + [1e200] * huge)
    r_reward = choices[rng.integers(0, len(choices), int(rollout_a.max()) + 1)]
    r_env = rng.integers(0, envs, int(group_a.max()) + 1)
    return AdvantageInput(group=group_a, rollout=rollout_a, env=r_env[group_a].astype(np.int32),
                          env_names=[f"e{i}" for i in range(envs)], reward=r_reward[rollout_a],
                          trainable=rng.integers(0, 50, n))  # fmt: skip


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_chunked_and_per_rollout_advantages_equal_the_whole_computation(
    estimator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run plan's path (`rollout_advantages` by chunks of rollouts, spread over samples in
    float32) gives `compute_advantages`' column bit for bit, with one env or several."""
    from rolltool.plan import advantages as adv_mod
    from rolltool.plan.advantages import ELEMENTWISE, rollout_advantages

    rng = np.random.default_rng(7)
    chunked = 0
    for seed in range(12):
        ro = _random_input(rng, int(rng.integers(1, 400)), 1 + seed % 2, estimator == "grpo")
        config = AdvantageConfig(
            estimator=estimator, env_estimators={"e1": "grpo"} if seed % 2 else {}
        )
        monkeypatch.setattr(adv_mod, "CHUNK", 1 << 20)
        whole = compute_advantages(config, ro)
        monkeypatch.setattr(adv_mod, "CHUNK", int(rng.integers(1, 17)))
        per = rollout_advantages(config, ro)
        chunked += estimator in ELEMENTWISE and seed % 2 == 0 and len(per.value) > adv_mod.CHUNK
        assert np.array_equal(per.value.astype(np.float32)[ro.rollout], whole.advantage)
        assert np.array_equal(per.stats.uniform[ro.group], whole.group_uniform)
    assert chunked >= 3 or estimator not in ELEMENTWISE  # the chunked loop really ran
