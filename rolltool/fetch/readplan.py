"""How much of the input a plan reads: the read amplification of fetching step after step.

The input's token columns are read row group by row group where a step's tokens are fetched
(`rolltool.fetch.tokens.TokenReader`). When the plan takes groups in input order, consecutive
steps read consecutive row groups and the input is read about once; with ``--order completion`` or ``shuffle`` each step's samples are scattered
over the input and every step decodes whole row groups for a few samples each. Computed from the
plan and the Parquet footers before any token is read:

- ``needed``: the compressed bytes of the trained samples' token columns, each row group's bytes
  shared among its samples by tokens;
- ``read``: for each step, the bytes of the row groups it touches, except those the previous
  step touched too (the reader keeps its last decoded row group), the cost without a cache;
- ``amplification`` = read / needed (about 1 in input order); ``cached_amplification`` the same
  with an LRU model of the cache, filled first with the row groups in input order while they
  fit (what the job decodes while it plans, `rolltool.fetch.tokens.TokenReader.preload`; before
  the scan was deferred, the scan's offers), so roughly what the fetches read beyond one pass
  over the input: 0 when the input's tokens fit ``--cache-mb``.

Worked example: two row groups of 100 bytes and 10 one-token samples each; step 0 trains
samples 0-4 and 10-14, step 1 samples 5-9 and 15-19 -> needed 200 bytes; step 0 reads both row
groups (200), step 1 both again, minus none (the reader kept only the last one: 100): read 300,
amplification 1.5.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rolltool.format import ReadRecord

DECODED_BYTES_PER_TOKEN = 9
"""A decoded row group in the reader's cache: int32 id, uint8 mask, float32 logprob per token."""


def read_plan(
    block_starts: np.ndarray,
    block_bytes: np.ndarray,
    lengths: np.ndarray,
    steps: Sequence[np.ndarray],
    cache_bytes: int = 0,
) -> ReadRecord:
    """The plan's reads: `block_starts` ([B] first sample of each row group, over the ordered
    input), `block_bytes` ([B] its token columns' compressed bytes), `lengths` ([n] tokens per
    sample), `steps` (each step's sample indices, in fetch order); `cache_bytes` the reader's
    cache (`DECODED_BYTES_PER_TOKEN` per token). The manifest's record of it (its ``path``,
    direct or exchange, is the caller's to set).

    >>> starts, size = np.array([0, 10]), np.array([100, 100])
    >>> steps = [np.r_[0:5, 10:15], np.r_[5:10, 15:20]]
    >>> p = read_plan(starts, size, np.ones(20, np.int64), steps)
    >>> p.needed_bytes, p.read_bytes, p.amplification, p.cached_read_bytes
    (200, 300, 1.5, 300)
    >>> read_plan(starts, size, np.ones(20, np.int64), steps, cache_bytes=1000).cached_read_bytes
    0
    """
    block_of = np.searchsorted(block_starts, np.arange(len(lengths)), side="right") - 1
    block_tokens = np.bincount(block_of, weights=lengths, minlength=len(block_starts))
    share = np.divide(
        block_bytes, block_tokens, out=np.zeros(len(block_bytes)), where=block_tokens > 0
    )
    cache = _Lru(cache_bytes, block_tokens * DECODED_BYTES_PER_TOKEN)
    needed = 0.0
    read = reads = cached = 0
    last: int | None = None
    for members in steps:
        blocks = block_of[members]
        needed += float((share[blocks] * lengths[members]).sum())
        touched = np.unique(blocks)
        fresh = touched[touched != last] if last is not None else touched
        read += int(block_bytes[fresh].sum())
        reads += len(fresh)
        cached += int(sum(block_bytes[b] for b in fresh.tolist() if not cache.hit(b)))
        if len(touched):
            last = int(touched[-1])  # the reader decodes in block order and keeps the last
    return ReadRecord(
        needed_bytes=round(needed),
        read_bytes=read,
        cached_read_bytes=cached,
        amplification=read / needed if needed else 1.0,
        cached_amplification=cached / needed if needed else 1.0,
        row_group_reads=reads,
        row_groups=len(block_starts),
    )


class _Lru:
    """The reader's cache, roughly: row groups in input order while they fit (the preload),
    then least recently used out."""

    def __init__(self, capacity: int, sizes: np.ndarray) -> None:
        self.capacity, self.sizes = capacity, sizes
        self.held: dict[int, None] = {}
        self.used = 0.0
        for b in range(len(sizes)):
            if self.used + sizes[b] > capacity:
                break
            self.held[b] = None
            self.used += sizes[b]

    def hit(self, b: int) -> bool:
        """Whether row group `b` is held; it is held (most recent) afterwards if it fits."""
        if b in self.held:
            self.held[b] = self.held.pop(b)
            return True
        while self.held and self.used + self.sizes[b] > self.capacity:
            self.used -= self.sizes[next(iter(self.held))]
            del self.held[next(iter(self.held))]
        if self.sizes[b] <= self.capacity:
            self.held[b] = None
            self.used += self.sizes[b]
        return False
