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
