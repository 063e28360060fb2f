"""balance(): invariants, KK and LPT against slow references, auto never worse, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_refs import reference_kk

from rolltool.errors import RolltoolError
from rolltool.plan.partition import METHODS, balance, balance_labels, lower_bound, part_loads
from rolltool.plan.partition.balance import refined_and_lpt_labels

# ---------------------------------------------------------------- slow, obvious references


def reference_lpt(weights: list[float], k: int, equal_count: bool) -> list[int]:
    """Each item, heaviest first, to the lightest part (lowest index on ties) with room.

    With equal counts a part has room below n // k items, or at n // k while fewer than n % k
    parts have taken an extra item.
    """
    n = len(weights)
    base, extras = (n // k, n % k) if equal_count else (n + 1, 0)
    loads, counts = [0.0] * k, [0] * k
    label = [0] * n
    for i in sorted(range(n), key=lambda i: -weights[i]):
        room = [p for p in range(k) if counts[p] < base or (counts[p] == base and extras > 0)]
        p = min(room, key=lambda p: (loads[p], p))
        if counts[p] == base:
            extras -= 1
        loads[p] += weights[i]
        counts[p] += 1
        label[i] = p
    return label


# ---------------------------------------------------------------- helpers


def check_partition(parts: list[np.ndarray], n: int, k: int, equal_count: bool) -> None:
    assert len(parts) == k
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    assert flat.dtype == np.int64
    assert np.array_equal(np.sort(flat), np.arange(n)), "every item exactly once"
    for p in parts:
        assert np.all(np.diff(p) > 0), "each part ascending"
    if equal_count:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        if n % k == 0:
            assert len(set(sizes)) == 1


def heaviest(weights: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(part_loads(weights, parts).max()) if len(weights) else 0.0


def _weights(n: int, seed: int, shape: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "uniform":
        return rng.integers(0, 10_000, n).astype(np.float64)
    if shape == "few values":  # many ties
        return rng.integers(1, 4, n).astype(np.float64)
    return np.minimum((rng.pareto(1.1, n) + 1) * 100, 30_000).round()  # heavy tail


weights_st = st.builds(
    _weights,
    st.integers(0, 300),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["uniform", "few values", "heavy tail"]),
) | st.lists(st.integers(0, 10_000), max_size=12).map(lambda xs: np.array(xs, dtype=np.float64))

# ---------------------------------------------------------------- properties


def test_invariants_and_auto_never_worse() -> None:
    runs = []

    @settings(max_examples=150, deadline=None)
    @given(w=weights_st, k=st.integers(1, 40), equal_count=st.booleans())
    def prop(w: np.ndarray, k: int, equal_count: bool) -> None:
        got = {m: balance(w, k, equal_count=equal_count, method=m) for m in METHODS}
        for parts in got.values():
            check_partition(parts, len(w), k, equal_count)
            assert heaviest(w, parts) >= lower_bound(w, k, equal_count=equal_count) * (1 - 1e-12)
        auto = heaviest(w, got["auto"])
        assert auto <= heaviest(w, got["kk"]) and auto <= heaviest(w, got["lpt"])
        runs.append(len(w))

    prop()
    assert len(runs) >= 100 and max(runs) > 50


def test_kk_equals_the_slow_reference() -> None:
    runs = []

    @settings(max_examples=120, deadline=None)
    @given(
        w=st.lists(st.integers(0, 1000), min_size=0, max_size=40),
        k=st.integers(1, 9),
        equal_count=st.booleans(),
    )
    def prop(w: list[int], k: int, equal_count: bool) -> None:
        parts = balance(np.array(w, dtype=np.float64), k, equal_count=equal_count, method="kk")
        got = sorted(tuple(sorted(p.tolist())) for p in parts)
        want = sorted(tuple(sorted(s)) for s in reference_kk(w, k, equal_count))
        assert got == want
        runs.append(1)

    prop()
    assert len(runs) >= 100


def test_lpt_equals_the_slow_reference_in_both_engines() -> None:
    runs = []

    @settings(max_examples=100, deadline=None)
    @given(
        w=st.lists(st.integers(0, 500), min_size=0, max_size=300),
        k=st.sampled_from([1, 2, 3, 7, 24, 31, 64]),  # below and above the rounds engine's k
        equal_count=st.booleans(),
    )
    def prop(w: list[int], k: int, equal_count: bool) -> None:
        parts = balance(np.array(w, dtype=np.float64), k, equal_count=equal_count, method="lpt")
        label = [0] * len(w)
        for p, members in enumerate(parts):
            for i in members.tolist():
                label[i] = p
        assert label == reference_lpt(w, k, equal_count)
        runs.append(k)

    prop()
    assert len(runs) >= 80 and max(runs) >= 24


def test_worked_examples() -> None:
    w = np.array([8.0, 7, 6, 5, 4])
    assert sorted(part_loads(w, balance(w, 2, method="lpt")).tolist()) == [13.0, 17.0]
    assert sorted(part_loads(w, balance(w, 2, method="kk")).tolist()) == [14.0, 16.0]
    assert sorted(part_loads(w, balance(w, 2)).tolist()) == [15.0, 15.0]


def test_equal_count_when_k_does_not_divide() -> None:
    w = np.arange(1.0, 11.0)  # 10 items, 4 parts -> sizes 3, 3, 2, 2
    for m in METHODS:
        parts = balance(w, 4, equal_count=True, method=m)
        assert sorted(len(p) for p in parts) == [2, 2, 3, 3]


def test_degenerate_inputs() -> None:
    for m in METHODS:
        assert [len(p) for p in balance(np.array([]), 3, method=m)] == [0, 0, 0]
        parts = balance(np.array([5.0, 1.0]), 4, method=m)  # fewer items than parts
        check_partition(parts, 2, 4, equal_count=False)
        same = np.full(64, 3.0)
        assert part_loads(same, balance(same, 8, equal_count=True, method=m)).tolist() == [24.0] * 8
        huge = np.array([1000.0] + [1.0] * 20)
        assert heaviest(huge, balance(huge, 4, method=m)) == 1000.0


def test_deterministic_and_order_of_ties() -> None:
    rng = np.random.default_rng(7)
    w = rng.integers(1, 50, 3000).astype(np.float64)  # many ties
    for m in METHODS:
        a = balance(w, 64, equal_count=True, method=m)
        b = balance(w.copy(), 64, equal_count=True, method=m)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_quality_on_large_inputs() -> None:
    rng = np.random.default_rng(0)
    w = np.minimum((rng.pareto(1.2, 4096) + 1) * 800, 32768).round()
    for equal_count in (False, True):
        q = heaviest(w, balance(w, 64, equal_count=equal_count)) / lower_bound(
            w, 64, equal_count=equal_count
        )
        assert q <= 1.0001


def test_errors_are_for_people() -> None:
    with pytest.raises(RolltoolError, match="parts"):
        balance(np.ones(3), 0)
    with pytest.raises(RolltoolError, match="item 1"):
        balance(np.array([1.0, -2.0]), 2)
    with pytest.raises(RolltoolError, match="item 0"):
        balance(np.array([np.nan]), 2)
    with pytest.raises(RolltoolError, match="unknown partition method") as e:
        balance(np.ones(3), 2, method="greedy")
    assert e.value.hint and "kk" in e.value.hint
    with pytest.raises(RolltoolError, match="one-dimensional"):
        balance(np.ones((2, 2)), 2)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(0, 10_000), min_size=0, max_size=300),
    k=st.integers(1, 9),
    equal_count=st.booleans(),
    scale=st.sampled_from([1.0, 0.37]),  # whole numbers, and not
)
def test_refined_and_lpt_labels_equal_two_calls(
    weights: list[int], k: int, equal_count: bool, scale: float
) -> None:
    """The lockstep planner's shared sort and LPT give exactly the labels of two calls."""
    w = np.array(weights, dtype=np.float64) * scale
    refined, lpt = refined_and_lpt_labels(w, k, equal_count=equal_count)
    assert (
        refined.tolist() == balance_labels(w, k, equal_count=equal_count, method="refined").tolist()
    )
    assert lpt.tolist() == balance_labels(w, k, equal_count=equal_count, method="lpt").tolist()
