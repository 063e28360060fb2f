"""rolltool.integrations.verl: verl's signatures, partition properties, and a slow verl-style KK
reference (verl itself is not installable here; compared with it only when importable)."""

from __future__ import annotations

import heapq
import inspect
import math
import sys

import numpy as np
import pytest

from rolltool.errors import RolltoolError
from rolltool.integrations import verl as rv


def reference_kk(w: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Slow, obvious largest-differencing (KK) as verl describes it: sorted items, k-way states
    merged heaviest-spread first; with equal_size, k items at a time seed one state."""
    items = sorted(range(len(w)), key=lambda i: (w[i], i))
    heap: list[tuple[int, int, list[list[int]], list[int]]] = []
    step = k if equal_size else 1
    for n, s in enumerate(range(0, len(items), step)):
        group = items[s : s + step]
        parts = [[i] for i in group] + [[] for _ in range(k - len(group))]
        sums = [sum(w[i] for i in p) for p in parts]
        heapq.heappush(heap, (-(max(sums) - min(sums)), n, parts, sums))
    n = len(heap)
    while len(heap) > 1:
        _, _, pa, sa = heapq.heappop(heap)
        _, _, pb, sb = heapq.heappop(heap)
        oa = sorted(range(k), key=lambda j: -sa[j])  # heaviest of a with lightest of b
        ob = sorted(range(k), key=lambda j: sb[j])
        parts = [pa[oa[j]] + pb[ob[j]] for j in range(k)]
        sums = [sa[oa[j]] + sb[ob[j]] for j in range(k)]
        n += 1
        heapq.heappush(heap, (-(max(sums) - min(sums)), n, parts, sums))
    return [sorted(p) for p in heap[0][2]]


def _check_partition(parts: list[list[int]], n: int, k: int) -> None:
    assert len(parts) == k
    assert all(isinstance(i, int) for p in parts for i in p)
    assert all(p == sorted(p) and p for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(n))


def test_signatures_match_verl() -> None:
    sig = inspect.signature(rv.get_seqlen_balanced_partitions)
    assert list(sig.parameters) == ["seqlen_list", "k_partitions", "equal_size"]
    assert all(p.default is inspect.Parameter.empty for p in sig.parameters.values())
    assert sig.return_annotation == "list[list[int]]"
    mb = inspect.signature(rv.get_micro_batch_partitions)
    assert list(mb.parameters)[:4] == [
        "seqlen_list", "max_token_len", "dp_group_max_count", "same_micro_num_in_dp"
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("equal_size", [False, True])
def test_balanced_partitions_properties_and_quality(seed: int, equal_size: bool) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 9))
    n = k * int(rng.integers(1, 12)) + (0 if equal_size else int(rng.integers(0, k)))
    w = rng.integers(1, 20000, n).tolist()
    parts = rv.get_seqlen_balanced_partitions(w, k, equal_size)
    _check_partition(parts, n, k)
    if equal_size:
        assert {len(p) for p in parts} == {n // k}
    assert parts == rv.get_seqlen_balanced_partitions(list(w), k, equal_size)  # deterministic
    heaviest = max(sum(w[i] for i in p) for p in parts)
    ref = reference_kk(w, k, equal_size)
    _check_partition(ref, n, k)
    assert heaviest <= max(sum(w[i] for i in p) for p in ref) * (1 + 1e-9)


def test_balanced_partitions_assertions_like_verl() -> None:
    with pytest.raises(AssertionError):
        rv.get_seqlen_balanced_partitions([1, 2], 3, False)
    with pytest.raises(AssertionError):
        rv.get_seqlen_balanced_partitions([1, 2, 3], 2, True)
    parts = rv.get_seqlen_balanced_partitions([0, 0, 0, 5], 3, False)  # zero weights: no empty
    _check_partition(parts, 4, 3)


@pytest.mark.parametrize("seed", range(5))
def test_micro_batches_cap_count_and_alignment(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cap = 16384
    ranks = [rng.integers(100, cap + 1, int(rng.integers(40, 60))).tolist() for _ in range(4)]
    counts = [rv.num_micro_batches(r, cap) for r in ranks]
    for r, c in zip(ranks, counts, strict=True):
        assert c >= math.ceil(sum(r) / cap)
    target = max(counts)
    for r in ranks:
        parts = rv.get_micro_batch_partitions(r, cap, dp_group_max_count=target)
        assert len(parts) == target  # the same count on every rank
        _check_partition(parts, len(r), target)
        assert all(sum(r[i] for i in p) <= cap for p in parts)  # the hard cap
        cost = [sum(24576 * r[i] + r[i] ** 2 for i in p) for p in parts]
        assert cost == sorted(cost, reverse=True)  # heaviest first: slot j lines up across ranks
        assert parts == rv.get_micro_batch_partitions(r, cap, dp_group_max_count=target)
        alone = rv.get_micro_batch_partitions(r, cap, target, same_micro_num_in_dp=False)
        assert len(alone) == rv.num_micro_batches(r, cap)


def test_micro_batches_errors() -> None:
    with pytest.raises(RolltoolError):
        rv.get_micro_batch_partitions([10, 20], 100, dp_group_max_count=3)
    with pytest.raises(RolltoolError):
        rv.get_micro_batch_partitions([10, 200], 100)
    assert rv.get_micro_batch_partitions([], 100) == []


def test_patch_without_verl_is_a_clear_error() -> None:
    try:
        import verl.utils.seqlen_balancing  # noqa: F401
    except ImportError:
        with pytest.raises(RolltoolError, match="not importable"):
            rv.patch()
    else:
        pytest.skip("verl is installed: see test_against_real_verl")


def test_against_real_verl() -> None:
    sb = pytest.importorskip("verl.utils.seqlen_balancing")
    theirs = inspect.signature(sb.get_seqlen_balanced_partitions)
    assert list(theirs.parameters) == ["seqlen_list", "k_partitions", "equal_size"]
    rng = np.random.default_rng(0)
    w = rng.integers(1, 20000, 64).tolist()
    for eq in (False, True):
        ours = rv.get_seqlen_balanced_partitions(w, 8, eq)
        ref = sb.get_seqlen_balanced_partitions(w, 8, eq)
        assert max(sum(w[i] for i in p) for p in ours) <= max(sum(w[i] for i in p) for p in ref)
    original, patched = sb.get_seqlen_balanced_partitions, []
    try:
        patched = rv.patch()
        assert VERL in patched
        assert sb.get_seqlen_balanced_partitions is rv.get_seqlen_balanced_partitions
    finally:
        for name in patched:
            sys.modules[name].get_seqlen_balanced_partitions = original  # type: ignore[attr-defined]


VERL = rv.VERL_MODULE
