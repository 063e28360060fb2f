"""The exchange path for scattered steps: read the input once, into step buckets, then pack.

With ``--order completion`` or ``shuffle`` every step's samples lie all over the input, so
fetching step after step decodes whole row groups for a few samples each: the plan's read
amplification (`rolltool.fetch.readplan`) grows with the input. The exchange streams the input's row
groups once, in file order, and appends each trained sample's tokens to the temporary bucket of
every step that trains it (a sample trained in several epochs goes to each of their buckets);
each step is then packed from its own bucket, which holds exactly its samples. Memory: one
decoded row group plus at most ``buffer_bytes`` of bucket data waiting to be written (the
largest buckets are flushed first); disk: the trained samples' tokens once per step that trains
them (9 bytes per token).

A bucket is three flat files per step (``input_ids`` int32, ``loss_mask`` uint8, ``logprobs``
float32) plus, in memory, each sample's place in them; within a bucket samples are in sample
order (row groups are read in order). `Buckets.fetch(step, sample_index)` returns the tokens of
those samples in the order asked for, as `rolltool.fetch.tokens.TokenReader.fetch` does, so packing a
step reads nothing but its bucket. `Buckets` is picklable: a worker process reads the same files.
A full disk while bucketing is the OSError any other write gives (``ENOSPC``, named by the
output and given the CLI's hint), also where the write came back short without a reason.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from rolltool.errors import RolltoolError
from rolltool.fetch.tokens import TokenReader
from rolltool.format.layout import SampleTokens
from rolltool.util.ranges import concat_ranges

BUFFER_BYTES = 256_000_000
"""Bucket data held in memory before the largest buckets are written out."""

_DTYPES = {"input_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32}


@dataclass
class Buckets:
    """Step buckets on disk (see the module docstring): per step, its samples in bucket order,
    their offsets into the step's token files."""

    root: Path
    samples: dict[int, np.ndarray] = field(default_factory=dict)  # step -> [k] sample_index
    offsets: dict[int, np.ndarray] = field(default_factory=dict)  # step -> [k+1] int64

    def path(self, step: int, name: str) -> Path:
        return self.root / f"step-{step:06d}.{name}"

    def fetch(self, step: int, sample_index: np.ndarray) -> SampleTokens:
        """The tokens of `sample_index` (samples of step `step`), in that order."""
        held, off = self.samples[step], self.offsets[step]
        idx = np.asarray(sample_index, dtype=np.int64)
        where = np.searchsorted(held, idx)
        if len(idx) and (where.max() >= len(held) or np.any(held[where] != idx)):
            raise RolltoolError(f"step {step}: a sample asked for is not in its bucket")
        arrays = {
            name: np.fromfile(self.path(step, name), dtype=dtype) for name, dtype in _DTYPES.items()
        }
        lengths = off[where + 1] - off[where]
        out_off = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=out_off[1:])
        picks = concat_ranges(off[where], lengths)
        return SampleTokens(
            offsets=out_off,
            input_ids=arrays["input_ids"][picks],
            loss_mask=arrays["loss_mask"][picks],
            logprobs=arrays["logprobs"][picks],
        )


def exchange(
    reader: TokenReader,
    steps: Sequence[tuple[int, np.ndarray]],
    root: Path,
    *,
    buffer_bytes: int = BUFFER_BYTES,
    progress: Callable[..., Iterable[int]] | None = None,
) -> Buckets:
    """Stream the input once into one bucket per step: `steps` lists (step, its sample indices);
    `root` (an empty directory) receives the files. `progress(items, total, description,
    size=..., unit=...)` may wrap the loop over row groups (`rolltool.jobs.pack.Progress`)."""
    n = reader.num_rows
    none = np.zeros(0, np.int64)
    pairs_step = np.concatenate([np.full(len(m), s, np.int64) for s, m in steps] or [none])
    pairs_sample = np.concatenate([np.asarray(m, np.int64) for _, m in steps] or [none])
    order = np.lexsort((pairs_step, pairs_sample))  # by sample, then step
    pairs_step, pairs_sample = (
        pairs_step[order].astype(np.int64),
        pairs_sample[order].astype(np.int64),
    )
    if len(pairs_sample) and (pairs_sample[0] < 0 or pairs_sample[-1] >= n):
        raise IndexError("sample_index out of range")
    out = Buckets(root)
    pending: dict[int, list[SampleTokens]] = {}
    pending_bytes = 0
    lengths: dict[int, list[np.ndarray]] = {s: [] for s, _ in steps}
    samples: dict[int, list[np.ndarray]] = {s: [] for s, _ in steps}
    starts = np.append(reader.block_starts, n)
    blocks: Iterable[int] = range(len(reader.block_starts))
    if progress is not None:
        rows = np.diff(starts).tolist()
        blocks = progress(blocks, len(starts) - 1, "exchange: reading the input into step buckets",
                          size=rows.__getitem__, unit="samples")  # fmt: skip
    for b in blocks:
        lo, hi = np.searchsorted(pairs_sample, [starts[b], starts[b + 1]])
        if lo == hi:
            continue
        step_here, sample_here = pairs_step[lo:hi], pairs_sample[lo:hi]
        for s in np.unique(step_here).tolist():
            mine = sample_here[step_here == s]
            tokens = reader.fetch(mine)  # one row group, decoded once (the reader keeps it)
            pending.setdefault(s, []).append(tokens)
            pending_bytes += _nbytes(tokens)
            lengths[s].append(tokens.lengths())
            samples[s].append(mine)
        while pending_bytes > buffer_bytes:
            pending_bytes -= _flush(out, pending, max(pending, key=lambda k: _held(pending[k])))
    for s in list(pending):
        _flush(out, pending, s)
    for s, _ in steps:
        out.samples[s] = np.concatenate(samples[s] or [np.zeros(0, np.int64)])
        lens = np.concatenate(lengths[s] or [np.zeros(0, np.int64)])
        out.offsets[s] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        for name in _DTYPES:
            out.path(s, name).touch()  # a step without tokens still has its (empty) files
    return out


def _nbytes(t: SampleTokens) -> int:
    return t.input_ids.nbytes + t.loss_mask.nbytes + t.logprobs.nbytes


def _held(parts: list[SampleTokens]) -> int:
    return sum(_nbytes(t) for t in parts)


def _flush(out: Buckets, pending: dict[int, list[SampleTokens]], step: int) -> int:
    """Append step `step`'s pending tokens to its files; the bytes freed."""
    parts = pending.pop(step)
    for name in _DTYPES:
        with open(out.path(step, name), "ab") as f:
            for t in parts:
                array = np.ascontiguousarray(getattr(t, name))
                if _write(f, array) != array.nbytes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _held(parts)


def _write(f: BinaryIO, array: np.ndarray) -> int:
    """Append `array`'s bytes to `f`; the bytes written. A failed write raises the OSError of
    its cause (``ENOSPC``: disk full), naming no file: the job names the output (numpy's
    ``tofile`` said only "82368 requested and 36070 written")."""
    return f.write(array.data.cast("B"))
