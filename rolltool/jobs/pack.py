"""The pack job: rollouts -> advantages -> steps -> partition -> packed rows -> shards.

Plans from the light columns only (ids, env, reward, lengths, finish times), then reads token
columns one step at a time, so memory stays bounded by a step. Output goes to a temporary
directory renamed into place; ``manifest.json`` is written last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import pyarrow as pa

from rolltool.engine.base import check_engine, default_workers
from rolltool.engine.local import pack_steps, plan_mapper
from rolltool.engine.local import pack_worth_it as pool_worth_it
from rolltool.errors import RolltoolError
from rolltool.fetch.buckets import Buckets, exchange
from rolltool.fetch.readplan import read_plan
from rolltool.fetch.tokens import TokenReader
from rolltool.format import (
    STATUSES,
    Manifest,
    ReadRecord,
    StepRecord,
)
from rolltool.format.layout import SampleTokens
from rolltool.input.source import InputFile, invert_mapping, resolve_inputs
from rolltool.packed.writer import PackedWriter
from rolltool.packing.manifest import created_at, manifest_record, samples_table
from rolltool.packing.step import Job, Packed, prefetch, step_tokens, write_step
from rolltool.plan.advantages import ESTIMATORS
from rolltool.plan.config import OVERLONG, PackConfig
from rolltool.plan.loss import LOSS_AGGS
from rolltool.plan.schedule import PlannedStep, Schedule, schedule
from rolltool.schema import Rollouts, scan
from rolltool.storage.outputs import check_target

if TYPE_CHECKING:
    from rolltool.engine.ray import RayEngine


def run_pack(
    inputs: Sequence[str],
    output: str | Path,
    config: PackConfig,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
    command: Sequence[str] | None = None,
    progress: Progress | None = None,
    estimator_chosen: bool = False,
    workers: int | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    exchange_path: str = "auto",
) -> Manifest:
    """Pack rollout Parquet `inputs` into `output` (a directory); returns the manifest written.

    `progress(iterable, total, description)` may wrap the step loop (the CLI passes a progress
    bar on stderr). `estimator_chosen`: the caller chose the estimator (the CLI: --estimator or
    --env-estimator given); an input with its own 'advantage' column then gets a warning that
    the estimator is not used. `workers`: processes that plan batches and pack steps (default:
    the cores this process may use; `rolltool.engine.local`); the output is the same
    whatever the number. `engine`: ``"local"`` (those processes) or ``"ray"`` (Ray tasks on the
    cluster at `ray_address`, or a local one; `rolltool.engine.ray`): the same output either way.
    `exchange_path`: ``"auto"`` (the exchange path, `rolltool.fetch.buckets`, when the plan would read
    the input `EXCHANGE_AT` times over), ``"always"`` or ``"never"``: the same output either way.
    """
    check_target(output, force, inputs=inputs)
    created_at()  # a bad SOURCE_DATE_EPOCH stops the run before any work
    if exchange_path not in EXCHANGE_CHOICES:
        raise RolltoolError(f"--exchange must be one of {', '.join(EXCHANGE_CHOICES)}")
    check_engine(engine, ray_address, workers)
    workload = config.workload()
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    reader = TokenReader(files, rename, cache_bytes=int(config.cache_mb * 1e6))
    ro = _scan(files, rename, reader, progress or _no_progress)
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise RolltoolError(f"--workers must be at least 1, got {workers}")
    with _engine(engine, ray_address) as ray:
        mapper = plan_mapper(workers, ro.num_samples) if ray is None else ray.map_in_order
        plan = schedule(ro, config, workload, ro.advantage, mapper=mapper)
        reads = read_plan(
            reader.block_starts,
            reader.block_bytes(),
            ro.length,
            [plan.trained(s) for s in range(len(plan.outlines))],
            cache_bytes=int(config.cache_mb * 1e6),
        )
        shard_bytes = int(config.shard_mb * 1e6)
        via = _path(exchange_path, reads)
        with PackedWriter(output, force=force, shard_bytes=shard_bytes) as writer:
            wrap = progress or _no_progress
            shuffle = via == "exchange" and ray is not None and ray.data_exchange  # no buckets
            local = via == "exchange" and not shuffle
            buckets = _exchange(writer, reader, plan, wrap) if local else None
            label = "packing steps" + (" from buckets" if buckets else _reads_label(reads))
            steps = _pack_all(
                writer, reader, plan, config, workers, wrap, ray, buckets, label, shuffle
            )
            if buckets is not None:
                shutil.rmtree(buckets.root)  # before the commit: not part of the output
            writer.write_samples(samples_table(ro, plan))
            warnings = [
                *filter(None, [workload.unreliable()]),
                *ro.warnings,
                *_given_warning(ro.advantage, estimator_chosen),
                *plan.warnings,
                *_read_warning(reads, config, via),
            ]
            record = manifest_record(ro, plan, config, workload, steps, warnings, columns, command)
            record = dataclasses.replace(record, reads=dataclasses.replace(reads, path=via))
            return writer.finish(record)


T = TypeVar("T")


class Progress(Protocol):
    """How the CLI shows a loop's progress (`rolltool.cli.progress`): yields `items` unchanged;
    `size(item)` counts the item's `unit`s (for a rate)."""

    def __call__(
        self,
        items: Iterable[T],
        total: int,
        description: str,
        *,
        size: Callable[[T], int] | None = None,
        unit: str = "tokens",
    ) -> Iterable[T]: ...


def _no_progress(
    items: Iterable[T],
    total: int,
    description: str,
    *,
    size: Callable[[T], int] | None = None,
    unit: str = "tokens",
) -> Iterable[T]:
    return items


def _scan(files: Sequence[InputFile], rename: Mapping[str, str], reader: TokenReader,
          progress: Progress) -> Rollouts:  # fmt: skip
    """`schema.scan`, feeding the reader's cache, with progress over the input's row groups."""
    rows = np.diff(np.append(reader.block_starts, reader.num_rows)).tolist()
    ticks = iter(progress(range(len(rows)), len(rows), "checking the input",
                          size=rows.__getitem__, unit="samples"))  # fmt: skip

    def offer(file_index: int, row_group: int, table: pa.Table) -> None:
        reader.offer(file_index, row_group, table)
        next(ticks, None)

    try:
        ro = scan(files, rename, on_row_group=offer)
        for _ in ticks:  # the last row group counted (the bar closes, a last log line)
            pass
    finally:
        getattr(ticks, "close", lambda: None)()
    return ro


def _reads_label(reads: ReadRecord) -> str:
    """How many times over fetching the steps reads what they need (`rolltool.fetch.readplan`); nothing
    when every row group they need is in the scan's cache."""
    if not reads.cached_read_bytes:
        return ""
    return f" (reading {reads.cached_amplification:.1f}x the bytes needed)"


def _engine(engine: str, address: str | None) -> AbstractContextManager[RayEngine | None]:
    """The Ray cluster to run on (`rolltool.engine.ray.attach`), or None for this machine's
    processes; Ray is imported only here, only for ``engine="ray"``."""
    if engine == "local":
        return contextlib.nullcontext()
    from rolltool.engine.ray import attach

    return attach(address)


def _exchange(
    writer: PackedWriter,
    reader: TokenReader,
    plan: Schedule,
    progress: Progress,
) -> Buckets:
    """The exchange path (`rolltool.fetch.buckets`): the input read once into step buckets, in a
    folder of the writer's temporary directory (removed with it on any failure)."""
    assert writer.root is not None
    root = writer.root / ".exchange"
    root.mkdir()
    wanted = [(o.index, plan.trained(s)) for s, o in enumerate(plan.outlines)]
    return exchange(reader, wanted, root, progress=progress)


def _pack_all(
    writer: PackedWriter,
    reader: TokenReader,
    plan: Schedule,
    config: PackConfig,
    workers: int,
    wrap: Progress,
    ray: RayEngine | None,
    buckets: Buckets | None = None,
    label: str = "packing steps",
    shuffle: bool = False,
) -> list[StepRecord]:
    """Every step packed and written, records in step order: by Ray tasks, by worker processes
    (`rolltool.engine.local`, for runs big enough), or here; tokens from `buckets` when the exchange
    path ran, or from Ray Data's shuffle (`shuffle`, `rolltool.engine.ray_exchange`)."""
    steps = plan.steps  # each step is built when it is read: once here
    if ray is not None:
        pack = ray.exchange_steps if shuffle else ray.pack_steps
        return _adopt_all(writer, reader, steps, config, pack, wrap, buckets, label)
    if pool_worth_it(workers, [o.record for o in plan.outlines]):
        return _adopt_all(
            writer, reader, steps, config, lambda s, job: pack_steps(s, job, workers), wrap,
            buckets, label,
        )  # fmt: skip
    fetch = functools.partial(step_tokens, reader, buckets)
    fetched = prefetch(fetch, steps)
    return [
        write_step(writer, st, tokens, config)
        for st, tokens in wrap(fetched, len(steps), label, size=_fetched_tokens)
    ]


def _fetched_tokens(item: tuple[PlannedStep, SampleTokens]) -> int:
    return item[0].record.sampled_tokens


def _adopt_all(
    writer: PackedWriter,
    reader: TokenReader,
    steps: Sequence[PlannedStep],
    config: PackConfig,
    pack: Callable[[Sequence[PlannedStep], Job], Iterable[Packed]],
    wrap: Progress,
    buckets: Buckets | None = None,
    label: str = "packing steps",
) -> list[StepRecord]:
    """Every step packed by other processes (`pack`: `rolltool.engine.local.pack_steps` or
    `rolltool.engine.ray.RayEngine.pack_steps`) into the writer's directory, adopted in step
    order; records in step order."""
    assert writer.root is not None
    job = Job(
        reader=reader.handoff(),
        cache_bytes=int(config.cache_mb * 1e6),
        root=writer.root,
        shard_bytes=writer.shard_bytes,
        config=config,
        buckets=buckets,
        upload=writer.remote,
    )
    records = []
    for done in wrap(pack(steps, job), len(steps), label, size=_packed_tokens):
        writer.adopt(done.files, uploaded=done.uploaded)
        records.append(done.record)
    return records


def _packed_tokens(done: Packed) -> int:
    return done.record.sampled_tokens


EXCHANGE_AT = 4.0
"""Plans whose fetches would read the input's token columns this many times over (with the
cache) take the exchange path (`rolltool.fetch.buckets`): the input read once into step buckets."""


EXCHANGE_CHOICES = ("auto", "always", "never")
"""``--exchange``: take the exchange path from `EXCHANGE_AT` on, always, or never."""


def _path(choice: str, reads: ReadRecord) -> str:
    """``"exchange"`` or ``"direct"`` for ``--exchange`` `choice` and the plan's reads."""
    if choice == "auto":
        return "exchange" if reads.cached_amplification >= EXCHANGE_AT else "direct"
    return "exchange" if choice == "always" else "direct"


def _read_warning(reads: ReadRecord, config: PackConfig, via: str) -> list[str]:
    """What the exchange path saved, when the plan's steps are so scattered that fetching them
    would have read the input many times over (`rolltool.fetch.readplan`)."""
    if via != "exchange" or reads.cached_amplification < EXCHANGE_AT:
        return []  # direct, or the exchange asked for (--exchange always): nothing to explain
    return [
        f"fetching the steps would have read the input's token columns "
        f"{reads.cached_amplification:.1f}x over (--order {config.steps.order} scatters each step "
        "over the input): read it once into step buckets instead (the exchange path)"
    ]


def _given_warning(given: np.ndarray | None, estimator_chosen: bool) -> list[str]:
    if given is None or not estimator_chosen:
        return []
    return [
        "the input has an 'advantage' column, used as is: --estimator/--env-estimator "
        "are ignored (drop the column to compute advantages)"
    ]


__all__ = ["ESTIMATORS", "LOSS_AGGS", "OVERLONG", "STATUSES", "PackConfig", "run_pack"]
