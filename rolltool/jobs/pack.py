"""The pack job: rollouts -> advantages -> steps -> partition -> packed rows -> shards.

Plans from the light columns only (ids, env, reward, lengths, finish times), then reads token
columns one step at a time, so memory stays bounded by a step. Output goes to a temporary
directory renamed into place; ``manifest.json`` is written last.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from rolltool.engine.base import Engine
from rolltool.engine.config import EXCHANGE_CHOICES, ExecutionConfig, open_engine
from rolltool.errors import RolltoolError
from rolltool.fetch.buckets import Buckets, exchange
from rolltool.fetch.prefixes import group_prefixes
from rolltool.fetch.readplan import read_plan
from rolltool.fetch.tokens import TokenReader, preloaded
from rolltool.format import (
    STATUSES,
    Manifest,
    ReadRecord,
    StepRecord,
)
from rolltool.format.layout import SampleTokens
from rolltool.input.parquet import InputFile, invert_mapping
from rolltool.input.resolve import resolve_inputs
from rolltool.packed.writer import PackedWriter
from rolltool.packing.manifest import created_at, manifest_record, samples_table
from rolltool.packing.step import Job, Packed, prefetch, step_tokens, write_step
from rolltool.plan.advantages import ESTIMATORS, AdvantageConfig
from rolltool.plan.config import OVERLONG, PackConfig
from rolltool.plan.group_advantages import group_advantages
from rolltool.plan.groups import GroupIndex
from rolltool.plan.loss import LOSS_AGGS
from rolltool.plan.prefix_step import GroupForest
from rolltool.plan.schedule import Schedule, schedule
from rolltool.plan.step_plan import PlannedStep
from rolltool.schema import Rollouts, scan, scan_deferred
from rolltool.schema.pieces import MIN_ROW_GROUPS
from rolltool.storage.outputs import check_target

DEFAULT_EXECUTION = ExecutionConfig()
"""This machine's processes, one per core; the exchange path where it pays."""


def run_pack(
    inputs: Sequence[str],
    output: str | Path,
    config: PackConfig,
    execution: ExecutionConfig = DEFAULT_EXECUTION,
    *,
    columns: Mapping[str, str] | None = None,
    force: bool = False,
    progress: Progress | None = None,
    command: Sequence[str] | None = None,
    warn_ignored_estimator: bool | None = False,
    workers: int | None = None,
    engine: str | None = None,
    ray_address: str | None = None,
    exchange_path: str | None = None,
    estimator_chosen: bool | None = None,
) -> Manifest:
    """Pack rollout Parquet `inputs` into `output` (a directory); returns the manifest written.

    `execution`: where the work runs (`rolltool.engine.config.ExecutionConfig`: the local
    engine's workers or a Ray cluster, the exchange path's choice); the output is the same
    whatever it says. `progress(iterable, total, description)` may wrap the step loop (the CLI
    passes a progress bar on stderr). `command`: the command line the manifest records (the
    CLI's argv; None records ``[]``: before 0.2 it recorded this process's ``sys.argv``, a
    fact of the CLI the library no longer reads). `warn_ignored_estimator`: whether an input
    with its own 'advantage' column, which is used as is, gets a warning that
    ``config.advantages`` is not used (the CLI says whether --estimator or --env-estimator was
    given, which a default value cannot tell); False by default, as before; None: warn where
    ``config.advantages`` is not the default.

    Deprecated, for one release (a DeprecationWarning; not with `execution`): `workers`,
    `engine`, `ray_address` and `exchange_path` (`ExecutionConfig`'s ``workers``, ``engine``,
    ``ray_address``, ``exchange``), and `estimator_chosen` (`warn_ignored_estimator`).
    """
    execution, warn_ignored_estimator = _legacy(
        execution, warn_ignored_estimator, workers=workers, engine=engine,
        ray_address=ray_address, exchange=exchange_path, estimator_chosen=estimator_chosen,
    )  # fmt: skip
    if warn_ignored_estimator is None:
        warn_ignored_estimator = config.advantages != AdvantageConfig()
    check_target(output, force, inputs=inputs)
    created_at()  # a bad SOURCE_DATE_EPOCH stops the run before any work
    workload = config.workload()
    rename = invert_mapping(columns or {})
    files = resolve_inputs(inputs)
    with open_engine(execution) as engine_, _problems_first(files, rename, engine_):
        reader = TokenReader(files, rename, cache_bytes=int(config.cache_mb * 1e6))
        ro = _scan(files, rename, reader, engine_, progress or _no_progress)
        # The first row groups decoded and checked on a thread while the job plans, where it
        # may pack them itself (the prefix pass reads every group first: no preload then).
        with preloaded(reader, engine_.packs_here and not config.share_prefix) as ready:
            prefixes = _prefixes(reader, ro, config)
            mapper = engine_.plan_mapper(ro.num_samples)
            plan = schedule(ro, config, workload, ro.advantage, mapper=mapper, prefixes=prefixes)
            ready()
        reads = read_plan(
            reader.block_starts,
            reader.block_bytes(),
            ro.length,
            [plan.trained(s) for s in range(len(plan.outlines))],
            cache_bytes=int(config.cache_mb * 1e6),
        )
        shard_bytes = int(config.shard_mb * 1e6)
        via = _path(execution.exchange, reads)
        with PackedWriter(output, force=force, shard_bytes=shard_bytes) as writer:
            wrap = progress or _no_progress
            shuffle = via == "exchange" and engine_.data_exchange  # the engine's: no buckets
            local = via == "exchange" and not shuffle
            buckets = _exchange(writer, reader, plan, wrap) if local else None
            label = "packing steps" + (" from buckets" if buckets else _reads_label(reads))
            steps = _pack_all(writer, reader, plan, config, engine_, wrap, buckets, label, shuffle)
            reader.check_blocks(_untouched(reader, plan))
            if buckets is not None:
                shutil.rmtree(buckets.root)  # before the commit: not part of the output
            writer.write_samples(samples_table(ro, plan))
            notes = [
                *filter(None, [workload.unreliable()]),
                *ro.warnings,
                *_given_warning(ro.advantage, warn_ignored_estimator),
                *plan.warnings,
                *_read_warning(reads, config, via),
            ]
            record = manifest_record(ro, plan, config, workload, steps, notes, columns, command)
            record = dataclasses.replace(record, reads=dataclasses.replace(reads, path=via))
            return writer.finish(record)


def _legacy(
    execution: ExecutionConfig,
    warn_ignored_estimator: bool | None,
    *,
    estimator_chosen: bool | None,
    **old: object,
) -> tuple[ExecutionConfig, bool | None]:
    """`run_pack`'s deprecated keywords turned into what replaces them, with a
    DeprecationWarning naming them."""
    given = {k: v for k, v in old.items() if v is not None}
    if given:
        if execution != DEFAULT_EXECUTION:
            raise TypeError("run_pack: give `execution` or its deprecated keywords, not both")
        names = ", ".join(f"{'exchange_path' if k == 'exchange' else k}=..." for k in given)
        warnings.warn(f"run_pack({names}) is deprecated: pass execution=ExecutionConfig(...)",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        execution = ExecutionConfig(**given)  # type: ignore[arg-type]
    if estimator_chosen is not None:
        warnings.warn("run_pack(estimator_chosen=...) is deprecated: pass warn_ignored_estimator",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        if warn_ignored_estimator is None:
            warn_ignored_estimator = estimator_chosen
    return execution, warn_ignored_estimator


T = TypeVar("T")
R = TypeVar("R")


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
          engine: Engine, progress: Progress) -> Rollouts:  # fmt: skip
    """The deferred scan (`rolltool.schema.scan_deferred`: light columns and ``loss_mask``),
    with progress over the input's row groups; its row groups as tasks where the engine has
    more than this process (`Engine.scan_mapper`). The rules it leaves run where the token
    columns are decoded: `reader` gets them as its ``check``, and the scan's lengths to
    compare the tokens with."""
    rows = np.diff(np.append(reader.block_starts, reader.num_rows)).tolist()
    ticks = iter(progress(range(len(rows)), len(rows), "checking the input",
                          size=rows.__getitem__, unit="samples"))  # fmt: skip
    mapper = engine.scan_mapper() if len(rows) >= MIN_ROW_GROUPS else None

    def tick(*_: object) -> None:
        next(ticks, None)

    def ticking(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
        assert mapper is not None
        for result in mapper(fn, items):
            tick()
            yield result

    try:
        if mapper is None:
            ro, check = scan_deferred(files, rename, on_row_group=tick)
        else:
            ro, check = scan_deferred(files, rename, mapper=ticking)
        for _ in ticks:  # the last row group counted (the bar closes, a last log line)
            pass
    finally:
        getattr(ticks, "close", lambda: None)()
    reader.check = check
    reader.expect_lengths(ro.length)
    return ro


@contextmanager
def _problems_first(files: Sequence[InputFile], rename: Mapping[str, str],
                    engine: Engine) -> Iterator[None]:  # fmt: skip
    """Where an error stops the job (a row the deferred scan or a fetch's check flags, or any
    later error), raise the input's problems instead, as the full scan lists them, when it has
    any: the messages, and their precedence over the plan's errors, of a scan that read every
    column first. Nothing is written either way."""
    try:
        yield
    except RolltoolError:
        scan(files, rename, mapper=engine.scan_mapper())
        raise


def _untouched(reader: TokenReader, plan: Schedule) -> list[int]:
    """The row groups no step trains a sample of: no fetch reads them, so the job checks them
    (`TokenReader.check_blocks`) for every row of the input to be checked, as the full scan
    did."""
    touched = np.zeros(len(reader.block_starts), dtype=bool)
    for s in range(len(plan.outlines)):
        touched[reader.block_of(plan.trained(s))] = True
    return np.flatnonzero(~touched).tolist()


def _prefixes(
    reader: TokenReader, ro: Rollouts, config: PackConfig
) -> dict[int, GroupForest] | None:
    """With ``--share-prefix``, each group's prefixes from the token pass
    (`rolltool.fetch.prefixes`), before planning; else None."""
    if not config.share_prefix:
        return None
    assert config.share_min is not None
    groups = GroupIndex.of(ro.group, ro.num_groups)
    advantage = group_advantages(ro, config, ro.advantage).value  # as schedule computes them
    return group_prefixes(reader, groups, ro.length, config.share_min, advantage=advantage)


def _reads_label(reads: ReadRecord) -> str:
    """How many times over fetching the steps reads what they need (`rolltool.fetch.readplan`); nothing
    when every row group they need is in the scan's cache."""
    if not reads.cached_read_bytes:
        return ""
    return f" (reading {reads.cached_amplification:.1f}x the bytes needed)"


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
    engine: Engine,
    wrap: Progress,
    buckets: Buckets | None = None,
    label: str = "packing steps",
    shuffle: bool = False,
) -> list[StepRecord]:
    """Every step packed and written, records in step order: by the engine (Ray tasks; worker
    processes for runs big enough, `rolltool.engine.local`), or here; tokens from `buckets`
    when the exchange path ran, or from the engine's own exchange (`shuffle`: Ray Data's,
    `rolltool.engine.ray_exchange`)."""
    steps = plan.steps  # each step is built when it is read: once here
    if shuffle:
        return _adopt_all(writer, reader, steps, config, engine.exchange_steps, wrap, None, label)
    if engine.pack_worth_it([o.record for o in plan.outlines]):
        reader.clear()  # the workers decode what they pack
        return _adopt_all(writer, reader, steps, config, engine.pack_steps, wrap, buckets, label)
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
    """Every step packed by other processes (`pack`: an engine's ``pack_steps`` or
    ``exchange_steps``) into the writer's directory, adopted in step order; records in step
    order."""
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


def _given_warning(given: np.ndarray | None, warn: bool) -> list[str]:
    """The warning that the input's own advantages make ``config.advantages`` unused."""
    if given is None or not warn:
        return []
    return [
        "the input has an 'advantage' column, used as is: --estimator/--env-estimator "
        "are ignored (drop the column to compute advantages)"
    ]


__all__ = [
    "ESTIMATORS",
    "EXCHANGE_CHOICES",
    "LOSS_AGGS",
    "OVERLONG",
    "STATUSES",
    "ExecutionConfig",
    "PackConfig",
    "run_pack",
]
