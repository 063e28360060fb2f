"""What every engine shares: the engines' names, the one chunk policy, the in-order collection
of chunked work, the settings check, and the `Engine` protocol a job asks.

An engine runs pure work it is handed (`rolltool.util.mapping.Mapper` for planning and scans,
``pack_steps`` for the per-step unit of work, `rolltool.packing.step.pack_chunk`) on this
machine's processes (`rolltool.engine.local.LocalEngine`) or on a Ray cluster
(`rolltool.engine.ray.RayEngine`); which one a run uses is its
`rolltool.engine.config.ExecutionConfig`. Light on purpose: the CLI imports it for `ENGINES`
without loading any engine.

What is shared and what is not: every engine cuts its work with `chunks` and gives results back
in input order with `in_order` (at most a window of chunks submitted and not yet collected;
closing it early cancels the rest). How a chunk is started, how its result is awaited and what
a dead worker means differ for real and stay with each engine: forked processes that inherit the
work (planning), ``forkserver`` processes the steps are pickled to (packing), Ray tasks whose
arguments go through the object store and whose failures Ray retries.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rolltool.errors import OptionConflict, RolltoolError

if TYPE_CHECKING:
    from rolltool.format import StepRecord
    from rolltool.packing.step import Job, Packed
    from rolltool.plan.step_plan import PlannedStep
    from rolltool.util.mapping import Mapper

ENGINES = ("local", "ray")
"""What runs the work of ``--engine``: worker processes on this machine, or Ray tasks."""
CHUNKS_PER_WORKER = 4
"""Work is cut into about this many contiguous chunks per worker process or cluster CPU: small
enough that a slow chunk does not leave the others idle, few enough that each pays for its
start (`chunks`)."""
A = TypeVar("A")
H = TypeVar("H")


class Engine(Protocol):
    """What a job asks of an engine (`rolltool.engine.local.LocalEngine`,
    `rolltool.engine.ray.RayEngine`): results always in the order of the items or steps
    given, the same whatever runs them."""

    def map_in_order(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterable[Any]:
        """``fn(x)`` for every x of `items`, in order: a `Mapper` for any pure stage (a scan, a
        command's pieces)."""
        ...

    def scan_mapper(self) -> Mapper | None:
        """The `Mapper` that checks the input's row groups (`rolltool.schema.scan_deferred`:
        ``pack``'s scan), naming "scanning row groups" in its errors; None: this process scans
        them, one after another (one local worker)."""
        ...

    def plan_mapper(self, samples: int) -> Mapper:
        """The `Mapper` that plans the batches of a run over `samples` input samples (the local
        engine plans a run too small to pay for its pool here)."""
        ...

    def pack_worth_it(self, steps: Sequence[StepRecord]) -> bool:
        """Whether `pack_steps` should pack the steps of these records; False: the job packs
        them in its own process (the local pool pays for its start only on big runs)."""
        ...

    def pack_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """Every step packed elsewhere (`rolltool.packing.step.pack_chunk`) into ``job.root``,
        its record and files yielded in step order for the driver to adopt."""
        ...

    @property
    def packs_here(self) -> bool:
        """Whether the job may pack steps in its own process (`pack_worth_it` can say False):
        then it decodes the first row groups while it plans (`rolltool.fetch.tokens.preloaded`)."""
        ...

    @property
    def data_exchange(self) -> bool:
        """Whether the exchange path is this engine's own (`exchange_steps`); False: the job
        fills step buckets on the driver (`rolltool.fetch.buckets`) and `pack_steps` reads
        them."""
        ...

    def exchange_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """The exchange path as `pack_steps` yields it, each step's samples brought together by
        the engine; only called where `data_exchange` is true."""
        ...


def default_workers() -> int:
    """The cores this process may use (its CPU affinity), at least 1."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not Linux
        return max(os.cpu_count() or 1, 1)


def spans(n: int, parts: int) -> list[tuple[int, int]]:
    """``[a, b)`` bounds cutting ``range(n)`` into ``min(n, parts)`` contiguous, near-equal
    pieces (none empty), in order: ``spans(5, 2) == [(0, 2), (2, 5)]``; ``[]`` when n is 0."""
    k = min(n, max(parts, 1))
    return list(itertools.pairwise(n * i // k for i in range(k + 1))) if k else []


def chunks(n: int, workers: int, most: int | None = None) -> list[tuple[int, int]]:
    """The one chunk policy: `n` items cut into ``CHUNKS_PER_WORKER`` contiguous chunks per
    worker (`spans`), or more where a chunk would otherwise hold more than `most` items (Ray's
    ``MAX_CHUNK``, which bounds what one task carries)."""
    parts = workers * CHUNKS_PER_WORKER
    return spans(n, parts if most is None else max(parts, -(-n // most)))


def in_order(
    submit: Callable[[A], H],
    args: Iterable[A],
    window: int,
    collect: Callable[[A, H], Any],
    cancel: Callable[[list[H]], object],
) -> Generator[Any, None, None]:
    """Each ``collect(a, submit(a))`` in the order of `args`, with at most `window` submitted
    and not yet collected: the next is submitted once the oldest one's result is taken.
    `submit` starts the work of `a` and returns a handle (a future, a Ray ref); `collect` waits
    for it and returns its result or raises the engine's error for `a`. Leaving early (closing
    the generator, an error) calls ``cancel(handles)`` on those still pending."""
    todo = iter(args)
    pending: deque[tuple[A, H]] = deque()
    try:
        pending.extend((a, submit(a)) for a in itertools.islice(todo, window))
        while pending:
            a, handle = pending[0]
            result = collect(a, handle)
            pending.popleft()
            pending.extend((b, submit(b)) for b in itertools.islice(todo, 1))
            yield result
    finally:
        cancel([h for _, h in pending])


def check_engine(engine: str, address: str | None, workers: int | None = None) -> None:
    """Refuse an unknown engine, ``--ray-address`` without ``--engine ray`` and ``--workers``
    with it (usage mistakes), before any work."""
    if engine not in ENGINES:
        raise RolltoolError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "local" and address is not None:
        raise OptionConflict(
            "--ray-address is for --engine ray", hint="add --engine ray, or drop --ray-address"
        )
    if engine == "ray" and workers is not None:
        raise OptionConflict(
            "--workers is for --engine local (Ray tasks use the cluster's CPUs)",
            hint="drop --workers, or use --engine local",
        )
