"""The serpentine deal and transfer rounds, the whole-number bound, and ``auto`` after issue 23:
never heavier than before, the same labels wherever it does not prove a lighter or optimal one."""

from __future__ import annotations

from itertools import product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.plan.partition import balance_labels, lower_bound
from rolltool.plan.partition.balance import (
    EXHAUSTIVE_UP_TO,
    KK_AUTO_MERGES,
    METHODS,
    PAIR_STEPS,
    PAIR_WORK,
    REFINE_STEPS,
    REFINE_WORK,
    descending_order,
    whole_bound,
)
from rolltool.plan.partition.deal import deal, serpentine, transfer_rounds
from rolltool.plan.partition.refine import refine, refine_pairs

# ---------------------------------------------------------------- references


def auto_before(ws: np.ndarray, k: int, eq: bool) -> np.ndarray:
    """``auto`` as it was before issue 23 (commit 23bbcea), from the same building blocks: LPT and
    (when cheap) KK, the lighter refined under a budget, up to 256 items also both refined by
    the exhaustive pairwise search; the lightest (first on ties)."""
    n = len(ws)

    def heaviest(lab: np.ndarray) -> float:
        return float(np.bincount(lab, weights=ws, minlength=k).max())

    starts = [METHODS["lpt"](ws, k, eq)]
    if (n // k if eq else n) <= KK_AUTO_MERGES:
        starts.append(METHODS["kk"](ws, k, eq))
    loads = [heaviest(s) for s in starts]
    best = starts[loads.index(min(loads))]
    small = n <= EXHAUSTIVE_UP_TO
    refined = [refine(ws, best, k, equal_count=eq, max_steps=2 * k + REFINE_STEPS,
                      max_work=REFINE_WORK, others=not small)]  # fmt: skip
    floor = lower_bound(ws, k, equal_count=eq) if small else 0.0
    if small and heaviest(refined[0]) > floor:
        refined += [refine_pairs(ws, s, k, equal_count=eq, max_steps=PAIR_STEPS * (n + k),
                                 max_work=PAIR_WORK, floor=floor) for s in starts]  # fmt: skip
    loads = [heaviest(r) for r in refined]
    better = refined[loads.index(min(loads))]
    return better if heaviest(better) <= heaviest(best) else best


def brute_force_optimum(w: list[int], k: int, eq: bool) -> int:
    """The lightest heaviest part over every assignment (tiny inputs only)."""
    n = len(w)
    best = None
    for lab in product(range(k), repeat=n):
        sizes = [lab.count(p) for p in range(k)]
        if eq and max(sizes) - min(sizes) > 1:
            continue
        top = max(sum(x for x, p in zip(w, lab, strict=True) if p == q) for q in range(k))
        best = top if best is None else min(best, top)
    return best if best is not None else 0


def _weights(n: int, seed: int, shape: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "agent":  # heavy tail, whole tokens
        return np.minimum((rng.pareto(1.2, n) + 1) * 800, 32768).round()
    if shape == "flops":  # whole, all multiples of 64: the bound rounds to them
        lengths = rng.integers(1, 65, n).astype(np.float64)
        return 17408 * lengths + 64 * lengths**2
    if shape == "fractional":  # not whole numbers: no whole bound, the old path
        return rng.random(n) * 1000
    return rng.integers(0, 50, n).astype(np.float64)  # many ties


inputs = st.tuples(
    st.sampled_from([5, 40, 200, 700, 3000]),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["agent", "flops", "fractional", "ties"]),
    st.sampled_from([2, 3, 8, 11]),
    st.booleans(),
)

# ---------------------------------------------------------------- properties


def test_serpentine_deals_blocks_back_and_forth() -> None:
    assert serpentine(7, 3).tolist() == [0, 1, 2, 2, 1, 0, 0]
    for n, k in ((0, 4), (5, 8), (64, 8), (70, 8)):
        sizes = np.bincount(serpentine(n, k), minlength=k)
        assert sizes.max() - sizes.min() <= (1 if n else 0) and sizes.sum() == n


def test_transfer_rounds_keep_items_and_counts_and_never_raise_the_heaviest() -> None:
    runs = []

    @settings(max_examples=80, deadline=None)
    @given(case=inputs, target_shift=st.sampled_from([0.0, 1.0, 100.0]))
    def prop(case: tuple[int, int, str, int, bool], target_shift: float) -> None:
        n, seed, shape, k, eq = case
        w = _weights(n, seed, shape)
        ws = w[descending_order(w)]
        lab = serpentine(n, k)
        start = lab.copy()
        target = float(ws.sum()) / k + target_shift
        transfer_rounds(ws, lab, k, equal_count=eq, target=target, max_rounds=8)
        before = np.bincount(start, weights=ws, minlength=k)
        after = np.bincount(lab, weights=ws, minlength=k)
        assert lab.min() >= 0 and lab.max() < k and np.isclose(after.sum(), ws.sum())
        assert after.max() <= before.max()
        excess = lambda x: float(np.maximum(x - target, 0).sum())  # noqa: E731
        assert excess(after) <= excess(before) + 1e-6 * float(ws.sum())
        if eq:
            assert sorted(np.bincount(lab, minlength=k)) == sorted(np.bincount(start, minlength=k))
        runs.append(int((lab != start).any()))

    prop()
    assert len(runs) >= 60 and sum(runs) >= 20


def test_whole_bound_is_a_lower_bound() -> None:
    rng = np.random.default_rng(5)
    tight = 0
    for trial in range(150):
        n, k, eq = int(rng.integers(1, 8)), int(rng.integers(2, 4)), bool(trial % 2)
        w = (rng.integers(0, 12, n) * int(rng.choice([1, 3, 64]))).tolist()
        ws = np.array(sorted(w, reverse=True), dtype=np.float64)
        bound = whole_bound(ws, k, equal_count=eq)
        assert bound is not None and bound >= lower_bound(ws, k, equal_count=eq)
        best = brute_force_optimum(w, k, eq)
        assert bound <= best
        tight += bound == best
    assert tight >= 100  # it usually is the optimum: reaching it ends the search
    assert whole_bound(np.array([64.0, 128, 192])[::-1].copy(), 2, equal_count=False) == 192.0
    assert whole_bound(np.array([1.5, 1.0]), 2, equal_count=False) is None
    assert whole_bound(np.array([2.0**52, 2.0**52]), 2, equal_count=False) is None


def test_auto_never_heavier_than_before_and_unchanged_unless_lighter_or_optimal() -> None:
    changed = []

    @settings(max_examples=120, deadline=None)
    @given(case=inputs)
    def prop(case: tuple[int, int, str, int, bool]) -> None:
        n, seed, shape, k, eq = case
        w = _weights(n, seed, shape)
        order = descending_order(w)
        ws = w[order]
        new = balance_labels(w, k, equal_count=eq)[order]
        old = auto_before(ws, k, eq)
        top_new = np.bincount(new, weights=ws, minlength=k).max()
        top_old = np.bincount(old, weights=ws, minlength=k).max()
        assert top_new <= top_old
        if not np.array_equal(new, old):  # a different plan only where it is better or optimal
            bound = whole_bound(ws, k, equal_count=eq)
            assert top_new < top_old or (bound is not None and top_new <= bound)
            changed.append(shape)
        if eq:
            sizes = np.bincount(new, minlength=k)
            assert sizes.max() - sizes.min() <= 1

    prop()
    assert len(changed) >= 20  # the new paths really ran


def test_deal_reaches_the_bound_on_many_items_per_part() -> None:
    dealt = proved = cases = 0
    for seed, (n, k) in product(range(5), ((4096, 8), (16384, 64), (8192, 16))):
        w = _weights(n, seed, "agent")
        ws = w[descending_order(w)]
        for eq in (False, True):
            bound = whole_bound(ws, k, equal_count=eq)
            assert bound is not None
            lab = deal(ws, k, equal_count=eq, target=bound)
            dealt += np.bincount(lab, weights=ws, minlength=k).max() <= bound
            auto = balance_labels(w, k, equal_count=eq)
            proved += np.bincount(auto, weights=w, minlength=k).max() <= bound
            cases += 1
            if eq:
                assert np.ptp(np.bincount(lab, minlength=k)) <= 1
    assert cases == 30 and dealt >= 18 and proved >= 28  # the rounds alone, then ``auto``
