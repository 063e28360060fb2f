"""The local engine: this machine's processes, for planning batches and for packing steps.

`LocalEngine` is this module as a `rolltool.engine.base.Engine` (what a job asks of any engine):
its ``workers``, the planning mapper with its size rule (`plan_mapper`), and `pack_steps` with
its own (`pack_worth_it`). Both pools cut their work with the one chunk policy
(`rolltool.engine.base.chunks`) and collect it in order with `rolltool.engine.base.in_order`
(`_pool_in_order`); they differ in how their workers start and what they are handed, below.

Planning (``pack --workers N``): each batch's plan (`rolltool.plan.step_plan.plan_one_step` /
``plan_batch``) is a pure function of the light columns, the config and the batch, so batches
can be planned anywhere and in any order: `iter_in_order` puts the results back in batch order
and every byte written is the same as a serial run's (tests/engine/test_workers.py compares every
file). Its workers are forked from the driver after the scan, so they inherit the light columns
without pickling them; only each batch's plan travels back, a chunk of at most ``MAX_CHUNK``
batches at a time, with at most ``WINDOW_PER_WORKER`` chunks a worker submitted and not yet
collected (a pool that runs ahead of the driver fills the driver with finished plans: 10 M
samples with 2 workers peaked at 1,118 MB, 950-957 with the window). Processes, not threads:
planning is Python and NumPy over small arrays and holds the GIL. A pool costs ~50-100 ms to
start, so it is used only for runs of at least ``MIN_BATCHES`` batches and ``MIN_SAMPLES``
samples; smaller runs plan serially whatever ``workers`` says.

Packing (`pack_steps`): a step's rows depend only on its plan and the input's tokens, so steps
can be packed by any process in any order. Each worker opens its own `TokenReader` over the
input (a ``1/N`` share of ``--cache-mb``; it checks the input against what the driver's scan
recorded, `TokenReader.handoff`), packs contiguous runs of steps (consecutive steps share row
groups in input order) with `rolltool.packing.step.pack_chunk`, and sends back each step's
record and its files' sizes and sha256. The driver takes them in step order, adopts the files
into its `PackedWriter`, and writes samples.parquet and the manifest last: the same bytes as
one process. Memory: each worker holds one step's tokens and rows plus its cache share.
Workers are started by ``forkserver`` (a clean process, not a fork of the driver and its Arrow
thread pools); the steps travel to them pickled, a chunk at a time. A failing step stops the run
with its error, the pool is shut down before the temporary directory is removed, and a worker
that dies (killed, out of memory) is one error naming the steps it held. The exchange path's
buckets are the job's (`rolltool.fetch.buckets`, on the driver): ``data_exchange`` is false.

Dead processes, both pools (`_guarded`, each worker's start): a worker that dies (the OOM
killer's SIGKILL) fails the run at once with one line naming the batches or steps it held, and
the survivors are killed (``_kill``: one blocked writing a result nobody reads would keep the
pool, and the driver waiting for it, alive for good). A driver that dies takes its workers with
it: each worker watches a pipe only the driver holds open (``_watch``: end of file, the driver
is gone, and the worker kills itself at once, before it writes anything more), and forked
workers also get a parent-death signal on Linux. The forkserver and the resource tracker then
exit by themselves (they stay only while a worker holds their pipes). Forked workers drop the
driver's SIGTERM and SIGHUP handlers (``rolltool.cli`` raises on them), so that ``terminate``
stops them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from rolltool.engine.base import chunks, default_workers, in_order
from rolltool.errors import RolltoolError
from rolltool.fetch.tokens import TokenReader
from rolltool.format import StepRecord
from rolltool.packing.step import Job, Packed, pack_chunk
from rolltool.plan.step_plan import PlannedStep
from rolltool.util.mapping import Mapper

T = TypeVar("T")
R = TypeVar("R")

MIN_BATCHES = 8
"""Fewer batches than this are planned serially."""
MIN_SAMPLES = 50_000
"""Runs with fewer input samples than this are planned serially."""

_JOB: tuple[Callable[..., Any], Sequence[Any]] | None = None  # set in each forked worker


def worth_it(workers: int, batches: int, samples: int) -> bool:
    """Whether a pool pays for itself (see the module docstring)."""
    return workers > 1 and batches >= MIN_BATCHES and samples >= MIN_SAMPLES


def map_in_order(
    fn: Callable[[T], R], items: Sequence[T], workers: int, what: str = "planning batches"
) -> list[R]:
    """``[fn(x) for x in items]``, computed by `workers` forked processes in contiguous chunks
    (`rolltool.engine.base.chunks`), in order. `fn` and `items` reach the workers by fork, not pickle;
    each result is pickled back. An exception in a worker is raised here, as serially; a worker
    that dies is one `RolltoolError` naming `what` it was doing and its items ("planning
    batches 8-11")."""
    return list(iter_in_order(fn, items, workers, what))


def iter_in_order(
    fn: Callable[[T], R], items: Sequence[T], workers: int, what: str = "planning batches"
) -> Iterator[R]:
    """`map_in_order`'s results one by one, each yielded as soon as it and those before it
    are computed (serially: computed when asked for), so a caller that folds them as they
    come never holds them all. Leaving early stops the pool."""
    if workers <= 1 or len(items) < 2:
        yield from (fn(x) for x in items)
        return
    parts = chunks(len(items), workers, MAX_CHUNK)

    def died(span: tuple[int, int]) -> RolltoolError:
        return _died_doing(f"{what} {span[0]}-{span[1] - 1}", "fewer --workers")

    for chunk in _pool_in_order("fork", workers, _adopt, (fn, items), _run, parts, died):
        chunk.reverse()  # each result let go once yielded, not held until the chunk's last
        while chunk:
            yield chunk.pop()


MAX_CHUNK = 32
"""Items per chunk of `iter_in_order`, at most (`rolltool.engine.base.chunks`): a chunk's
results come back as one list, so a finished chunk waiting in the driver holds this many
results (planning 10 M samples: ~50 KB a planned step, 1,220 batches a chunk with 2 workers
before this bound, ~60 MB)."""

WINDOW_PER_WORKER = 2
"""Chunks submitted and not yet collected, per worker (`rolltool.engine.base.in_order`): one
running and one queued, so a worker never waits for the driver to hand it work, while finished
chunks wait in the driver only until their turn (not every chunk of the run)."""


def local_mapper(workers: int, what: str = "mapping items") -> Mapper | None:
    """``--workers N``: items mapped by N forked processes (`map_in_order`, a dead worker named
    by `what`: "scanning row groups"); None (map here) for one worker."""
    if workers <= 1:
        return None
    return lambda fn, items: map_in_order(fn, items, workers, what)


def plan_mapper(workers: int, samples: int) -> Mapper:
    """How pack plans its batches with ``--workers N`` over `samples` input samples: by forked
    processes when the run is big enough to pay for a pool (`worth_it`), else here; results one
    by one in batch order (`iter_in_order`)."""

    def mapper(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
        use = workers if worth_it(workers, len(items), samples) else 1
        return iter_in_order(fn, items, use)

    return mapper


def _pool_in_order(
    method: str,
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    work: Callable[[Any], Any],
    parts: Sequence[Any],
    died: Callable[[Any], Exception] | None = None,
) -> Iterator[Any]:
    """``work(part)`` for every part, computed by a pool of at most `workers` processes that
    `method` starts (``fork``: they inherit what `initargs` holds; ``forkserver``: it is pickled
    to each) and `initializer` prepares, in order (`rolltool.engine.base.in_order`; at most
    ``WINDOW_PER_WORKER`` parts per worker submitted and not yet collected). A worker's
    exception is raised here as it was raised there; a worker that dies is ``died(part)``
    where given, the others killed (`_kill`). Leaving early cancels
    the parts not started and waits for the running ones: the pool is gone when this returns.
    Every worker dies with this process (`_guarded`)."""
    watch, alive = multiprocessing.Pipe(duplex=False)  # only this process holds `alive` open
    forked = method == "fork"
    pool = ProcessPoolExecutor(
        max_workers=min(workers, max(len(parts), 1)),
        mp_context=multiprocessing.get_context(method),
        initializer=_guarded,
        initargs=(os.getpid(), watch, alive if forked else None, initializer, initargs),
    )

    def collect(part: Any, future: Future[Any]) -> Any:
        try:
            return future.result()
        except BrokenProcessPool:
            _kill(pool)
            if died is None:
                raise
            raise died(part) from None

    def submit(part: Any) -> Future[Any]:
        try:
            return pool.submit(work, part)
        except BrokenProcessPool as e:  # a worker died since the last collect: the pending
            failed: Future[Any] = Future()  # parts' collect names it (`died`), as before the
            failed.set_exception(e)  # window, when every part was submitted at the start
            return failed

    try:
        window = WINDOW_PER_WORKER * workers
        yield from in_order(submit, parts, window, collect, _cancel)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        alive.close()
        watch.close()


def _kill(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every process of a broken pool: the executor only terminates them and waits,
    and a survivor blocked writing its result into a pipe nobody reads any more would never
    exit (nor the driver, which waits for it)."""
    processes = getattr(pool, "_processes", None) or {}
    for process in list(processes.values()):
        with contextlib.suppress(Exception):
            process.kill()


def _guarded(
    parent: int,
    watch: Connection,
    inherited: Connection | None,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
) -> None:
    """A worker's start, before `initializer`: it dies with the driver `parent` (see the module
    docstring). `watch` is the pipe's end the driver holds the other end of; `inherited`, in a
    forked worker, is its copy of that other end (closed here: only the driver may hold it)."""
    if inherited is not None:  # forked: the driver's handlers, and its end of the pipe
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        inherited.close()
        _die_with_parent(parent)
    threading.Thread(
        target=_watch, args=(watch,), name="rolltool-driver-watch", daemon=True
    ).start()
    initializer(*initargs)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and at
    once if it has died already (the race between the fork and the prctl)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


def _watch(watch: Connection) -> None:
    """Wait for the end of the driver's pipe (the driver is gone: nothing else closes it while
    this process lives), then SIGKILL this process, before it writes anything more."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            watch.recv_bytes()
    os.kill(os.getpid(), signal.SIGKILL)


def _cancel(futures: list[Future[Any]]) -> None:
    for future in futures:
        future.cancel()


def _adopt(fn: Callable[..., Any], items: Sequence[Any]) -> None:
    global _JOB
    _JOB = (fn, items)


def _run(span: tuple[int, int]) -> list[Any]:
    assert _JOB is not None
    fn, items = _JOB
    return [fn(items[i]) for i in range(*span)]


# -- packing steps in a pool of processes (``pack --workers N``) -------------------------

MIN_WORKERS = 4
"""A pool is used only with at least this many workers, each with a core of its own: one process
already overlaps decoding with planning (`rolltool.fetch.tokens.preloaded`) and reading, laying
out and writing with each other on threads, where a worker does them one after another and
first imports for ~1.5 s; on 2 cores a pool of 2 took 12-22 s where one process took 8-12
(docs/performance.md, "pack"; `benchmarks/pack.py`) ..."""
MIN_STEPS_PER_WORKER = 2
"""... at least this many steps per worker ..."""
MIN_TOKENS = 20_000_000
"""... and this many sampled tokens (~180 MB of shards): a pool costs ~1 s to start."""


def pack_worth_it(workers: int, steps: Sequence[StepRecord]) -> bool:
    """Whether packing the steps of these records in `workers` processes pays for their
    start."""
    tokens = sum(st.sampled_tokens for st in steps)
    enough = len(steps) >= MIN_STEPS_PER_WORKER * workers and tokens >= MIN_TOKENS
    return min(workers, default_workers()) >= max(MIN_WORKERS, 2) and enough


_STATE: tuple[Job, TokenReader] | None = None  # set in each worker by _start


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
    parts = [list(steps[a:b]) for a, b in chunks(len(steps), workers)]
    share = dataclasses.replace(job, cache_bytes=job.cache_bytes // workers)
    for done in _pool_in_order("forkserver", workers, _start, (share,), _pack, parts, _died):
        yield from done


def _died(chunk: list[PlannedStep]) -> RolltoolError:
    first, last = chunk[0].index, chunk[-1].index
    return _died_doing(f"packing steps {first}-{last}", "fewer --workers or a smaller --cache-mb")


def _died_doing(doing: str, fewer: str) -> RolltoolError:
    """A worker that died (SIGKILL: the OOM killer, or a person) while `doing` its part."""
    return RolltoolError(
        f"a worker process died while {doing} (killed, or out of memory?); nothing was written",
        hint=f"run again with {fewer}",
    )


@dataclass(frozen=True)
class LocalEngine:
    """This machine's processes as an engine (`rolltool.engine.base.Engine`): the module's
    functions with its `workers`."""

    workers: int
    """Processes that plan batches, pack steps and map a stage's items; 1: all of it here."""

    packs_here = True
    """A run too small for the pool is packed by the job (`pack_worth_it`)."""
    data_exchange = False
    """The exchange path's buckets are the job's (see the module docstring)."""

    def map_in_order(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`map_in_order` with `workers` processes (any `Mapper`; no size rule)."""
        return map_in_order(fn, items, self.workers)

    def scan_mapper(self) -> Mapper | None:
        """`local_mapper` (forked processes; None for one worker)."""
        return local_mapper(self.workers, "scanning row groups")

    def plan_mapper(self, samples: int) -> Mapper:
        """`plan_mapper`: a pool only for a run that pays for one."""
        return plan_mapper(self.workers, samples)

    def pack_worth_it(self, steps: Sequence[StepRecord]) -> bool:
        """`pack_worth_it`: False (the job packs here) for a run too small for the pool."""
        return pack_worth_it(self.workers, steps)

    def pack_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """`pack_steps` with `workers` processes."""
        return pack_steps(steps, job, self.workers)

    def exchange_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """Not this engine's: the job fills the buckets (``data_exchange`` is false)."""
        raise NotImplementedError("the local engine's exchange path is the job's step buckets")
