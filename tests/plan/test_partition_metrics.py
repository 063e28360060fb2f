"""Balance figures (`rolltool.plan.partition.metrics`) against slow loops written from their
definitions, and the ones the planner, stats and bench report agree with them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rolltool.plan.partition import metrics, plan_step
from rolltool.plan.workload import make_workload


def _slow(x: list[list[float]]) -> dict[str, float]:
    """The module docstring's table, with Python loops over a list of rank rows."""
    ranks, slots = len(x), len(x[0])
    totals = [sum(row) for row in x]
    total = sum(totals)
    lockstep = 0.0
    for j in range(slots):
        lockstep += max(row[j] for row in x)
    ideal = total / ranks
    return {
        "ideal": ideal,
        "dp_cost": max(totals) if slots else 0.0,
        "lockstep_cost": lockstep,
        "imbalance": max(totals) / ideal if slots and total > 0 else 1.0,
        "lockstep_overhead": lockstep / ideal if slots and total > 0 else 1.0,
    }


grids = st.integers(1, 6).flatmap(
    lambda r: arrays(
        np.float64,
        st.tuples(st.just(r), st.integers(0, 7)),
        elements=st.floats(0, 1e6, allow_nan=False),
    )
)


@settings(max_examples=300)
@given(grids)
def test_figures_match_their_definitions(x: np.ndarray) -> None:
    slow = _slow(x.tolist())
    assert metrics.dp_cost(x) == pytest.approx(slow["dp_cost"], rel=1e-12)
    assert metrics.lockstep_cost(x) == slow["lockstep_cost"]  # same order: exactly equal
    assert metrics.imbalance(x) == pytest.approx(slow["imbalance"], rel=1e-12)
    assert metrics.lockstep_overhead(x) == pytest.approx(slow["lockstep_overhead"], rel=1e-12)
    assert metrics.step_cost(x, "lockstep") == metrics.lockstep_cost(x)
    assert metrics.step_cost(x, "total") == metrics.dp_cost(x)
    if x.size and x.sum() > 0:
        assert metrics.ideal(x) == pytest.approx(slow["ideal"], rel=1e-12)
        # the invariants the names promise
        assert 1.0 - 1e-12 <= metrics.imbalance(x) <= metrics.lockstep_overhead(x) * (1 + 1e-12)
        assert metrics.lockstep_overhead(x) <= x.shape[0] * (1 + 1e-12)


def test_worked_example_and_empty_grids() -> None:
    x = np.array([[3.0, 1.0], [1.0, 3.0]])
    assert (metrics.ideal(x), metrics.dp_cost(x), metrics.lockstep_cost(x)) == (4.0, 4.0, 6.0)
    assert (metrics.imbalance(x), metrics.lockstep_overhead(x)) == (1.0, 1.5)
    for empty in (np.zeros((3, 0)), np.zeros((2, 4))):
        assert metrics.dp_cost(empty) == metrics.lockstep_cost(empty) == 0.0
        assert metrics.imbalance(empty) == metrics.lockstep_overhead(empty) == 1.0
    assert metrics.ALIGNS == ("lockstep", "total")


def test_grid_costs_sums_each_micro_batch() -> None:
    grid = [[np.array([0, 2]), np.array([], dtype=np.int64)], [np.array([1]), np.array([3, 4])]]
    w = np.array([1.0, 10.0, 100.0, 1000.0, 10000.0])
    np.testing.assert_array_equal(metrics.grid_costs(grid, w), [[101.0, 0.0], [10.0, 11000.0]])
    assert metrics.grid_costs([[], []], w).shape == (2, 0)


@pytest.mark.parametrize("align", ["lockstep", "total"])
def test_plan_report_is_the_metrics_of_its_grid(align: str) -> None:
    """The manifest's plan numbers are these figures of the plan's own grid."""
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(20):
        lengths = rng.integers(1, 3000, int(rng.integers(1, 60)))
        plan = plan_step(lengths, dp=int(rng.integers(1, 5)), max_tokens=4096, align=align,
                         workload=make_workload("flops"))  # fmt: skip
        rep = plan.report
        cost = make_workload("flops").cost(lengths)
        costs = metrics.grid_costs(plan.micro_batches, cost)
        np.testing.assert_allclose(costs, plan.costs, rtol=1e-12)
        for name, x in (("tokens", plan.tokens.astype(float)), ("cost", plan.costs)):
            assert rep[f"imbalance_{name}"] == metrics.imbalance(x)
            assert rep[f"lockstep_overhead_{name}"] == metrics.lockstep_overhead(x)
        checked += 1
    assert checked == 20
