"""How a run is executed, apart from what it computes: `ExecutionConfig`, and the engine it opens.

A `rolltool.plan.config.PackConfig` decides every byte of the output; an `ExecutionConfig`
decides only where the work runs (and whether pack takes the exchange path), so the same
output comes from any of them. It is checked once, when made, with the words the CLI prints
(``--workers``, ``--engine``, ``--ray-address``, ``--exchange``). Light: the CLI builds one
without loading an engine (`open_engine` imports the one it opens).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rolltool.engine.base import Engine, check_engine, default_workers
from rolltool.errors import RolltoolError

if TYPE_CHECKING:
    from rolltool.util.mapping import Mapper

EXCHANGE_CHOICES = ("auto", "always", "never")
"""``--exchange``: take the exchange path from `rolltool.jobs.pack.EXCHANGE_AT` on, always, or
never."""


@dataclass(frozen=True)
class ExecutionConfig:
    """Where a run's work runs; the output is the same for every value.

    >>> ExecutionConfig(workers=2).processes
    2
    """

    workers: int | None = None
    """Processes of the local engine that plan batches, pack steps or scan row groups
    (`rolltool.engine.local`); None: the cores this process may use (`processes`). Refused with
    ``engine="ray"``, where Ray tasks use the cluster's CPUs."""
    engine: str = "local"
    """``"local"`` (this machine's processes, `rolltool.engine.local.LocalEngine`) or ``"ray"``
    (Ray tasks, `rolltool.engine.ray.RayEngine`; the ``[ray]`` extra)."""
    ray_address: str | None = None
    """The Ray cluster ``engine="ray"`` attaches to (``auto``, ``HOST:6379``,
    ``ray://HOST:10001``); None: ``RAY_ADDRESS``, else one ``ray start`` began on this machine,
    else a new local cluster (`rolltool.engine.ray.attach`). Refused with ``engine="local"``."""
    exchange: str = "auto"
    """Pack's exchange path (`rolltool.fetch.buckets`: the input read once into step buckets):
    ``"auto"`` where fetching step by step would read the input `EXCHANGE_AT` times over,
    ``"always"`` or ``"never"`` (`EXCHANGE_CHOICES`)."""

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGE_CHOICES:
            raise RolltoolError(f"--exchange must be one of {', '.join(EXCHANGE_CHOICES)}")
        check_engine(self.engine, self.ray_address, self.workers)
        if self.workers is not None and self.workers < 1:
            raise RolltoolError(f"--workers must be at least 1, got {self.workers}")

    def task_paths(self, paths: Sequence[str]) -> list[str]:
        """`paths` as the run's tasks must open them: with ``engine="ray"`` local paths made
        absolute here, on the driver (a Ray task runs in its raylet's working directory, not
        the driver's, and opened ``in.parquet`` there); URIs, and every path of the local
        engine (whose processes share this one's directory), as given. Globs stay globs."""
        if self.engine == "local":
            return list(paths)
        from rolltool.storage.fs import is_remote  # pyarrow: not at this module's import

        return [p if is_remote(p) else os.path.abspath(p) for p in paths]

    @property
    def processes(self) -> int:
        """The local engine's processes: `workers`, or the cores this process may use."""
        return default_workers() if self.workers is None else self.workers


@contextlib.contextmanager
def open_engine(execution: ExecutionConfig) -> Iterator[Engine]:
    """The engine `execution` names, for the ``with`` block: this machine's processes, or the
    Ray cluster attached to (`rolltool.engine.ray.attach`, disconnected on leaving). Ray is
    imported only here, only for ``engine="ray"``."""
    if execution.engine == "local":
        from rolltool.engine.local import LocalEngine

        yield LocalEngine(execution.processes)
        return
    from rolltool.engine.ray import attach

    with attach(execution.ray_address) as ray:
        yield ray


@contextlib.contextmanager
def open_mapper(execution: ExecutionConfig, what: str) -> Iterator[Mapper | None]:
    """What computes a command's per-piece work (the scan of ``advantages``) under `execution`:
    None (this process) for one local worker, that many forked processes
    (`rolltool.engine.local.local_mapper`), or Ray tasks naming `what` ("scanning row groups")
    in their errors (`rolltool.engine.ray.RayEngine.map_in_order`)."""
    if execution.engine == "local":
        if execution.processes <= 1:  # this process: no pool (nor engine.local's imports)
            yield None
            return
        from rolltool.engine.local import local_mapper

        yield local_mapper(execution.processes, what)
        return
    from rolltool.engine.ray import attach

    with attach(execution.ray_address) as ray:
        yield functools.partial(ray.map_in_order, what=what)
