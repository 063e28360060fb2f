"""`binpack.ffd` against the obvious first fit: each item to the first bin with room."""

from __future__ import annotations

import numpy as np
import pytest

from rolltool.plan.partition import binpack
from rolltool.plan.partition.binpack import ffd


def first_fit(tokens: list[int], cap: int) -> tuple[list[int], int]:
    """Each item (in the given order) to the first bin with room, else a new bin."""
    rooms: list[int] = []
    labels = []
    for t in tokens:
        for b, room in enumerate(rooms):
            if room >= t:
                rooms[b] -= t
                labels.append(b)
                break
        else:
            labels.append(len(rooms))
            rooms.append(cap - t)
    return labels, len(rooms)


@pytest.mark.parametrize("per_step", [1, 7, 128, 1024])
def test_ffd_is_first_fit_decreasing(per_step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"linear": 0}
    linear = binpack._ffd_linear

    def counted(tokens: list[int], cap: int) -> tuple[np.ndarray, int]:
        calls["linear"] += 1
        return linear(tokens, cap)

    monkeypatch.setattr(binpack, "_ffd_linear", counted)
    rng = np.random.default_rng(per_step)
    for seed in range(60):
        cap = int(rng.choice([64, 300, 4096, 32768]))
        if seed % 3 == 0:  # heavy tail: many bins closed early, then short items
            lengths = np.clip(rng.lognormal(np.log(cap) - 2.5, 1.2, per_step), 1, cap)
        elif seed % 3 == 1:  # few distinct lengths: many exact fits (room left 0)
            lengths = rng.choice([cap, cap // 2, cap // 3, cap // 4, 1], per_step)
        else:
            lengths = rng.integers(1, cap + 1, per_step)
        tokens = np.sort(lengths.astype(np.int64))[::-1]
        labels, bins = ffd(tokens, cap)
        want, want_bins = first_fit(tokens.tolist(), cap)
        assert labels.tolist() == want and bins == want_bins
        assert np.bincount(labels, weights=tokens).max() <= cap
    # the scan ran wherever few bins can open, the segment tree wherever many can
    assert calls["linear"] > 0 or per_step == 1024
    assert calls["linear"] < 60 or per_step < 128


def test_first_fit_fits_only_where_first_fit_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """`first_fit_fits` says True only where first fit (in the given order) takes at most that
    many bins. Counted: both answers, and the unsure first items packed, each many times."""
    rng = np.random.default_rng(23)
    said = {"true": 0, "false": 0, "packed": 0}
    real_ffd = binpack.ffd

    def counted(tokens: np.ndarray, cap: int) -> tuple[np.ndarray, int]:
        said["packed"] += 1
        return real_ffd(tokens, cap)

    monkeypatch.setattr(binpack, "ffd", counted)
    for seed in range(3000):
        n = int(rng.integers(0, 200))
        cap = int(rng.choice([8, 64, 300, 32768]))
        tokens = np.clip(rng.lognormal(np.log(cap) - 2.5, 1.2, n), 0, cap).astype(np.int64)
        if seed % 2:  # longest first, as the planner has them
            tokens = np.sort(tokens)[::-1]
        for bins in {0, 1, -(-int(tokens.sum()) // cap), real_ffd(tokens, cap)[1], 5}:
            yes = binpack.first_fit_fits(tokens, cap, bins)
            said["true" if yes else "false"] += 1
            if yes:
                assert first_fit(tokens.tolist(), cap)[1] <= bins, (seed, bins)
    assert min(said.values()) > 100, said


def test_first_fit_fits_examples() -> None:
    fits = binpack.first_fit_fits
    assert fits(np.array([7, 5, 3, 2]), 10, 2)
    assert not fits(np.array([6, 6, 6]), 10, 2)
    assert fits(np.array([10, 10, 2, 2, 2, 1, 1, 1]), 10, 3)  # the two 10s packed, the rest fit
    assert not fits(np.array([10, 10, 2, 2, 2, 1, 1, 1]), 10, 2)
    assert fits(np.zeros(0, np.int64), 10, 0) and not fits(np.array([1]), 10, 0)
    # an item over the cap fits no bin: never "fits", though ffd would count it one bin
    assert not fits(np.array([12, 1, 1, 1, 1, 1, 1, 1]), 10, 3)
