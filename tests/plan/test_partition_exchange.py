"""Exchanges of up to two items for up to two (``refine_subsets``) against a slow reference, and
``align="total"`` against prime-rl's own packing on prime-rl's own randomized test (issue 23)."""

from __future__ import annotations

from itertools import combinations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from primerl_ref import heaviest_worker, prepare_batch, randomized_cases

from rolltool.plan.partition import plan_step
from rolltool.plan.partition.exchange import refine_subsets
from rolltool.plan.workload import Workload

# ---------------------------------------------------------------- slow, obvious reference


def reference_subsets(w: list[float], labels: list[int], k: int, equal_count: bool) -> list[int]:
    """Repeat: the heaviest part a (lowest index on ties) and, lightest first, each lighter part
    b; every X of 0-2 items of a and Y of 0-2 items of b (each list: the empty set, single items,
    pairs, in index order), d = ΣX - ΣY with 0 < d < L_a - L_b (with equal counts |X| - |Y| is
    0 or the sign of a's items minus b's); the first b with one applies the one with the lowest
    max(L_a - d, L_b + d), ties to the larger d, then the first X, then the first Y."""
    lab = list(labels)
    while True:
        loads = [sum(x for x, p in zip(w, lab, strict=True) if p == q) for q in range(k)]
        size = [lab.count(q) for q in range(k)]
        a = min(range(k), key=lambda q: (-loads[q], q))
        step = None
        for b in sorted(range(k), key=lambda q: (loads[q], q)):
            if not loads[b] < loads[a]:
                break
            xs = _subsets([i for i in range(len(w)) if lab[i] == a])
            ys = _subsets([i for i in range(len(w)) if lab[i] == b])
            more = int(np.sign(size[a] - size[b]))
            best = None
            for xi, x in enumerate(xs):
                for yi, y in enumerate(ys):
                    d = sum(w[i] for i in x) - sum(w[i] for i in y)
                    if not 0 < d < loads[a] - loads[b]:
                        continue
                    if equal_count and len(x) - len(y) not in {0, more}:
                        continue
                    key = (max(loads[a] - d, loads[b] + d), -d, xi, yi)
                    if best is None or key < best[0]:
                        best = (key, x, y)
            if best is not None:
                step = (b, best[1], best[2])
                break
        if step is None:
            return lab
        b, x, y = step
        for i in x:
            lab[i] = b
        for i in y:
            lab[i] = a


def _subsets(items: list[int]) -> list[tuple[int, ...]]:
    return [(), *((i,) for i in items), *combinations(items, 2)]


# ---------------------------------------------------------------- properties


def test_refine_subsets_equals_the_slow_reference() -> None:
    runs = []

    @settings(max_examples=100, deadline=None)
    @given(
        w=st.lists(st.integers(0, 60), min_size=0, max_size=14),
        k=st.integers(2, 4),
        seed=st.integers(0, 2**16),
        eq=st.booleans(),
    )
    def prop(w: list[int], k: int, seed: int, eq: bool) -> None:
        ws = np.array(sorted(w, reverse=True), dtype=np.float64)
        start = np.random.default_rng(seed).integers(0, k, len(ws))
        if eq:
            start = np.arange(len(ws)) % k
        got = refine_subsets(ws, start, k, equal_count=eq, max_steps=10**6, max_work=10**12)
        assert got.tolist() == reference_subsets(ws.tolist(), start.tolist(), k, eq)
        heaviest = np.bincount(got, weights=ws, minlength=k).max() if len(ws) else 0.0
        assert heaviest <= (np.bincount(start, weights=ws, minlength=k).max() if len(ws) else 0)
        if eq:
            assert sorted(np.bincount(got, minlength=k)) == sorted(np.bincount(start, minlength=k))
        runs.append(int((got != start).any()))

    prop()
    assert len(runs) >= 80 and sum(runs) >= 20  # the exchanges really moved items


def test_worked_example_needs_an_exchange_of_two_for_one() -> None:
    ws = np.array([8.0, 7, 6, 3, 2, 2])
    start = np.array([0, 1, 1, 0, 1, 0])  # {8, 3, 2 | 7, 6, 2} = 13 | 15
    got = refine_subsets(ws, start, 2, equal_count=False, max_steps=10, max_work=10**6)
    assert np.bincount(got, weights=ws).tolist() == [14.0, 14.0]


def test_align_total_never_heavier_than_prime_rl_on_its_own_randomized_test() -> None:
    """All 80 draws of prime-rl's ``test_randomized_packing_invariants`` (FLOPs costs on even
    cases, tokens on odd ones): rolltool's heaviest rank against prime-rl's ``prepare_batch``
    (its dummies weigh nothing here, the strictest comparison)."""
    cases = list(randomized_cases())
    lighter = flops = more_micro_batches = 0
    for case in cases:
        lengths = np.array(case.lengths)
        linear, quadratic = case.coeffs
        wl = Workload(kind="calibrated", a=float(linear), b=float(quadratic))
        plan = plan_step(lengths, dp=case.workers, max_tokens=case.seq_len, workload=wl,
                         align="total")  # fmt: skip
        ours = float(plan.costs.sum(axis=1).max())
        layout = prepare_batch(case)
        theirs = heaviest_worker(layout, case)
        assert ours <= theirs, (case.index, ours, theirs)
        more_micro_batches += plan.num_micro_batches > len(layout[0])
        lighter += ours < theirs
        flops += quadratic > 0
    assert len(cases) == 80 and flops == 40
    assert lighter >= 20  # the comparison is not vacuous: prime-rl is often beaten outright
    assert more_micro_batches <= 4  # one micro-batch more than prime-rl's: 4 before issue 23, 2 now
