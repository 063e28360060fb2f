"""Refinement: the exhaustive pairwise search equals a slow reference, ``auto`` is never heavier
than KK followed by that search, the budgeted engine keeps every guarantee."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.plan.partition import balance_labels, plan_step
from rolltool.plan.partition.refine import refine, refine_pairs, stuck
from rolltool.plan.workload import Workload

# ---------------------------------------------------------------- slow, obvious reference


def reference_pairwise(w: list[float], labels: list[int], k: int, equal_count: bool) -> list[int]:
    """Repeat until no pair of parts has one: take the parts a heaviest first (ties by index),
    for each the lighter parts b lightest first; the first pair with a swap or move that lowers
    max(L_a, L_b) applies the one that lowers it most (first found on ties: items in order, a
    move last). Moves: always when counts are free, else from a part with more items."""
    lab = list(labels)
    n = len(w)
    while True:
        loads, size = [0.0] * k, [0] * k
        for i in range(n):
            loads[lab[i]] += w[i]
            size[lab[i]] += 1
        step = None
        for a in sorted(range(k), key=lambda p: (-loads[p], p)):
            for b in sorted(range(k), key=lambda p: (loads[p], p)):
                if not loads[b] < loads[a] or step is not None:
                    break
                ys: list[int | None] = [y for y in range(n) if lab[y] == b]
                if not equal_count or size[a] > size[b]:
                    ys.append(None)
                best = None
                for x in (x for x in range(n) if lab[x] == a):
                    for y in ys:
                        d = w[x] - (w[y] if y is not None else 0.0)
                        v = max(loads[a] - d, loads[b] + d)
                        if 0 < d < loads[a] - loads[b] and (best is None or v < best[0]):
                            best = (v, x, y)
                if best is not None:
                    step = (a, b, best[1], best[2])
            if step is not None:
                break
        if step is None:
            return lab
        a, b, x, y = step
        lab[x] = b
        if y is not None:
            lab[y] = a


def max_load(w: np.ndarray, labels: np.ndarray | list[int], k: int) -> float:
    return float(np.bincount(np.asarray(labels), weights=w, minlength=k).max()) if len(w) else 0.0


def kk_then_pairwise(w: np.ndarray, k: int, equal_count: bool) -> float:
    """The heaviest part of KK (``balance``'s own) followed by the reference search."""
    order = np.argsort(-w, kind="stable")
    kk = balance_labels(w, k, equal_count=equal_count, method="kk")[order]
    return max_load(w[order], reference_pairwise(w[order].tolist(), kk.tolist(), k, equal_count), k)


def _weights(n: int, seed: int, top: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, top + 1, n).astype(np.float64)


small_weights = st.builds(
    _weights, st.integers(0, 36), st.integers(0, 2**32 - 1), st.sampled_from([3, 50, 1000])
) | st.lists(st.integers(0, 1000), max_size=10).map(lambda xs: np.array(xs, dtype=np.float64))

# ---------------------------------------------------------------- properties


def test_refine_pairs_equals_the_slow_reference() -> None:
    runs = []

    @settings(max_examples=120, deadline=None)
    @given(w=small_weights, k=st.integers(2, 7), seed=st.integers(0, 2**16), eq=st.booleans())
    def prop(w: np.ndarray, k: int, seed: int, eq: bool) -> None:
        ws = np.sort(w)[::-1].copy()
        start = np.random.default_rng(seed).integers(0, k, len(ws))  # any start, also lopsided
        if eq:
            start = np.arange(len(ws)) % k  # sizes n // k or n // k + 1
        got = refine_pairs(ws, start, k, equal_count=eq, max_steps=10**6, max_work=10**9)
        want = reference_pairwise(ws.tolist(), start.tolist(), k, eq)
        assert got.tolist() == want
        if eq:
            assert sorted(np.bincount(got, minlength=k)) == sorted(np.bincount(start, minlength=k))
        runs.append(int((got != start).any()))

    prop()
    assert len(runs) >= 100 and sum(runs) >= 30  # the search really moved items


def test_auto_never_heavier_than_kk_then_pairwise_search() -> None:
    runs = []

    @settings(max_examples=120, deadline=None)
    @given(w=small_weights, k=st.integers(2, 8), eq=st.booleans())
    def prop(w: np.ndarray, k: int, eq: bool) -> None:
        auto = balance_labels(w, k, equal_count=eq)
        assert max_load(w, auto, k) <= kk_then_pairwise(w, k, eq)
        runs.append(len(w))

    prop()
    assert len(runs) >= 100 and max(runs) > 25


PRIME_RL = Workload(kind="calibrated", a=17408.0, b=64.0)
"""prime-rl's cost per sample in its randomized packing tests: 17408·L + 64·L²."""


def prime_rl_cases(count: int, seed: int = 0) -> list[tuple[np.ndarray, int, int]]:
    """Randomized cases in the spirit of prime-rl's: 2-8 ranks, a cap of 8-64 tokens per
    micro-batch, 19-64 samples of 1..cap tokens; (lengths, ranks, cap)."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        dp, cap, n = int(rng.integers(2, 9)), int(rng.integers(8, 65)), int(rng.integers(19, 65))
        cases.append((rng.integers(1, cap + 1, n), dp, cap))
    return cases


def test_align_total_never_heavier_than_kk_then_pairwise_on_prime_rl_cases() -> None:
    improved = 0
    for lengths, dp, cap in prime_rl_cases(80):
        plan = plan_step(lengths, dp=dp, max_tokens=cap, workload=PRIME_RL, align="total")
        cost = PRIME_RL.cost(lengths)
        heaviest = float(plan.costs.sum(axis=1).max())
        assert heaviest <= kk_then_pairwise(cost, dp, False)
        kk = max_load(cost, balance_labels(cost, dp, method="kk"), dp)
        improved += heaviest < kk
    assert improved >= 20  # KK alone is beaten often: the comparison is not vacuous


def test_budgeted_refine_keeps_counts_items_and_never_raises_the_maximum() -> None:
    rng = np.random.default_rng(3)
    steps = 0
    for trial in range(40):
        n, k = int(rng.integers(300, 3000)), int(rng.choice([2, 7, 16, 64]))
        ws = np.sort(np.minimum((rng.pareto(1.2, n) + 1) * 800, 32768).round())[::-1].copy()
        eq = bool(trial % 2)
        start = np.arange(n) % k if eq else rng.integers(0, k, n)
        got = refine(ws, start, k, equal_count=eq, max_steps=4 * k + 64, max_work=1 << 16)
        assert got.shape == (n,) and got.min() >= 0 and got.max() < k
        assert max_load(ws, got, k) <= max_load(ws, start, k)
        if eq:  # sizes stay n // k or n // k + 1
            assert sorted(np.bincount(got, minlength=k)) == sorted(np.bincount(start, minlength=k))
        steps += int((got != start).sum())
    assert steps > 0


def test_balancing_two_other_parts_unsticks_the_heaviest() -> None:
    # Found by a random search: refining only the heaviest part against the others stops at 38
    # here; exchanges between the other parts open new steps for the heaviest one: 36.
    ws = np.array([29.0, 28, 18, 10, 8, 6, 5])
    start = np.array([2, 1, 1, 2, 2, 2, 2])  # loads 0 | 46 | 58
    kw: dict = {"equal_count": False, "max_steps": 100, "max_work": 10**6}
    assert max_load(ws, refine(ws, start, 3, others=False, **kw), 3) == 38
    assert max_load(ws, refine(ws, start, 3, **kw), 3) == 36
    assert max_load(ws, refine_pairs(ws, start, 3, **kw), 3) == 36


def has_step(w: np.ndarray, labels: np.ndarray, k: int, equal_count: bool) -> bool:
    """Some swap or move between two parts lowers their maximum (by brute force)."""
    loads, sizes = np.bincount(labels, weights=w, minlength=k), np.bincount(labels, minlength=k)
    for a in range(k):
        for b in range(k):
            g = loads[a] - loads[b]
            xs, ys = w[labels == a], w[labels == b]
            d = xs[:, None] - ys[None, :]
            if ((d > 0) & (d < g)).any():
                return True
            if (not equal_count or sizes[a] > sizes[b]) and ((xs > 0) & (xs < g)).any():
                return True
    return False


def test_stuck_is_exact_where_it_answers() -> None:
    rng = np.random.default_rng(5)
    answers = {True: 0, False: 0}
    for trial in range(600):
        n, k, eq = int(rng.integers(1, 60)), int(rng.integers(2, 7)), bool(trial % 2)
        w = np.sort(rng.integers(0, int(rng.choice([3, 10, 1000])), n).astype(np.float64))[::-1]
        labels = np.arange(n) % k if eq else rng.integers(0, k, n)
        if trial % 3:  # mostly states a search left: stuck or nearly
            labels = refine_pairs(w, labels, k, equal_count=eq, max_steps=trial % 7 + 1,
                                  max_work=10**9)  # fmt: skip
        loads = np.bincount(labels, weights=w, minlength=k)
        got = stuck(w, labels, loads, equal_count=eq)
        assert got == (not has_step(w, labels, k, eq))
        answers[got] += 1
    assert min(answers.values()) >= 100


def test_stuck_says_false_where_it_cannot_prove() -> None:
    # unsorted weights (its pair windows need them heaviest first: this one raised in np.repeat),
    # and a stuck state with more (item, part) moves than STUCK_PAIRS (it built a 4,096 x 512
    # matrix to say True): False, never an error; refine on unsorted weights runs on
    w = np.array([9.0, 8.0, 16.0, 5.0, 12.0, 15.0, 8.0, 13.0, 3.0])
    labels = np.array([1, 0, 0, 0, 0, 1, 1, 1, 0])
    assert not stuck(w, labels, np.bincount(labels, weights=w, minlength=2), equal_count=False)
    out = refine(w, labels, 2, equal_count=False, max_steps=64, max_work=1 << 14)
    assert np.bincount(out, weights=w, minlength=2).max() <= 45.0  # 89 over 2: 44.5 at best
    k = 512
    many = np.array([12300.0] * (k - 1) + [3.0] * 4096)  # sorted; the 3s fill the lightest part
    parts = np.concatenate([np.arange(1, k), np.zeros(4096, dtype=np.int64)])
    loads = np.bincount(parts, weights=many, minlength=k)
    assert not stuck(many, parts, loads, equal_count=False)
