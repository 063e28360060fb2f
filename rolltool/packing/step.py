"""The unit of work every engine runs: one planned step fetched, laid out and written.

A step's rows depend only on its plan (`rolltool.plan.step_plan.PlannedStep`) and the input's
tokens, so any process can pack any step in any order. `write_step` lays out one step's rows
rank by rank (`rolltool.format.layout.step_rows`) and hands them to a writer; `pack_chunk` is
what a worker of any engine does with its share of the steps (`rolltool.engine.local`,
`rolltool.engine.ray`): a `TokenReader` resumed from the driver's `Job`, one `DirectWriter`
per step, and back each step's record and its files' sizes and sha256 (`Packed`). `prefetch`
overlaps reading the next step with writing this one in a single process.

Nothing here starts a process or knows an engine: engines import this, never the reverse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rolltool.fetch.buckets import Buckets
from rolltool.fetch.tokens import ReaderState, TokenReader
from rolltool.format import FileRecord, StepRecord
from rolltool.format.hybrid import hybrid_step_rows
from rolltool.format.layout import PackedRows, SampleTokens, step_rows
from rolltool.packed.writer import DirectWriter, PackedWriter
from rolltool.plan.config import PackConfig
from rolltool.plan.prefix_step import shared_step_rows
from rolltool.plan.step_plan import PlannedStep
from rolltool.storage.fs import Location


@dataclass(frozen=True)
class Job:
    """What every worker needs besides its steps."""

    reader: ReaderState
    cache_bytes: int
    root: Path
    shard_bytes: int
    config: PackConfig
    buckets: Buckets | None = None
    """With the exchange path (`rolltool.fetch.buckets`): steps read their tokens from these."""
    upload: Location | None = None
    """A remote output (`PackedWriter.remote`): workers upload their shards themselves."""

    def writer(self) -> DirectWriter:
        """How a worker writes one step (into ``root``, or uploaded to ``upload``)."""
        return DirectWriter(self.root, self.shard_bytes, self.upload)

    def fetch(self, reader: TokenReader, st: PlannedStep) -> SampleTokens:
        """Step `st`'s tokens in row order (`step_tokens`)."""
        return step_tokens(reader, self.buckets, st)


def step_tokens(reader: TokenReader, buckets: Buckets | None, st: PlannedStep) -> SampleTokens:
    """Step `st`'s tokens in row order: from its bucket on the exchange path, else from the
    input; what every engine packs a step from."""
    if buckets is not None:
        return buckets.fetch(st.index, st.members[st.order])
    return reader.fetch(st.members[st.order])


@dataclass(frozen=True)
class Packed:
    """One packed step: its record (ranks included) and the files written for it."""

    record: StepRecord
    files: dict[str, FileRecord]
    uploaded: bool = False
    """The files are already under the remote output's final names (`Job.upload`)."""


def pack_chunk(
    job: Job, steps: Sequence[PlannedStep], reader: TokenReader | None = None
) -> list[Packed]:
    """Fetch, lay out and write `steps` into ``job.root`` (one `DirectWriter` per step), with
    `reader` or a new one resumed from ``job.reader``: what a worker of any engine does with its
    share of the steps (this pool, `rolltool.engine.ray`). Idempotent: the same steps write the
    same bytes under the same names, so a retried chunk overwrites a half-written one."""
    if reader is None:
        reader = TokenReader.resume(job.reader, cache_bytes=job.cache_bytes)
    out = []
    for st in steps:
        writer = job.writer()
        record = write_step(writer, st, job.fetch(reader, st), job.config)
        out.append(Packed(record, writer.files, uploaded=job.upload is not None))
    return out


def prefetch(
    fetch: Callable[[PlannedStep], SampleTokens], steps: Sequence[PlannedStep]
) -> Iterator[tuple[PlannedStep, SampleTokens]]:
    """Each step with its tokens in row order (`fetch`); the next step's tokens are read on a
    worker thread while the caller lays out and writes this one (so at most two steps' tokens
    live)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        nxt = pool.submit(fetch, steps[0]) if steps else None
        for i, st in enumerate(steps):
            assert nxt is not None
            tokens = nxt.result()
            if i + 1 < len(steps):
                nxt = pool.submit(fetch, steps[i + 1])
            yield st, tokens
            del tokens


def write_step(
    writer: PackedWriter | DirectWriter, st: PlannedStep, tokens: SampleTokens, config: PackConfig
) -> StepRecord:
    """Lay out the step's rows rank by rank and queue them for writing; the step's record."""
    ranks = []
    order = st.order
    per_sample = {
        "sample_index": st.members[order],
        "advantage": st.advantage[order],
        "weight": st.weight[order],
    }
    if st.shared is not None:  # prefixes stored once (`rolltool.plan.prefix_step`)
        laid_out: Iterator[PackedRows] = shared_step_rows(
            tokens, st.members[order], st.advantage[order], st.weight[order], st.shared,
            dp=config.dp, step=st.index, row_len=config.row_len, pad_id=config.pad_id,
        )  # fmt: skip
    elif st.hybrid is not None:  # each row's sub-groups (`rolltool.format.hybrid`)
        laid_out = hybrid_step_rows(
            tokens, st.plan.micro_batches, cp_start=st.hybrid.cp_start, groups=st.hybrid.groups,
            row_len=config.row_len, pad_id=config.pad_id, **per_sample,
        )  # fmt: skip
    else:
        laid_out = step_rows(
            tokens,
            st.plan.micro_batches,
            **per_sample,
            row_len=config.group_row_len,
            pad_id=config.pad_id,
            sample_multiple=config.split.sample_multiple,
            row_multiple=config.split.row_multiple,
        )
    for r, rows in enumerate(laid_out):
        ranks.append(writer.write_rank(st.index, r, rows))
    return dataclasses.replace(st.record, ranks=tuple(ranks))
