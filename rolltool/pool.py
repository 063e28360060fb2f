"""Packing steps in worker processes (``pack --workers N``): fetch, lay out, write and hash.

A step's rows depend only on its plan (`rolltool.schedule.PlannedStep`) and the input's tokens,
so steps can be packed by any process in any order: each worker opens its own `TokenReader` over
the input (a ``1/N`` share of ``--cache-mb``; it checks the input against what the driver's
scan recorded, `TokenReader.handoff`), packs contiguous runs of steps (consecutive steps
share row groups in input order) with `rolltool.pack.write_step` and a `DirectWriter` into the
driver's temporary directory, and sends back each step's record and its files' sizes and
sha256. The driver takes them in step order (progress as they come), adopts the files into its
`PackedWriter`, writes samples.parquet and the manifest last: the same bytes as one process
(tests/test_workers.py compares every file).

Memory: each worker holds one step's tokens and rows plus its cache share, so the run holds at
most ``workers`` steps at once (O(workers x step) + the cache). Workers are started by
``forkserver`` (a clean process, not a fork of the driver and its Arrow thread pools); the steps
travel to them pickled, a chunk at a time. A failing step stops the run with its error, the
pool is shut down before the temporary directory is removed, and a worker that dies (killed,
out of memory) is one error naming the steps it held.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from rolltool.config import PackConfig
from rolltool.errors import RolltoolError
from rolltool.exchange import Buckets
from rolltool.format import FileRecord, StepRecord
from rolltool.fs import Location
from rolltool.layout import SampleTokens
from rolltool.schedule import PlannedStep
from rolltool.tokens import ReaderState, TokenReader
from rolltool.workers import default_workers, spans
from rolltool.writer import DirectWriter

CHUNKS_PER_WORKER = 4
"""Steps are sent to workers in about this many contiguous chunks per worker."""
MIN_WORKERS = 4
"""A pool is used only with at least this many workers, each with a core of its own: the workers
decode the input again (the driver's scan cache is not shared) and one process already overlaps
reading with writing on threads, so on 2 cores the pool is slower (benchmarks/scale.py, a 177 MB
synth: 4.2 s in one process, 8.8 s with a pool of 4) ..."""
MIN_STEPS_PER_WORKER = 2
"""... at least this many steps per worker ..."""
MIN_TOKENS = 20_000_000
"""... and this many sampled tokens (~180 MB of shards): a pool costs ~1 s to start."""


def worth_it(workers: int, steps: Sequence[StepRecord]) -> bool:
    """Whether packing the steps of these records in `workers` processes pays for their
    start."""
    tokens = sum(st.sampled_tokens for st in steps)
    enough = len(steps) >= MIN_STEPS_PER_WORKER * workers and tokens >= MIN_TOKENS
    return min(workers, default_workers()) >= max(MIN_WORKERS, 2) and enough


@dataclass(frozen=True)
class Job:
    """What every worker needs besides its steps."""

    reader: ReaderState
    cache_bytes: int
    root: Path
    shard_bytes: int
    config: PackConfig
    buckets: Buckets | None = None
    """With the exchange path (`rolltool.exchange`): steps read their tokens from these."""
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


_STATE: tuple[Job, TokenReader] | None = None  # set in each worker by _start


def pack_chunk(
    job: Job, steps: Sequence[PlannedStep], reader: TokenReader | None = None
) -> list[Packed]:
    """Fetch, lay out and write `steps` into ``job.root`` (one `DirectWriter` per step), with
    `reader` or a new one resumed from ``job.reader``: what a worker of any engine does with its
    share of the steps (this pool, `rolltool.ray_engine`). Idempotent: the same steps write the
    same bytes under the same names, so a retried chunk overwrites a half-written one."""
    from rolltool.pack import write_step

    if reader is None:
        reader = TokenReader.resume(job.reader, cache_bytes=job.cache_bytes)
    out = []
    for st in steps:
        writer = job.writer()
        record = write_step(writer, st, job.fetch(reader, st), job.config)
        out.append(Packed(record, writer.files, uploaded=job.upload is not None))
    return out


def _start(job: Job) -> None:
    global _STATE
    _STATE = (job, TokenReader.resume(job.reader, cache_bytes=job.cache_bytes))


def _pack(steps: list[PlannedStep]) -> list[Packed]:
    assert _STATE is not None
    job, reader = _STATE
    return pack_chunk(job, steps, reader)


def pack_steps(steps: Sequence[PlannedStep], job: Job, workers: int) -> Iterator[Packed]:
    """Every step packed by `workers` processes, yielded in step order (see the module
    docstring). Leaving the iterator early (an error downstream) shuts the pool down."""
    chunks = [list(steps[a:b]) for a, b in spans(len(steps), workers * CHUNKS_PER_WORKER)]
    parts = max(len(chunks), 1)
    share = dataclasses.replace(job, cache_bytes=job.cache_bytes // workers)
    pool = ProcessPoolExecutor(
        max_workers=min(workers, parts),
        mp_context=multiprocessing.get_context("forkserver"),
        initializer=_start,
        initargs=(share,),
    )
    try:
        futures = [pool.submit(_pack, chunk) for chunk in chunks]
        for chunk, fut in zip(chunks, futures, strict=True):
            try:
                done = fut.result()
            except BrokenProcessPool:
                first, last = chunk[0].index, chunk[-1].index
                raise RolltoolError(
                    f"a worker process died while packing steps {first}-{last} (killed, or out "
                    "of memory?); nothing was written",
                    hint="run again with fewer --workers or a smaller --cache-mb",
                ) from None
            yield from done
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
