from __future__ import annotations

import numpy as np

from rolltool.util.ranges import concat_ranges, cut, slices


def test_concat_ranges_equals_the_concatenated_aranges() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(0, 8))
        starts = rng.integers(-5, 50, k)
        lengths = rng.integers(0, 6, k)
        slow = [np.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        want = np.concatenate([np.zeros(0, np.int64), *slow]).astype(np.int64)
        got = concat_ranges(starts, lengths)
        assert got.dtype == np.int64 and np.array_equal(got, want)


def test_slices_cover_the_range_once_in_order() -> None:
    for n in (0, 1, 5, 6, 7, 100):
        for size in (1, 2, 3, 7, 200):
            parts = slices(n, size)
            assert np.concatenate(
                [np.arange(n)[p] for p in parts] or [np.zeros(0)]
            ).tolist() == list(range(n))
            assert all(p.stop - p.start == size for p in parts[:-1])
            assert not parts or 0 < parts[-1].stop - parts[-1].start <= size


def test_cut_equals_np_split_at_the_running_sums() -> None:
    """Views (no copies) of consecutive pieces, empty ones included, as ``np.split`` gives."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        sizes = rng.integers(0, 5, int(rng.integers(0, 7))).tolist()
        a = rng.integers(0, 100, sum(sizes))
        got = cut(a, sizes)
        want = np.split(a, np.cumsum(sizes)[:-1]) if sizes else []
        assert [p.tolist() for p in got] == [p.tolist() for p in want]
        assert all(p.base is a for p in got if len(p))
