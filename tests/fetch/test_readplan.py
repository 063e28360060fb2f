"""The read amplification of a plan (`rolltool.fetch.readplan`) against a slow simulation of the
reader, and as pack records it (with the path it takes)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from pack_helpers import pack

from rolltool.fetch.readplan import DECODED_BYTES_PER_TOKEN, read_plan

EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"


def simulate(starts, sizes, lengths, steps, cache_bytes):  # type: ignore[no-untyped-def]
    """The reader, slowly: per step, its row groups in ascending order; the last decoded one
    kept; an LRU cache filled in input order first."""
    n = len(lengths)
    block = [max(b for b in range(len(starts)) if starts[b] <= i) for i in range(n)]
    tokens = [sum(lengths[i] for i in range(n) if block[i] == b) for b in range(len(starts))]
    dec = [t * DECODED_BYTES_PER_TOKEN for t in tokens]
    cache: OrderedDict[int, int] = OrderedDict()
    for b in range(len(starts)):
        if sum(cache.values()) + dec[b] > cache_bytes:
            break
        cache[b] = dec[b]
    read = cached = 0
    last = None
    for members in steps:
        for b in sorted({block[i] for i in members}):
            if b == last:
                continue
            read += sizes[b]
            if b in cache:
                cache.move_to_end(b)
            else:
                cached += sizes[b]
                while cache and sum(cache.values()) + dec[b] > cache_bytes:
                    cache.popitem(last=False)
                if dec[b] <= cache_bytes:
                    cache[b] = dec[b]
        if len(members):
            last = max(block[i] for i in members)
    return read, cached


@pytest.mark.parametrize("seed", range(12))
def test_reads_equal_a_slow_simulation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 80))
    lengths = rng.integers(1, 30, n)
    starts = np.unique(np.concatenate([[0], rng.integers(1, n, rng.integers(1, 8))]))
    sizes = rng.integers(50, 500, len(starts))
    order = rng.permutation(n)
    steps = np.array_split(order, int(rng.integers(1, 8)))
    cache = int(rng.integers(0, int(lengths.sum()) * DECODED_BYTES_PER_TOKEN))
    p = read_plan(starts, sizes, lengths, steps, cache_bytes=cache)
    assert (p.read_bytes, p.cached_read_bytes) == simulate(starts, sizes, lengths, steps, cache)
    assert p.needed_bytes == pytest.approx(int(sizes.sum()), abs=1)  # every sample trained once


def test_pack_records_the_reads_and_warns_when_scattered(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"  # the example in row groups of 40 rows
    pq.write_table(pq.read_table(EXAMPLE), src, row_group_size=40)
    plain = pack(src, tmp_path / "a", "--dp", 2, "--cache-mb", 0)
    assert plain["reads"]["amplification"] < 1.5
    shuffled = pack(src, tmp_path / "b", "--dp", 2, "--cache-mb", 0, "--order", "shuffle",
                    "--batch-size", 16)  # fmt: skip
    r = shuffled["reads"]
    assert r["amplification"] > plain["reads"]["amplification"]
    assert r["read_bytes"] == r["cached_read_bytes"]  # no cache
    scattered = r["cached_amplification"] >= 4  # the exchange path, said in a warning
    assert (r["path"] == "exchange") == scattered
    assert any("exchange path" in w for w in shuffled["warnings"]) == scattered
    assert plain["reads"]["path"] == "direct"
    cached = pack(src, tmp_path / "c", "--dp", 2, "--order", "shuffle", "--batch-size", 16)
    assert cached["reads"]["cached_read_bytes"] == 0  # the example fits the default cache
