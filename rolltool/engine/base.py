"""What every engine shares: the engines' names, the one chunk policy, the settings check.

An engine runs pure work it is handed (`rolltool.util.mapping.Mapper` for planning and scans,
``pack_steps`` for the per-step unit of work, `rolltool.packing.step.pack_chunk`) on this
machine's processes (`rolltool.engine.local`) or on a Ray cluster (`rolltool.engine.ray`).
Light on purpose: the CLI imports it for `ENGINES` without loading any engine.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rolltool.errors import OptionConflict, RolltoolError

if TYPE_CHECKING:
    from rolltool.packing.step import Job, Packed
    from rolltool.plan.schedule import PlannedStep

ENGINES = ("local", "ray")
"""What runs the work of ``--engine``: worker processes on this machine, or Ray tasks."""
CHUNKS_PER_WORKER = 4
"""Work is cut into about this many contiguous chunks per worker process or cluster CPU: small
enough that a slow chunk does not leave the others idle, few enough that each pays for its
start (`chunks`)."""
SHARED_FS_HINT = (
    "on a cluster of several machines the inputs and the output's parent must be on a "
    "filesystem every node mounts at the same path"
)


class Engine(Protocol):
    """What a job asks of an engine: a `Mapper` and packing steps, results in order."""

    def map_in_order(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterable[Any]: ...

    def pack_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]: ...


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


def chunks(n: int, workers: int) -> list[tuple[int, int]]:
    """The one chunk policy: `n` items cut into ``CHUNKS_PER_WORKER`` contiguous chunks per
    worker (`spans`)."""
    return spans(n, workers * CHUNKS_PER_WORKER)


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
