"""The exchange path on Ray: Ray Data's hash shuffle brings each step's samples together.

`rolltool.fetch.buckets` streams the input once into step buckets on the driver's disk, which a
cluster of several machines can read only through a shared filesystem. Here the same exchange
runs as a Ray Data pipeline (`exchange_steps`, ``RayEngine.exchange_steps``):

1. one task per input row group (``ray.data.range(B).map_batches``): `TokenReader.fetch` (the
   reader every engine uses, checked against the driver's scan) reads the samples of that row
   group that some step trains, and emits one row per (step, slot, sample): the plan's
   ``step``, the sample's ``slot`` (its place in the step's row order, ``st.members[st.order]``)
   and its three token lists. Only trained samples travel, once per step that trains them;
2. ``groupby("step").map_groups``: Ray Data's hash shuffle (``HASH_SHUFFLE``) brings every row
   of a step to one task, which sorts them by ``slot`` before anything is computed (Ray
   delivers rows in any order), rebuilds the step's `SampleTokens` in exactly the order the
   local path fetches them, and lays out and writes the step with `rolltool.packing.step.write_step`
   and the job's writer (the driver's temporary directory, or uploaded to a remote output), as
   `rolltool.packing.step.pack_chunk` does; it returns the step's `Packed` record;
3. the driver sorts the records by step and yields them in step order to be adopted; a step
   with no trained sample (a batch thinner than its mini-batches) has no row to shuffle and is
   packed on the driver, reading nothing.

Identity: the shards are written by the same function, from the same tokens in the same
order, under names fixed by (step, rank, part); tests/scenarios/test_ray.py compares every file with the
direct one-process run's. Memory: a read task holds one decoded row group; the shuffle keeps
its blocks in the object store (spilled to disk when it fills); a pack task holds one step.
The shards go where `rolltool.packing.step.Job.writer` puts them (the driver's temporary directory, a
shared filesystem on several machines, or uploaded straight to a remote output); the buckets
are gone.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from rolltool.format.layout import SampleTokens

if TYPE_CHECKING:
    from rolltool.packing.step import Job, Packed
    from rolltool.plan.step_plan import PlannedStep

_TOKENS = {"input_ids": pa.int32(), "loss_mask": pa.uint8(), "logprobs": pa.float32()}
_ROWS = pa.schema(
    [("step", pa.int64()), ("slot", pa.int64())]
    + [(name, pa.list_(t)) for name, t in _TOKENS.items()]
    + [("error", pa.binary())]
)
"""The shuffled rows; a row group that could not be read is one row of step -1 (its index in
``slot``) carrying its pickled error: Ray Data keeps only the text of a task's exception."""
FAILED = -1
LOST_NODE_S = 20.0
"""Once a node is lost, the exchange must deliver a step within this long, else the run stops
(`_watched`)."""
WATCH_S = 0.5
"""How often the driver looks at the cluster's nodes during the exchange."""
_PLANS: dict[str, Any] = {}  # per Ray worker process: the plan, fetched once per run


def exchange_steps(steps: Sequence[PlannedStep], job: Job, cpus: int) -> Iterator[Packed]:
    """Every step packed through Ray Data's shuffle (see the module docstring), yielded in step
    order; `job` as for `rolltool.engine.ray.RayEngine.pack_steps` (without buckets)."""
    from rolltool.fetch.tokens import TokenReader
    from rolltool.packing.step import pack_chunk

    reader = TokenReader.resume(job.reader, cache_bytes=0)
    pairs = _pairs(steps)
    starts = np.append(reader.block_starts, reader.num_rows)
    done = _shuffle_and_pack(steps, job, pairs, starts, cpus) if len(pairs["sample"]) else {}
    for st in steps:
        if st.index in done:
            yield done.pop(st.index)
        else:  # no trained sample: nothing to read
            yield from pack_chunk(job, [st], reader)


def _shuffle_and_pack(
    steps: Sequence[PlannedStep],
    job: Job,
    pairs: dict[str, np.ndarray],
    starts: np.ndarray,
    cpus: int,
) -> dict[int, Packed]:
    """Steps 1 and 2 of the module docstring: each step's `Packed`, by step. An error of
    rolltool's own (an input changed, ...) or an OSError in a task is raised as it came."""
    import ray
    import ray.data

    data: Any = ray.data
    plan_ref = ray.put({st.index: st for st in steps})
    try:
        with _data_context(cpus):
            rows = data.range(len(starts) - 1, override_num_blocks=len(starts) - 1)
            rows = rows.map_batches(_read_blocks, batch_format="pyarrow", batch_size=1,
                                    fn_args=(job, ray.put(pairs), starts))  # fmt: skip
            packed = rows.groupby("step").map_groups(
                _pack_group, batch_format="pyarrow", fn_args=(job, plan_ref)
            )
            got = _watched(packed)
    except Exception as e:
        raise _cause(e) from None
    return _raised(got)


def _raised(got: dict[int, Any]) -> dict[int, Packed]:
    """The steps' `Packed` records; a step's error (its read or its write failed) raised: the
    failed read's (the cause) before the steps it left short of samples."""
    errors = [got[s] for s in sorted(got) if isinstance(got[s], BaseException)]
    if errors:
        raise errors[0]
    return got


def _watched(packed: Any) -> dict[int, Any]:
    """Every step's unpickled result (`Packed` or its error), consumed on a thread while this
    one watches the cluster: once a node is lost, the exchange must deliver a step within
    `LOST_NODE_S` (Ray Data recovering its lost blocks) or the run stops with one
    `RolltoolError` (Ray Data can wait for good for resources the lost node held)."""
    import threading
    import time

    import ray

    def alive() -> int:
        return sum(1 for n in ray.nodes() if n["Alive"])

    nodes = alive()
    state: dict[str, Any] = {"got": {}, "last": time.monotonic()}

    def consume() -> None:
        try:
            for batch in packed.iter_batches(batch_format="pyarrow"):
                steps, payloads = batch["step"].to_pylist(), batch["packed"].to_pylist()
                for s, p in zip(steps, payloads, strict=True):
                    state["got"][int(s)] = pickle.loads(p)
                state["last"] = time.monotonic()
        except BaseException as e:  # raised on the driver's thread below
            state["error"] = e

    thread = threading.Thread(target=consume, name="rolltool-exchange", daemon=True)
    thread.start()
    lost: float | None = None
    while thread.is_alive():
        thread.join(WATCH_S)
        if not thread.is_alive():
            break
        if lost is None and alive() < nodes:
            lost = time.monotonic()
        if lost is not None and time.monotonic() - max(lost, state["last"]) > LOST_NODE_S:
            from ray._private import auto_init_hook

            from rolltool.errors import RolltoolError

            # The thread is still inside Ray Data; once the driver disconnects it fails and
            # ends, and must not start a local cluster of its own (Ray's auto-init) first.
            auto_init_hook.enable_auto_connect = False

            raise RolltoolError(
                f"a node of the Ray cluster was lost during the exchange on Ray Data and it "
                f"did not recover in {LOST_NODE_S:.0f} s; nothing was written",
                hint="run again, or with --exchange never (Ray Core tasks are retried on the "
                "nodes left); see `ray status`",
            )
    if "error" in state:
        raise state["error"]
    got: dict[int, Any] = state["got"]
    return got


def _cause(e: BaseException) -> BaseException:
    """The first `RolltoolError` or OSError in the chain of causes Ray Data wraps a task's error
    in; else a `RolltoolError` naming the exchange."""
    from rolltool.engine.ray import FILES_HINT
    from rolltool.errors import RolltoolError

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, RolltoolError | OSError):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return RolltoolError(
        f"the exchange on Ray Data failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
        "nothing was written",
        hint="see `ray status` and the Ray logs, or run with --exchange never; " + FILES_HINT,
    )


def _pairs(steps: Sequence[PlannedStep]) -> dict[str, np.ndarray]:
    """Every (step, slot, sample) the plan trains, ordered by sample (then step)."""
    none = np.zeros(0, np.int64)
    rows = [st.members[st.order] for st in steps]
    step = np.concatenate([np.full(len(m), st.index, np.int64) for st, m in zip(steps, rows, strict=True)] or [none])  # fmt: skip
    slot = np.concatenate([np.arange(len(m), dtype=np.int64) for m in rows] or [none])
    sample = np.concatenate([np.asarray(m, np.int64) for m in rows] or [none])
    order = np.lexsort((step, sample))
    return {"step": step[order], "slot": slot[order], "sample": sample[order]}


def _read_blocks(batch: pa.Table, job: Job, pairs: Any, starts: np.ndarray) -> pa.Table:
    """The rows (step, slot, tokens) of the trained samples in the row groups of `batch`; a
    row group that fails (an input changed, an OSError) gives one `FAILED` row instead."""
    import ray

    from rolltool.errors import RolltoolError
    from rolltool.fetch.tokens import TokenReader

    if isinstance(pairs, ray.ObjectRef):
        pairs = ray.get(pairs)
    reader = TokenReader.resume(job.reader, cache_bytes=0)
    out = [_ROWS.empty_table()]
    for b in batch["id"].to_pylist():
        lo, hi = np.searchsorted(pairs["sample"], [starts[b], starts[b + 1]])
        try:
            tokens = reader.fetch(pairs["sample"][lo:hi])
        except (RolltoolError, OSError) as err:
            lists = [pa.array([[]], pa.list_(t)) for t in _TOKENS.values()]
            failed = [pa.array([FAILED]), pa.array([b]), *lists, pa.array([pickle.dumps(err)])]
            out.append(pa.Table.from_arrays(failed, schema=_ROWS))
            continue
        offsets = pa.array(tokens.offsets.astype(np.int32))
        lists = [pa.ListArray.from_arrays(offsets, pa.array(getattr(tokens, name), t))
                 for name, t in _TOKENS.items()]  # fmt: skip
        columns = [pa.array(pairs["step"][lo:hi]), pa.array(pairs["slot"][lo:hi]), *lists,
                   pa.nulls(hi - lo, pa.binary())]  # fmt: skip
        out.append(pa.Table.from_arrays(columns, schema=_ROWS))
    return pa.concat_tables(out)


def _pack_group(rows: pa.Table, job: Job, plan_ref: Any) -> pa.Table:
    """Lay out and write the step whose rows these are (sorted by slot first): its pickled
    `Packed`, or its pickled error (the first failed read's for the `FAILED` group)."""
    from rolltool.errors import RolltoolError

    rows = rows.sort_by("slot")
    step = int(rows["step"][0].as_py())
    if step == FAILED:
        return _result(step, rows["error"][0].as_py())
    try:
        got: Any = _write(rows, _plan(plan_ref)[step], job)
    except (RolltoolError, OSError) as err:
        got = err
    return _result(step, pickle.dumps(got))


def _result(step: int, payload: bytes) -> pa.Table:
    return pa.table({"step": [step], "packed": pa.array([payload], pa.binary())})


def _write(rows: pa.Table, st: PlannedStep, job: Job) -> Packed:
    """Step `st` written from its rows (sorted by slot), as `rolltool.packing.step.pack_chunk` writes
    a step (`Job.writer`)."""
    from rolltool.errors import RolltoolError
    from rolltool.packing.step import Packed, write_step

    if rows["slot"].to_pylist() != list(range(len(st.members))):  # a read failed
        raise RolltoolError(f"step {st.index}: samples missing after the exchange")
    writer = job.writer()  # into job.root, or uploaded to a remote output
    record = write_step(writer, st, _tokens(rows), job.config)
    return Packed(record, writer.files, uploaded=job.upload is not None)


def _plan(ref: Any) -> dict[int, PlannedStep]:
    """The run's planned steps by index, fetched once per worker process."""
    import ray

    key = ref.hex()
    if key not in _PLANS:
        _PLANS.clear()
        _PLANS[key] = ray.get(ref)
    plan: dict[int, PlannedStep] = _PLANS[key]
    return plan


def _tokens(rows: pa.Table) -> SampleTokens:
    """The rows' token lists as one `SampleTokens`, in row order."""
    flat = {}
    lengths = np.zeros(rows.num_rows, np.int64)
    for name, t in _TOKENS.items():
        col = rows[name].combine_chunks()
        lengths = pa.compute.list_value_length(col).to_numpy(zero_copy_only=False)
        flat[name] = (
            pa.compute.list_flatten(col)
            .to_numpy(zero_copy_only=False)
            .astype(t.to_pandas_dtype(), copy=False)
        )
    offsets = np.zeros(rows.num_rows + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return SampleTokens(offsets=offsets, **flat)


@contextlib.contextmanager
def _data_context(cpus: int) -> Iterator[None]:
    """Ray Data set for this pipeline (hash shuffle, no progress bars, its INFO and WARNING
    lines kept off stderr), as it was afterwards."""
    from ray.data.context import DataContext, ShuffleStrategy

    ctx = DataContext.get_current()
    log = logging.getLogger("ray.data")
    names = ("shuffle_strategy", "enable_progress_bars", "default_hash_shuffle_parallelism",
             "hash_shuffle_operator_actor_num_cpus_override",
             "hash_aggregate_operator_actor_num_cpus_override")  # fmt: skip
    saved = {name: getattr(ctx, name) for name in names}
    level = log.level
    ctx.shuffle_strategy = ShuffleStrategy.HASH_SHUFFLE
    ctx.enable_progress_bars = False
    ctx.default_hash_shuffle_parallelism = max(cpus, 1)
    # The shuffle's aggregator actors hold no CPU: restarted after a lost node, they would
    # otherwise wait for the CPUs the tasks that recover the lost blocks need (defect 6).
    ctx.hash_shuffle_operator_actor_num_cpus_override = 0
    ctx.hash_aggregate_operator_actor_num_cpus_override = 0
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        log.setLevel(level)
