"""The content invariant: the packed tokens are the input's.

Only segments that agree with their samples.parquet record are compared (`rows.agreeing`): the
others are already reported, and comparing their tokens would report the same defect again.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from rolltool.errors import RolltoolError
from rolltool.format.layout import SampleTokens
from rolltool.format.shards import read_shard
from rolltool.util.problems import Problem
from rolltool.verify.context import Context
from rolltool.verify.rows import agreeing
from rolltool.verify.segments import Segments
from rolltool.verify.shared import expand

FIELDS = ("input_ids", "loss_mask", "logprobs")


def compared(ctx: Context) -> int:
    """How many samples `content` compares with the input (0 without an input)."""
    return int(agreeing(ctx).sum()) if ctx.reader is not None else 0


def content(ctx: Context) -> Iterator[Problem]:
    """Every packed sample's length, input_ids, loss_mask and logprobs (bitwise: NaN and -0.0
    as stored) equal the input's, with the input given or recorded (see `Context.reader`)."""
    if ctx.reader is None:
        return
    seg, ok = ctx.segments, agreeing(ctx)
    for part in seg.parts:
        local = np.flatnonzero(ok[part.first : part.end])
        if not len(local):
            continue
        try:
            src = ctx.reader.fetch(ctx.input_index(seg.sample[part.first + local]))
        except (RolltoolError, pa.ArrowException, OSError, IndexError, KeyError) as e:
            text = e.message if isinstance(e, RolltoolError) else f"could not be read ({e})"
            yield Problem("input.unreadable", "input", text)
            return
        try:
            arrays = read_shard(ctx.root / part.path)
        except RolltoolError as e:  # gone since the first pass
            yield Problem("shard.corrupt", f"step {part.step} rank {part.rank}", e.message)
            continue
        if ctx.manifest.config.share_prefix:  # its samples reassembled, as the pass read them
            arrays = expand(arrays)
        yield from _compare(seg, part.first, local, arrays, src)


def _compare(
    seg: Segments, first: int, local: np.ndarray, arrays: dict[str, np.ndarray], src: SampleTokens
) -> Iterator[Problem]:
    """Segments `first + local` of one shard (`arrays`) against their input tokens `src`."""
    lens = seg.length[first : first + len(arrays["seq_lens"])]
    in_len = np.diff(src.offsets)
    same = in_len == lens[local]
    for j in np.flatnonzero(~same):
        k = first + int(local[j])
        text = f"{lens[local[j]]} tokens, the input has {in_len[j]}"
        yield Problem("input.length", f"{seg.where(k)} sample {seg.sample[k]}", text)
    wanted = np.zeros(len(lens), dtype=bool)
    wanted[local[same]] = True
    packed_tokens = np.repeat(wanted, lens)
    input_tokens = np.repeat(same, in_len)
    n = lens[local[same]]
    starts = np.zeros(len(n), dtype=np.int64)
    np.cumsum(n[:-1], out=starts[1:])
    for name in FIELDS:
        packed, given = arrays[name][packed_tokens], getattr(src, name)[input_tokens]
        if name == "logprobs":
            packed, given = packed.view(np.uint32), given.view(np.uint32)
        if not len(n) or np.array_equal(packed, given):
            continue
        differ = np.add.reduceat(packed != given, starts, dtype=np.int64)
        for j in np.flatnonzero(differ):
            k = first + int(local[same][j])
            text = f"{name} differ from the input at {differ[j]} of {n[j]} tokens"
            yield Problem(f"input.{name}", f"{seg.where(k)} sample {seg.sample[k]}", text)
