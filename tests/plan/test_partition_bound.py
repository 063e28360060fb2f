"""bound.lockstep_bound: no lockstep plan beats it (exhaustive on tiny steps), and it equals a
plain-loop reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from partition_refs import reference_lockstep_bound

from rolltool.plan.partition.bound import lockstep_bound


def _best_overhead(length: np.ndarray, a: float, b: float, dp: int, cap: int, most: int) -> float:
    """The lowest lockstep overhead - 1 of any plan with up to ``most`` micro-batches per rank:
    every assignment of the samples to dp·most bins under the cap (empty bins allowed)."""
    cost = length * (a + b * length.astype(np.float64))
    ideal = float(cost.sum()) / dp
    nb = dp * most
    best = np.inf
    for bins in itertools.product(range(nb), repeat=len(length)):
        lab = np.array(bins)
        if (np.bincount(lab, weights=length, minlength=nb) > cap).any():
            continue
        c = np.bincount(lab, weights=cost, minlength=nb).reshape(most, dp)
        best = min(best, float(c.max(axis=1).sum()))
    return best / ideal - 1.0


@pytest.mark.parametrize("dp, most", [(2, 3), (3, 2)])
def test_no_plan_beats_the_bound(dp: int, most: int) -> None:
    rng = np.random.default_rng(dp)
    above_zero = 0
    for _ in range(25):
        cap = int(rng.integers(8, 20))
        n = int(rng.integers(2, 6))
        length = rng.integers(1, cap + 1, n)
        a, b = float(rng.choice([0.0, 1.0, 5.0])), float(rng.choice([1.0, 0.2]))
        if int(length.sum()) > dp * most * cap:
            continue
        bound = lockstep_bound(length, a=a, b=b, dp=dp, cap=cap)
        assert bound <= _best_overhead(length, a, b, dp, cap, most) + 1e-12
        above_zero += bound > 0
    assert above_zero >= 5  # the bound said something on enough of them


def test_the_docstring_example() -> None:
    bound = lockstep_bound(np.array([9, 3, 3, 3]), a=0.0, b=1.0, dp=2, cap=10)
    assert bound == pytest.approx(25.5 / 54)


def test_equals_the_loop_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        dp = int(rng.integers(1, 17))
        cap = int(rng.choice([100, 4096, 32768]))
        n = int(rng.integers(0, 300))
        length = np.minimum(
            rng.lognormal(np.log(cap / 5), rng.uniform(0.3, 1.5), n).round().astype(np.int64) + 1,
            cap,
        )
        a, b = float(rng.choice([0.0, 1.0, 4.2e10])), float(rng.choice([0.0, 1.0, 6.0e5]))
        if a == b == 0:
            continue
        want = reference_lockstep_bound(length, a, b, dp, cap)
        assert lockstep_bound(length, a=a, b=b, dp=dp, cap=cap) == pytest.approx(want, rel=1e-12)
