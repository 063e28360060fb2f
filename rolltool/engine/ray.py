"""``pack --engine ray``: batches planned and steps packed as Ray Core tasks, the same bytes.

The same two pieces of work as the local engine (`rolltool.engine.local`), on a Ray
cluster instead of forked processes: `map_in_order` plans contiguous chunks of batches as tasks
(the planning function, with the light columns it closes over, is put in the object store once)
and returns the plans in batch order; `pack_steps` packs contiguous chunks of steps as tasks with
`rolltool.packing.step.pack_chunk` (each task resumes a `TokenReader` from the driver's
`TokenReader.handoff`, so an input changed since the scan is refused on any node) and yields
each step's record and files in step order, for the driver to adopt. The driver writes
samples.parquet and the manifest last, as always: identity comes from the pure per-batch and
per-step functions and fixed shard names, not from Ray options (tests/scenarios/test_ray.py compares every
file with the local engine's). On the exchange path `exchange_steps` brings each step's samples
together with Ray Data's hash shuffle instead of local buckets (`rolltool.engine.ray_exchange`).

`RayEngine` is a `rolltool.engine.base.Engine`, as `rolltool.engine.local.LocalEngine` is: it
cuts its work with the same chunk policy (`rolltool.engine.base.chunks`, bounded by
``MAX_CHUNK``) and collects it in order with `rolltool.engine.base.in_order` (`in_order`), a
window of Ray refs instead of futures; the task mechanics (the object store, retries, `_get`'s
errors, cancelling) are its own.

Other commands: `rolltool.engine.config.open_mapper` gives ``stats`` and the scan of
``advantages`` a ``mapper(fn, items)`` that is `map_in_order` on the cluster (``--engine ray``).

Files: on a cluster of several machines the inputs and the output are either URIs on object
storage (``s3://``, ...: tasks read the input and upload their own shards, no filesystem is
shared) or on a filesystem every node mounts at the same path (NFS, Lustre, ...: tasks write the
shards straight into the driver's temporary output directory; a task that does not see it stops
the run saying so). Local paths reach tasks absolute (`for_tasks`: a worker runs in its
raylet's directory). Every node also needs rolltool (the same version) installed in the Python
its Ray workers run.

Failures: a task whose worker dies (killed, out of memory, a lost node) or that hits an OSError
is retried up to `RETRIES` times; a retried step writes the same bytes under the same names, so
it overwrites what a killed attempt half wrote. A failure that persists is one `RolltoolError`
naming the steps; the run's temporary directory is then removed (nothing looks complete). An
error of rolltool's own (e.g. --equal-count, an input changed) is not retried and is raised as
the local engine raises it.

Memory: at most `RayEngine.window` tasks (``WINDOW_PER_CPU`` per cluster CPU) are submitted
and not yet collected at any time (`in_order`: the next chunk is submitted as the oldest one's
result is taken, in order), and a chunk holds at most ``MAX_CHUNK`` items, so the driver and
the object store hold O(window x chunk) of arguments and results, not the whole run's.

Ray is imported only here, and only when this engine is used (``pip install 'rolltool[ray]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rolltool.engine import base
from rolltool.errors import RolltoolError

if TYPE_CHECKING:  # imported where used: attaching to a cluster needs neither
    from rolltool.format import StepRecord
    from rolltool.packing.step import Job, Packed
    from rolltool.plan.step_plan import PlannedStep
    from rolltool.util.mapping import Mapper

RETRIES = 3
"""Times a failed task is run again (a dead worker, an OSError) before the run stops."""
MAX_CHUNK = 32
"""A chunk of work sent to one Ray task holds at most this many items (batches, steps, files),
however few CPUs the cluster has (`rolltool.engine.base.chunks`)."""
WINDOW_PER_CPU = 2
"""Tasks submitted and not yet collected, per cluster CPU (`RayEngine.window`)."""
DATA_EXCHANGE_NODES = 2
"""The exchange path runs on Ray Data (`RayEngine.exchange_steps`) on a cluster of at least this
many nodes, where it spreads the read over them; on one node the driver's local buckets are
faster (docs/storage.md, "On Ray"), the same bytes either way."""
FILES_HINT = (
    "on a cluster of several machines the inputs and the output must be URIs on object storage "
    "(s3://, ...) or on a filesystem every node mounts at the same path"
)
"""Where a multi-node run's files may be (docs/storage.md says the same)."""
REACH_TIMEOUT = 10.0
"""Seconds to wait for a cluster's head to accept a connection."""
A = TypeVar("A")


@dataclass(frozen=True)
class RayEngine:
    """A connected Ray cluster and how the run uses it."""

    cpus: int
    """The cluster's CPUs: work is cut into at least ``CHUNKS_PER_WORKER x cpus`` chunks
    (`rolltool.engine.base.chunks`)."""
    tasks_in_flight: int = 0
    """Most tasks submitted and not yet collected; 0: ``WINDOW_PER_CPU x cpus`` (at least 2)."""
    nodes: int = 1
    """The cluster's live nodes."""

    @property
    def window(self) -> int:
        return self.tasks_in_flight or max(WINDOW_PER_CPU * self.cpus, 2)

    packs_here = False
    """Every step is packed by Ray tasks (`pack_worth_it`)."""

    @property
    def data_exchange(self) -> bool:
        """Whether the exchange path runs on Ray Data here (``DATA_EXCHANGE_NODES``)."""
        return self.nodes >= DATA_EXCHANGE_NODES

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """``[a, b)`` bounds of the contiguous chunks ``n`` items are cut into."""
        return base.chunks(n, self.cpus, MAX_CHUNK)

    def scan_mapper(self) -> Mapper:
        """`map_in_order` naming "scanning row groups" (the scan as Ray tasks)."""
        return functools.partial(self.map_in_order, what="scanning row groups")

    def plan_mapper(self, samples: int) -> Mapper:
        """`map_in_order`, whatever the run's size: the cluster is up already."""
        return lambda fn, items: self.map_in_order(fn, items)

    def pack_worth_it(self, steps: Sequence[StepRecord]) -> bool:
        """Always: on ``--engine ray`` every step is packed by Ray tasks."""
        return True

    def map_in_order(
        self, fn: Callable[[Any], Any], items: Sequence[Any], what: str = "planning batches"
    ) -> list[Any]:
        """``[fn(x) for x in items]`` computed by Ray tasks over contiguous chunks, in order
        (`rolltool.plan.schedule.schedule`'s ``mapper``; any ``Mapper``). `what` names the work in
        the error of a task that keeps failing."""
        import ray

        task = ray.remote(_map_chunk).options(max_retries=RETRIES, retry_exceptions=[OSError])
        fn_ref = ray.put(fn)

        def submit(span: tuple[int, int]) -> Any:
            return task.remote(fn_ref, list(items[span[0] : span[1]]))

        def named(span: tuple[int, int]) -> str:
            return f"{what} {span[0]}-{span[1] - 1}"

        with contextlib.closing(
            in_order(submit, self.chunks(len(items)), self.window, named)
        ) as got:
            return [y for chunk in got for y in chunk]

    def pack_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """Every step packed by Ray tasks, yielded in step order (see the module docstring).
        Leaving the iterator early (an error downstream) cancels the tasks still running."""
        import ray

        task = ray.remote(_pack_task).options(max_retries=RETRIES, retry_exceptions=[OSError])
        share = dataclasses.replace(for_tasks(job), cache_bytes=job.cache_bytes // self.cpus)
        job_ref = ray.put(share)
        chunks = [list(steps[a:b]) for a, b in self.chunks(len(steps))]

        def submit(chunk: list[PlannedStep]) -> Any:
            return task.remote(job_ref, chunk)

        def named(chunk: list[PlannedStep]) -> str:
            return f"packing {_steps_named(chunk)}"

        with contextlib.closing(in_order(submit, chunks, self.window, named)) as got:
            for done in got:
                yield from done

    def exchange_steps(self, steps: Sequence[PlannedStep], job: Job) -> Iterator[Packed]:
        """The exchange path on Ray: every step packed from its samples brought together by
        Ray Data's hash shuffle (`rolltool.engine.ray_exchange`), yielded in step order; instead of
        local step buckets (``job.buckets`` is not used)."""
        from rolltool.engine.ray_exchange import exchange_steps

        return exchange_steps(steps, dataclasses.replace(for_tasks(job), buckets=None), self.cpus)


def for_tasks(job: Job) -> Job:
    """`job` with every local path absolute (the input files, the output's temporary
    directory): a Ray worker runs in its raylet's working directory, not the driver's, and
    would open a relative path there (defect 5 of issue 20). Only what tasks open changes: the
    manifest records the inputs as the driver resolved them."""
    from rolltool.input.parquet import InputFile
    from rolltool.storage.fs import is_remote

    def absolute(f: InputFile) -> InputFile:
        return f if is_remote(f.path) else dataclasses.replace(f, path=os.path.abspath(f.path))

    reader = dataclasses.replace(job.reader, files=[absolute(f) for f in job.reader.files])
    return dataclasses.replace(job, reader=reader, root=job.root.absolute())


def in_order(
    submit: Callable[[A], Any], args: Iterable[A], window: int, named: Callable[[A], str]
) -> Generator[Any, None, None]:
    """Each ``submit(a)``'s result (`submit` starts a Ray task and returns its ref), in the
    order of `args`, with at most `window` tasks submitted and not yet collected: the next is
    submitted when the oldest one's result has been taken (`_get`; `named(a)` names it in an
    error). Closing the iterator early cancels the tasks still running (`_cancel`). The
    collection is `rolltool.engine.base.in_order`, the local pools' too."""
    return base.in_order(submit, args, window, lambda a, ref: _get(ref, named(a)), _cancel)


@contextlib.contextmanager
def attach(address: str | None) -> Iterator[RayEngine]:
    """Connect to the Ray cluster at `address` (``auto``, ``ray://host:10001``, ``host:6379``;
    None: ``RAY_ADDRESS`` if set, else a cluster ``ray start`` began on this machine, else a new
    local cluster on this machine's cores), or use the one this process is already connected
    to. A cluster connected to here is disconnected from (a local one shut down) on leaving."""
    try:
        import ray
    except ImportError:
        raise RolltoolError(
            "--engine ray needs Ray, which is not installed",
            hint="pip install 'rolltool[ray]' (or use --engine local)",
        ) from None
    _check_reachable(address)
    started = not ray.is_initialized()
    if started:
        with _own_sigterm():
            try:
                ray.init(
                    address=address,
                    include_dashboard=False if address is None else None,
                    log_to_driver=False,
                    configure_logging=False,
                )
            except (ConnectionError, ray.exceptions.RayError) as e:
                raise _not_connected(address, e) from None
    try:
        cpus = max(int(ray.cluster_resources().get("CPU", 1)), 1)
        yield RayEngine(cpus=cpus, nodes=max(sum(n["Alive"] for n in ray.nodes()), 1))
    finally:
        if started:
            ray.shutdown()


AUTH_HINT = (
    "the cluster requires a token: set RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or "
    "RAY_AUTH_TOKEN_PATH to a file holding it) as the cluster's nodes have them"
)


def _not_connected(address: str | None, e: BaseException) -> RolltoolError:
    """The error of a failed ``ray.init``: a refused or missing token says so (defect 9 of issue
    20: Ray retries for ~22 s, then says nothing of the token); a head that accepted the
    connection (`_check_reachable`) is not told to be started."""
    import ray

    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    where = f"the Ray cluster at {address!r}" if address else "the Ray cluster"
    lowered = str(e).lower()
    if isinstance(e, ray.exceptions.AuthenticationError) or "auth" in lowered or "token" in lowered:
        return RolltoolError(
            f"{where} refused this driver: no valid token ({text})", hint=AUTH_HINT
        )
    if address not in (None, "auto"):  # its head accepted a connection (_check_reachable)
        return RolltoolError(
            f"cannot connect to {where}, though its head accepts connections: {text}",
            hint=f"if {AUTH_HINT}; else check the address is the head's GCS port "
            "(`ray start --head` prints it) and that this Ray is the cluster's version",
        )
    return RolltoolError(
        f"cannot connect to {where}: {text}",
        hint="start one with `ray start --head`, or leave out --ray-address for a local cluster",
    )


_RAISED: list[BaseException] = []
"""The exception this process's SIGTERM or SIGHUP handler raised last (`_own_signals`)."""


@contextlib.contextmanager
def _own_sigterm() -> Iterator[None]:
    """Keep this process's SIGTERM handler across ``ray.init``, which sets its own (an exit 15
    with a "*** SIGTERM received" dump), and note what it and SIGHUP's raise (`_own_signals`):
    the CLI's handlers interrupt a run as on the local engine (exit 143, "Interrupted by
    SIGTERM", temporary files removed)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        _own_signals()


def _own_signals() -> None:
    """Wrap this process's Python SIGTERM and SIGHUP handlers so that what they raise is kept:
    raised inside ``ray.get`` it comes out as a bare KeyboardInterrupt (`_get` raises the
    original instead, e.g. the CLI's ``Terminated``, exit 143)."""
    import signal

    for s in (signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(s)
        if not callable(handler) or getattr(handler, "_rolltool_noted", False):
            continue

        def noted(signum: int, frame: Any, handler: Callable[[int, Any], Any] = handler) -> Any:
            try:
                return handler(signum, frame)
            except BaseException as e:
                _RAISED[:] = [e]
                raise

        noted._rolltool_noted = True  # type: ignore[attr-defined]
        signal.signal(s, noted)


def _check_reachable(address: str | None) -> None:
    """A ``HOST:PORT`` or ``ray://HOST:PORT`` address that refuses connections is an error now
    (Ray itself retries for minutes)."""
    if address is None or address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT).close()
    except (OSError, ValueError) as e:
        raise RolltoolError(
            f"cannot reach the Ray cluster at {address!r}: {e}",
            hint="give HOST:PORT of its head (`ray start --head` prints it), 'auto' for the "
            "cluster on this machine, or leave out --ray-address for a new local one",
        ) from None


def _map_chunk(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    return [fn(x) for x in items]


def _pack_task(job: Job, steps: list[PlannedStep]) -> list[Packed]:
    from rolltool.fetch.tokens import TokenReader
    from rolltool.packing.step import pack_chunk

    if job.upload is None and not job.root.is_dir():  # a remote output: tasks upload
        raise RolltoolError(
            f"a Ray task on {os.uname().nodename} does not see the output directory {job.root}",
            hint=FILES_HINT,
        )
    reader = TokenReader.resume(job.reader, cache_bytes=job.cache_bytes)
    return pack_chunk(job, steps, reader)


def _steps_named(chunk: Sequence[PlannedStep]) -> str:
    first, last = chunk[0].index, chunk[-1].index
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _get(ref: Any, what: str) -> Any:
    """The task's result; its own error (rolltool's, an OSError) as the local engine raises it;
    a task Ray gave up on (a worker that kept dying, a lost node) as one `RolltoolError`."""
    import ray

    try:
        return ray.get(ref)
    except KeyboardInterrupt as e:  # a signal handler's own exception, if one raised it
        raised = _RAISED[:1]
        _RAISED.clear()
        if raised and raised[0] is not e:
            raise raised[0] from None
        raise
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RolltoolError | OSError):
            raise e.cause from None
        raise
    except ray.exceptions.RayError as e:
        raise RolltoolError(
            f"a Ray task {what} failed {1 + RETRIES} times ({type(e).__name__}); "
            "nothing was written",
            hint="a worker killed or out of memory? see `ray status` and the Ray logs; "
            + FILES_HINT,
        ) from None


def _cancel(refs: list[Any]) -> None:
    """Stop the tasks still running and wait for them, so none writes into a directory the
    driver is about to remove."""
    import ray

    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        ray.wait(pending, num_returns=len(pending), timeout=30)
