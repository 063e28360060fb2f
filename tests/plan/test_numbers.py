"""Extreme but finite numbers (issue 13, "Numbers").

Finite rewards give finite advantages: the group statistics are computed in units of the
group's largest |reward| once it passes `SAFE_REWARD`, so nothing overflows; an advantage that
float32 (its stored dtype) cannot hold is refused, naming the group. Logprobs and given
advantages beyond float32's range are schema problems (``logprobs.range``,
``advantage.range``), not silently packed as -inf.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pack_helpers import G, cli, pack, rollouts

from rolltool.errors import RolltoolError
from rolltool.plan.advantages import (
    ESTIMATORS,
    SAFE_REWARD,
    AdvantageConfig,
    AdvantageInput,
    compute_advantages,
)
from rolltool.verify import verify


def _input(groups: list[list[float]], env: str = "math") -> AdvantageInput:
    """One rollout (one branch, 4 trainable tokens) per reward, groups as given."""
    group = np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int64)
    n = len(group)
    return AdvantageInput(
        group=group,
        rollout=np.arange(n, dtype=np.int64),
        env=np.zeros(n, dtype=np.int32),
        env_names=[env],
        reward=np.array([r for g in groups for r in g], dtype=np.float64),
        trainable=np.full(n, 4, dtype=np.int64),
        group_ids=pa.array([f"g{i}" for i in range(len(groups))]),
    )


def _adv(estimator: str, groups: list[list[float]], eps: float = 1e-6) -> np.ndarray:
    config = AdvantageConfig(estimator=estimator, std_eps=eps)
    return compute_advantages(config, _input(groups)).advantage


@pytest.mark.parametrize("k", [0, 200, 500, 1020])
@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp_baseline"])
def test_scale_free_estimators_are_finite_at_any_scale(estimator: str, k: int) -> None:
    """grpo (std_eps 0) and the whitening do not depend on the rewards' unit: rewards times
    2**k give the advantages of the rewards themselves, finite up to float64's largest."""
    base = [[1.0, -1.0, 0.5, 0.25], [0.0, 1.0], [0.75, 0.75, 0.75]]
    scaled = [[r * 2.0**k for r in g] for g in base]
    assert max(abs(r) for g in scaled for r in g) < np.inf
    got, want = _adv(estimator, scaled, eps=0.0), _adv(estimator, base, eps=0.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_rewards_of_plus_minus_1e308_give_finite_grpo_advantages() -> None:
    adv = _adv("grpo", [[1e308, -1e308], [1.7e308, 1.7e308, 1.7e308], [0.0, 1.0]])
    assert np.isfinite(adv).all()
    np.testing.assert_allclose(adv[:2], [2**-0.5, -(2**-0.5)], rtol=1e-6)
    assert (adv[2:5] == 0).all()  # a uniform group, however large its reward
    # ordinary groups are computed exactly as before: the scale is 1 there
    assert (adv[5:] == _adv("grpo", [[0.0, 1.0]])).all()
    assert SAFE_REWARD < 1e308


@pytest.mark.parametrize("estimator", sorted(set(ESTIMATORS) - {"grpo", "reinforce_pp_baseline"}))
def test_advantages_float32_cannot_hold_are_refused_naming_the_group(estimator: str) -> None:
    with pytest.raises(RolltoolError) as e:
        _adv(estimator, [[0.0, 1.0], [1e300, -1e300]])
    assert "group 'g1'" in e.value.message and "float32" in e.value.message
    # the same spread at 1e30 fits float32: no refusal, nothing non-finite
    assert np.isfinite(_adv(estimator, [[0.0, 1.0], [1e30, -1e30]])).all()


def test_a_big_singleton_under_grpo_is_refused() -> None:
    """A singleton's grpo advantage is r / (1 + eps): 1e308 does not fit float32."""
    with pytest.raises(RolltoolError, match="group 'g0'"):
        _adv("grpo", [[1e308]])


def test_the_group_is_named_in_a_step_subset() -> None:
    ro = _input([[0.0, 1.0], [1.0, 2.0], [1e300, -1e300]])
    sub = ro.take(np.array([2, 3, 4, 5]))
    assert sub.group_name(1) == "group 'g2'"
    with pytest.raises(RolltoolError, match="group 'g2'"):
        compute_advantages(AdvantageConfig(estimator="dr_grpo"), sub)


# -- through the CLI ------------------------------------------------------------------------------


def _write(tmp_path: Path, table: pa.Table) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    return path


def _groups(big: float) -> list[G]:
    return [G("math", [big, -big, 0.5, 0.0], [8, 9, 10, 11]), G("math", [0.0, 1.0], [12, 13])]


def test_pack_with_rewards_of_1e308_is_finite_and_verifies(tmp_path: Path) -> None:
    path = _write(tmp_path, rollouts(_groups(1e308)))
    manifest: dict[str, Any] = pack(path, tmp_path / "out", "--dp", 1, "--batch-size", 6)
    adv = pq.read_table(tmp_path / "out" / "samples.parquet").column("advantage").to_numpy()
    assert np.isfinite(adv).all() and np.abs(adv).max() < 2
    assert manifest["steps"]
    assert verify(tmp_path / "out")["ok"]


def test_a_step_reward_mean_of_huge_rewards_is_finite(tmp_path: Path) -> None:
    # Plain float64 sums overflow: 1e308 + 1.5e308 = inf.
    groups = [G("math", [1e308, 1.5e308], [8, 9]), G("math", [1.2e308, 1.7e308], [10, 11])]
    path = _write(tmp_path, rollouts(groups))
    manifest: dict[str, Any] = pack(path, tmp_path / "out", "--dp", 1, "--batch-size", 4)
    means = [
        manifest["steps"][0]["reward_mean"],
        manifest["steps"][0]["envs"]["math"]["reward_mean"],
    ]
    assert means[0] == pytest.approx(1.35e308) and means[0] == means[1]
    assert verify(tmp_path / "out")["ok"]


def test_pack_refuses_advantages_beyond_float32(tmp_path: Path) -> None:
    path = _write(tmp_path, rollouts(_groups(1e300)))
    result = cli("pack", path, "-o", tmp_path / "out", "--estimator", "dr_grpo", "--dp", 1)
    assert result.exit_code == 1, result.output
    assert "group 'math/g000'" in result.stderr and "float32" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("column", "value"), [("logprobs", -1e39), ("advantage", 5e38)])
def test_values_float32_cannot_hold_are_schema_problems(
    tmp_path: Path, column: str, value: float
) -> None:
    table = rollouts(_groups(1.0), advantage=True)
    if column == "logprobs":
        lp = table.column("logprobs").to_pylist()
        lp[2][3] = value
        table = table.set_column(
            table.schema.get_field_index("logprobs"),
            "logprobs",
            pa.array(lp, pa.list_(pa.float64())),
        )
    else:
        adv = table.column("advantage").to_pylist()
        adv[1] = value
        table = table.set_column(
            table.schema.get_field_index("advantage"), "advantage", pa.array(adv)
        )
    path = _write(tmp_path, table)
    result = cli("pack", path, "-o", tmp_path / "out", "--dp", 1, "--json")
    assert result.exit_code == 1, result.output
    assert "float32" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert f"column '{column}' holds" in result.stderr  # the rule's kind: test_schema_rules
