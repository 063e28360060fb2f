"""``deal_exact`` (equal counts, exact swaps) and the other issue-23 aim-3 fast paths against
slow, obvious references: the pair search against every pair, KK's link reading against the
textbook KK, and ``auto`` with the exact path never heavier than without it."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_refs import reference_kk

from rolltool.errors import RolltoolError
from rolltool.plan.partition import balance, balance_labels
from rolltool.plan.partition import kk as kk_module
from rolltool.plan.partition.balance import (
    EXACT_PER_PART,
    METHODS,
    STABLE_SORT_MAX,
    _descending,
    descending_order,
    refined_and_lpt_labels,
    whole_bound,
)
from rolltool.plan.partition.deal import (
    _repick,
    deal_exact,
    exact_pairs,
)
from rolltool.plan.partition.kk import PY_LINKS_MAX, kk_sorted, kk_sorted_top

balance_module = importlib.import_module("rolltool.plan.partition.balance")  # (the package's
# ``balance`` is the function)

# ---------------------------------------------------------------- references


def best_pair_reference(
    items: np.ndarray, a: int, b: int, least: float, most: float
) -> float | None:
    """Every pair (x of part a, y of part b): the smallest x - y in [least, most], else the
    largest x - y in (0, least); None where there is neither."""
    d = [x - y for x in items[a].tolist() for y in items[b].tolist()]
    inside = [v for v in d if least <= v <= most]
    if inside:
        return min(inside)
    below = [v for v in d if 0 < v < least]
    return max(below) if below else None


def _weights(n: int, seed: int, shape: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if shape == "agent":
        return np.minimum((rng.pareto(1.2, n) + 1) * 800, 32768).round()
    if shape == "ties":
        return rng.integers(1, 6, n).astype(np.float64)
    return rng.integers(200, 8000, n).astype(np.float64)


# ---------------------------------------------------------------- the pair search


def test_exact_pairs_equal_every_pair() -> None:
    found = []

    @settings(max_examples=150, deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        k=st.integers(2, 9),
        m=st.integers(1, 12),
        spread=st.sampled_from([3, 40, 1000]),
        sorted_rows=st.booleans(),
    )
    def prop(seed: int, k: int, m: int, spread: int, sorted_rows: bool) -> None:
        rng = np.random.default_rng(seed)
        items = rng.integers(0, spread, (k, m)).astype(np.float64)
        if sorted_rows:
            items = -np.sort(-items, axis=1)
        nt = int(rng.integers(1, 2 * k))
        src = rng.integers(0, k, nt).tolist()
        dst = [(a + int(rng.integers(1, k))) % k for a in src]  # another part
        least = rng.integers(1, spread + 2, nt).astype(float).tolist()
        most = [lo + float(rng.integers(0, 4)) for lo in least]
        cand, x_col, planned = exact_pairs(items, src, dst, least, most, rows_sorted=sorted_rows)
        for t, (a, b) in enumerate(zip(src, dst, strict=True)):
            want = best_pair_reference(items, a, b, least[t], most[t])
            c = int(planned[t])
            assert c == pick_reference(cand[t].tolist(), least[t], most[t])
            if want is None:
                assert c == -1
                continue
            assert c >= 0 and cand[t, c] == want
            x, y = items[a, x_col(t, c)], items[b, c % m]  # the pair really is there
            assert x - y == want
            found.append(want >= least[t])

    prop()
    assert len(found) >= 300 and 0 < sum(found) < len(found)  # both kinds of pick were made


# ---------------------------------------------------------------- deal_exact


def test_deal_exact_keeps_counts_and_reaches_the_target_or_says_so() -> None:
    reached = cases = 0
    for seed in range(12):
        for n, k, shape in ((1024, 8, "agent"), (512, 4, "uniform"), (2048, 16, "agent"),
                            (384, 3, "ties"), (1024, 2, "uniform")):  # fmt: skip
            w = _weights(n, seed, shape)
            ws = w[descending_order(w)]
            target = whole_bound(ws, k, equal_count=True)
            assert target is not None
            rows = deal_exact(ws, k, target=target)
            cases += 1
            if rows is None:
                continue
            assert rows.shape == (k, n // k)  # equal counts, every item once
            assert np.array_equal(np.sort(rows, axis=None), np.arange(n))
            assert max(sum(ws[i] for i in row) for row in rows.tolist()) <= target
            reached += 1
    assert cases == 60 and reached >= 45  # it usually gets there: then the split is optimal


def test_auto_with_the_exact_path_is_never_heavier_than_the_paths_it_skips() -> None:
    """Where ``deal_exact`` applies, ``auto`` keeps it only at ``whole_bound``: no split is
    lighter, so never heavier than ``refined`` or the deal path (it is the optimum)."""
    used = 0
    lo, hi = EXACT_PER_PART
    for seed in range(40):
        rng = np.random.default_rng(seed)
        k = int(rng.choice([2, 4, 8, 16]))
        m = int(rng.integers(lo, hi + 1))
        w = _weights(m * k, seed, ["agent", "uniform", "ties"][seed % 3])
        labels = balance_labels(w, k, equal_count=True)
        assert np.bincount(labels, minlength=k).tolist() == [m] * k
        ws = w[descending_order(w)]
        top = np.bincount(labels, weights=w, minlength=k).max()
        bound = whole_bound(ws, k, equal_count=True)
        refined = METHODS["refined"](ws, k, True)
        assert top <= np.bincount(refined, weights=ws, minlength=k).max()
        used += bound is not None and top <= bound
    assert used >= 30


def test_balance_builds_parts_from_the_exact_rows_as_from_labels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where ``deal_exact`` answers, ``balance`` builds the parts from its rows (no labels):
    the same parts as splitting ``balance_labels``' labels, each ascending, every item once;
    the counter makes sure the rows were used."""
    answered = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal answered
        rows = deal_exact(*args, **kwargs)
        answered += rows is not None
        return rows

    monkeypatch.setattr(balance_module, "deal_exact", counted)
    lo, hi = EXACT_PER_PART
    for seed in range(30):
        rng = np.random.default_rng(seed)
        k = int(rng.choice([2, 3, 8, 16]))
        w = _weights(int(rng.integers(lo, hi + 1)) * k, seed, ["agent", "uniform"][seed % 2])
        parts = balance(w, k, equal_count=True)
        labels = balance_labels(w, k, equal_count=True)
        assert [p.tolist() for p in parts] == [np.flatnonzero(labels == p).tolist()
                                               for p in range(k)]  # fmt: skip
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(w)))
    assert answered >= 40  # (two calls per seed)


# ---------------------------------------------------------------- KK's links read in Python


def test_kk_reads_its_links_alike_below_and_above_the_python_limit() -> None:
    rng = np.random.default_rng(3)
    for n in (PY_LINKS_MAX - 1, PY_LINKS_MAX + 1):  # Python below, pointer jumping above
        for k, eq in ((3, False), (8, False), (7, True)):
            w = rng.integers(0, 1000, n).tolist()
            m = n + (-n % k if eq else 0)
            ws = np.zeros(m)
            ws[:n] = sorted(w, reverse=True)
            labels = kk_sorted(ws, k, eq)[:n]
            got = sorted(sorted(np.flatnonzero(labels == p).tolist()) for p in range(k))
            ref = reference_kk(sorted(w, reverse=True), k, eq)
            assert got == sorted(sorted(s) for s in ref)


def test_kk_labels_equal_the_textbook_slot_for_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """KK's labels (not only its parts) are the textbook's slot order, and the heaviest part
    ``kk_sorted_top`` reports is the labels' heaviest, on inputs with many ties and zero
    weights, where the singleton-first shortcut must give way to the merge; the counters make
    sure the shortcut, its way out and the zero-weight naming all ran."""
    calls = {"shortcut": 0, "merge": 0, "zero names": 0}
    first, names = kk_module._singleton_first, kk_module._names_with_empty

    def counted_first(*args: Any) -> int:
        p = first(*args)
        calls["shortcut" if p >= 0 else "merge"] += 1
        return p

    def counted_names(ia: tuple[int, ...], *args: Any) -> Any:
        calls["zero names"] += ia.count(-1) != len(ia) - ia.index(-1)
        return names(ia, *args)

    monkeypatch.setattr(kk_module, "_singleton_first", counted_first)
    monkeypatch.setattr(kk_module, "_names_with_empty", counted_names)
    rng = np.random.default_rng(7)
    for trial in range(600):
        n, k, eq = int(rng.integers(1, 200)), int(rng.integers(2, 10)), trial % 4 == 0
        w = sorted(rng.integers(0, [3, 50, 5000][trial % 3], n).astype(float).tolist())[::-1]
        ws = np.array(w + [0.0] * (-n % k if eq else 0))
        labels = kk_sorted(ws, k, eq)[:n]
        full, top = kk_sorted_top(ws, k, eq)  # whole numbers: its own sum is the heaviest part
        assert np.array_equal(full[:n], labels)
        assert top == np.bincount(full, weights=ws, minlength=k).max()
        want = np.empty(n, dtype=np.int64)
        for part, items in enumerate(reference_kk(w, k, eq)):
            want[sorted(items)] = part
        assert np.array_equal(labels, want), (trial, n, k, eq)
    assert min(calls.values()) >= 20, calls


def test_kk_runs_equal_the_textbook_slot_for_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without equal counts KK pushes consecutive blocks in one call (``_push_blocks``), puts a
    run of singletons into the heap's top partition in place (``_insert_run``) and merges the
    rest once no singleton is left (``_merge_rest``): the textbook's labels, slot for slot, on
    heavy-tailed, tied and zero weights with k up to 300 (labels read as bytes up to 256 parts,
    as a list above); the counters make sure runs of two blocks and of two singletons or more
    ran, and blocks cut short handed to the loop's merge instead of pushed."""
    runs = {"blocks": 0, "singletons": 0, "handed over": 0}
    blocks, singletons = kk_module._push_blocks, kk_module._insert_run

    def counted_blocks(nw: list[float], i: int, hk: float, k: int, *args: Any) -> Any:
        got = blocks(nw, i, hk, k, *args)
        runs["blocks"] += got[0] - i > k  # (more than one block: more than k items)
        runs["handed over"] += got[2] is not None
        return got

    def counted_singletons(nw: list[float], i: int, *args: Any) -> Any:
        got = singletons(nw, i, *args)
        runs["singletons"] += got[0] - i >= 2
        return got

    monkeypatch.setattr(kk_module, "_push_blocks", counted_blocks)
    monkeypatch.setattr(kk_module, "_insert_run", counted_singletons)
    rng = np.random.default_rng(23)
    for trial in range(240):
        n, k = int(rng.integers(2, 400)), int(rng.choice([2, 3, 4, 8, 16, 64, 256, 257, 300]))
        shape = trial % 4
        if shape == 0:  # heavy tail, as token lengths
            w = np.minimum((rng.pareto(1.2, n) + 1) * 800, 32768).round()
        elif shape == 1:  # ties and zeros
            w = rng.integers(0, 6, n).astype(float)
        elif shape == 2:
            w = rng.integers(1, 5000, n).astype(float)
        else:  # runs of equal weights
            w = np.repeat(rng.integers(0, 300, n // 3 + 1), 3)[:n].astype(float)
        ws = np.sort(w)[::-1].copy()
        labels, top = kk_sorted_top(ws, k)
        assert top == np.bincount(labels, weights=ws, minlength=k).max()
        want = np.empty(n, dtype=np.int64)
        for part, items in enumerate(reference_kk(ws.tolist(), k, False)):
            want[sorted(items)] = part
        assert np.array_equal(labels, want), (trial, n, k)
    assert min(runs.values()) >= 20, runs


def pick_reference(row: list[float], least: float, most: float) -> int:
    """The column of the smallest x - y in [least, most], else of the largest in (0, least),
    the lowest column on ties; -1 where neither."""
    inside = [(v, c) for c, v in enumerate(row) if least <= v <= most]
    if inside:
        return min(inside)[1]
    below = [(-v, c) for c, v in enumerate(row) if 0 < v < least]
    return min(below)[1] if below else -1


def test_repick_equals_the_reference_on_one_row() -> None:
    rng = np.random.default_rng(11)
    for _ in range(2000):
        row = rng.integers(-5, 30, int(rng.integers(1, 20))).astype(np.float64)
        row[rng.random(len(row)) < 0.1] = np.inf
        row[rng.random(len(row)) < 0.05] = -np.inf  # (no pair below: ``exact_pairs``' -inf key)
        least = float(rng.integers(1, 25))
        most = least + float(rng.integers(0, 5))
        assert _repick(row, least, most) == pick_reference(row.tolist(), least, most)


def test_descending_order_is_the_stable_sort_of_the_negated_weights() -> None:
    """Every path of ``descending_order`` (16-bit keys, stable sort, packed integer keys,
    ranks) orders exactly as the stable sort does: heaviest first, ties by index; where it
    learns that the weights are whole numbers (``auto`` then skips that check), they are."""
    rng = np.random.default_rng(23)
    cases = wholes = 0
    for n in (1, 5, 1023, 1024, 2048, 2049, 5000):
        for shape in ("lengths", "ties", "wide", "halves", "fractions", "tiny"):
            if shape == "lengths":
                w = np.round(rng.lognormal(6, 1.2, n)).clip(1, 32768)
            elif shape == "ties":
                w = rng.integers(0, 4, n).astype(np.float64)
            elif shape == "wide":
                w = rng.integers(0, 1 << 40, n).astype(np.float64)
            elif shape == "halves":
                w = rng.integers(0, 50, n) + 0.5
            elif shape == "fractions":
                w = rng.integers(0, 3, n) * rng.choice([1.0, 0.1, 1e-9], n)
            else:  # below the largest weight's precision: 3 - 1e-17 rounds to 3
                w = rng.choice([3.0, 0.0, 1e-17, 2e-17], n)
            want = np.argsort(-w, kind="stable")
            assert np.array_equal(descending_order(w), want), (n, shape)
            whole = _descending(w)[1]  # and where it says the weights are whole, they are
            assert not whole or np.array_equal(w, np.trunc(w)), (n, shape)
            cases += 1
            wholes += whole
    assert cases == 42 and wholes >= 6


def test_bad_weights_raise_alike_whether_the_sort_or_a_pass_finds_them() -> None:
    """Up to ``STABLE_SORT_MAX`` weights the sorted ends show a bad weight (no pass for the least
    and largest); above it a pass does, before the sort. Either way the error names the first
    bad item, for every method's entry point."""
    rng = np.random.default_rng(5)
    raised = 0
    for n in (1, 3, 300, 1024, 1500, STABLE_SORT_MAX, STABLE_SORT_MAX + 1):
        for bad in (np.nan, np.inf, -np.inf, -1.0, -1e30, -0.5):
            for k in (1, 2, 8):
                w = rng.integers(0, 1000, n).astype(np.float64)
                w[int(rng.integers(0, n))] = bad
                first = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
                for call, kwargs in ((balance_labels, {"equal_count": True}),
                                     (balance_labels, {"method": "lpt"}),
                                     (refined_and_lpt_labels, {})):  # fmt: skip
                    with pytest.raises(RolltoolError, match=f"weight of item {first} "):
                        call(w, k, **kwargs)
                    raised += 1
    assert raised == 7 * 6 * 3 * 3
