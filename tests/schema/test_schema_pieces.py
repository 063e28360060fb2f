"""The scan in pieces: deferred (light columns first, token rules in the copy) and mapped
(row groups scanned by a mapper) scans against the serial, eager scan.

Identity is the contract: the same `Rollouts` for a valid input, the same error (message and
hint) for a broken one, and nothing written by `rolltool advantages` either way.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolltool.engine.local import local_mapper
from rolltool.errors import RolltoolError
from rolltool.input.parquet import InputFile, file_schema
from rolltool.input.resolve import resolve_inputs
from rolltool.jobs.advantages import ADVANTAGE_COLUMNS, run_advantages
from rolltool.plan.advantages import AdvantageConfig, AdvantageInput, compute_advantages
from rolltool.schema import Rollouts, pieces, rollouts, scan, scan_deferred
from rolltool.schema.columns import FileColumns, file_columns
from rolltool.schema.rows import FLOAT32_LIMIT, _list_parts, _plain_floats, bit_row_sums


def assert_same_rollouts(a: Rollouts, b: Rollouts) -> None:
    """Every field equal: arrays element for element (nan equal to nan), the rest by ==."""
    for f in fields(Rollouts):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        elif isinstance(x, pa.Array):
            assert x.equals(y), f.name
        else:
            assert x == y, f.name


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("error", (message, hint)) or ("ok", result)."""
    try:
        return "ok", fn()
    except RolltoolError as e:
        return "error", (e.message, e.hint)


class Counting:
    """A mapper that runs here and counts the items it ran (the mapped path really ran)."""

    def __init__(self) -> None:
        self.items = 0

    def __call__(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        self.items += len(items)
        return [fn(x) for x in items]


# -- random messy inputs: broken token columns are what the deferred scan leaves to the copy ---

ID = st.one_of(st.none(), st.sampled_from(["a", "b", "c"]))
TOKENS = st.one_of(st.none(), st.lists(st.sampled_from([-1, 0, 5, 2**31]), max_size=3))
MASK = st.one_of(st.none(), st.lists(st.one_of(st.none(), st.integers(0, 2)), max_size=3))
LOGPROB = st.one_of(st.none(), st.sampled_from([-0.5, float("nan"), float("inf"), 1e39]))


@st.composite
def messy_tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 6))

    def col(strategy: st.SearchStrategy) -> list:
        return draw(st.lists(strategy, min_size=n, max_size=n))

    cols: dict[str, Any] = {
        "group_id": col(ID),
        "reward": col(st.one_of(st.none(), st.sampled_from([0.0, 1.0, float("nan")]))),
    }
    if draw(st.booleans()):
        cols["input_ids"] = pa.array(col(TOKENS), pa.list_(pa.int64()))
        cols["loss_mask"] = pa.array(col(MASK), pa.list_(pa.int8()))
    else:
        cols["prompt_ids"] = pa.array(col(TOKENS), pa.list_(pa.int64()))
        cols["response_ids"] = pa.array(col(TOKENS), pa.list_(pa.int64()))
    for name, strategy in [("rollout_id", ID), ("sample_id", ID), ("advantage", LOGPROB)]:
        if draw(st.booleans()):
            cols[name] = col(strategy)
    if draw(st.booleans()):
        lists = st.one_of(st.none(), st.lists(LOGPROB, max_size=3))
        cols["logprobs"] = pa.array(col(lists), pa.list_(pa.float64()))
    return pa.table(cols)


def _write(folder: Path, tables: Sequence[pa.Table], row_group: int = 2) -> list[str]:
    paths = []
    for i, table in enumerate(tables):
        paths.append(str(folder / f"part-{i}.parquet"))
        pq.write_table(table, paths[-1], row_group_size=row_group)
    return paths


def _eager_job(paths: list[str], config: AdvantageConfig) -> tuple[str, Any]:
    """What `rolltool advantages` said before the scan was deferred: the full scan's problems,
    else the estimator's error, else the advantages."""

    def job() -> Any:
        ro = scan(resolve_inputs(paths), ignore=ADVANTAGE_COLUMNS)
        return compute_advantages(config, AdvantageInput.from_rollouts(ro)).advantage

    return outcome(job)


@settings(max_examples=120, deadline=None)
@given(
    tables=st.lists(messy_tables(), min_size=1, max_size=2),
    estimator=st.sampled_from(["grpo", "reinforce_pp_baseline"]),
)
def test_deferred_job_says_what_the_eager_scan_says(tables: list[pa.Table], estimator: str) -> None:
    config = AdvantageConfig(estimator=estimator)
    with tempfile.TemporaryDirectory() as tmp:
        paths = _write(Path(tmp), tables)
        dst = Path(tmp) / "out.parquet"
        want = _eager_job(paths, config)
        got = outcome(lambda: run_advantages(paths, dst, config))
        assert got[0] == want[0], (got, want)
        if want[0] == "error":
            assert got[1] == want[1]
            assert not dst.exists()
        else:
            written = pq.read_table(dst).column("advantage").to_numpy()
            np.testing.assert_array_equal(written, want[1])


@settings(max_examples=120, deadline=None)
@given(tables=st.lists(messy_tables(), min_size=1, max_size=3))
def test_deferred_scan_and_its_check_accept_exactly_what_the_scan_accepts(
    tables: list[pa.Table],
) -> None:
    """A valid input: the same Rollouts and a check that passes every row group; a broken one:
    the deferred scan or its check refuses it."""
    with tempfile.TemporaryDirectory() as tmp:
        files = resolve_inputs(_write(Path(tmp), tables))
        want = outcome(lambda: scan(files, ignore=ADVANTAGE_COLUMNS))
        try:
            ro, check = scan_deferred(files, ignore=ADVANTAGE_COLUMNS)
            for k, table in enumerate(tables):
                for t in table.to_batches(max_chunksize=2):
                    check(k, pa.Table.from_batches([t], table.schema))
        except pieces.DeferredProblem:
            assert want[0] == "error"
        except RolltoolError as e:  # raised before a row was read: the same error
            assert want == ("error", (e.message, e.hint))
        else:
            assert want[0] == "ok", want
            assert_same_rollouts(ro, want[1])


@settings(max_examples=80, deadline=None)
@given(tables=st.lists(messy_tables(), min_size=1, max_size=3))
def test_mapped_scan_is_the_serial_scan(tables: list[pa.Table]) -> None:
    """Row groups scanned one by one by a mapper: the same Rollouts, or the same message."""
    with tempfile.TemporaryDirectory() as tmp:
        files = resolve_inputs(_write(Path(tmp), tables, row_group=1))
        want = outcome(lambda: scan(files))
        mapper = Counting()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rollouts, "MIN_ROW_GROUPS", 1)
            got = outcome(lambda: scan(files, mapper=mapper))
        assert got[0] == want[0]
        if want[0] == "ok":
            assert_same_rollouts(got[1], want[1])
            assert mapper.items == len(pieces.tasks(pieces.ScanJob(_checked(files), {})))
        else:
            assert got[1] == want[1]


# -- the real thing: forked workers on an input with many row groups ---------------------------


def _many_groups(tmp_path: Path, synth_table: pa.Table, **columns: pa.Array) -> list[str]:
    table = synth_table
    for name, arr in columns.items():
        table = table.set_column(table.schema.get_field_index(name), name, arr)
    half = table.num_rows // 2
    return _write(tmp_path, [table.slice(0, half), table.slice(half)], row_group=8)


def test_forked_workers_scan_what_one_process_scans(tmp_path: Path, synth_table: pa.Table) -> None:
    files = resolve_inputs(_many_groups(tmp_path, synth_table))
    assert len(pieces.tasks(pieces.ScanJob(checked=_checked(files), rename={}))) >= 16
    serial = scan(files)  # polars and pyarrow's thread pools in use before the fork
    assert_same_rollouts(scan(files, mapper=local_mapper(2)), serial)


def _checked(files: Sequence[InputFile]) -> tuple[FileColumns, ...]:
    """The column rules' verdict on each file (no renames)."""
    return tuple(file_columns(f, file_schema(f, {}), []) for f in files)


def test_forked_workers_list_the_problems_one_process_lists(
    tmp_path: Path, synth_table: pa.Table
) -> None:
    """More broken rows than are listed, over many row groups and both files: the same
    listing, counts and order."""
    ids = synth_table.column("input_ids").to_pylist()
    for i in range(0, len(ids), 7):
        ids[i] = [-1, *ids[i][1:]]
    reward = synth_table.column("reward").to_numpy().copy()
    reward[::11] = np.nan
    files = resolve_inputs(
        _many_groups(
            tmp_path,
            synth_table,
            input_ids=pa.array(ids, synth_table.schema.field("input_ids").type),
            reward=pa.array(reward),
        )
    )
    serial = outcome(lambda: scan(files))
    assert serial[0] == "error" and "... and" in serial[1][0]
    assert outcome(lambda: scan(files, mapper=local_mapper(2))) == serial
    out = tmp_path / "out.parquet"
    deferred = outcome(lambda: run_advantages([f.path for f in files], out, AdvantageConfig()))
    assert deferred == serial and not out.exists()


def test_advantages_with_workers_writes_the_same_bytes(
    tmp_path: Path, synth_table: pa.Table
) -> None:
    paths = _many_groups(tmp_path, synth_table)
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    run_advantages(paths, one, AdvantageConfig())
    run_advantages(paths, two, AdvantageConfig(), mapper=local_mapper(2))
    assert one.read_bytes() == two.read_bytes()


def test_a_token_problem_in_the_last_row_group_leaves_nothing(
    tmp_path: Path, synth_table: pa.Table
) -> None:
    """The copy has written most of the rows when its check finds the broken one: the output
    is not there, and the message is the full scan's."""
    lp = synth_table.column("logprobs").to_pylist()
    lp[-1] = [float("nan")] * len(lp[-1])
    paths = _many_groups(
        tmp_path, synth_table, logprobs=pa.array(lp, synth_table.schema.field("logprobs").type)
    )
    out = tmp_path / "out.parquet"
    got = outcome(lambda: run_advantages(paths, out, AdvantageConfig()))
    assert got == outcome(lambda: scan(resolve_inputs(paths), ignore=ADVANTAGE_COLUMNS))
    assert got[0] == "error" and "logprobs" in got[1][0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "out" in p.name] == []


def test_a_mapper_cannot_feed_on_row_group(synth_path: Path) -> None:
    with pytest.raises(ValueError, match="on_row_group"):
        scan(resolve_inputs([synth_path]), on_row_group=lambda *a: None, mapper=Counting())


def test_the_deferred_scan_reads_no_input_ids_nor_logprobs(synth_path: Path) -> None:
    files = resolve_inputs([synth_path])
    job = pieces.ScanJob(checked=_checked(files), rename={}, deferred=True)
    read = job.columns(job.checked[0])
    assert "loss_mask" in read and "reward" in read
    assert not {"input_ids", "logprobs"} & set(read)
    assert {"input_ids", "logprobs"} <= set(pieces.ScanJob(job.checked, {}).columns(job.checked[0]))


# -- the logprobs fast path ----------------------------------------------------------------------

SPECIAL = st.sampled_from([0.0, -0.5, float("nan"), float("inf"), -float("inf"), 1e39, -3.4e38])


NUMPY = {pa.float16(): np.float16, pa.float32(): np.float32, pa.float64(): np.float64}


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), SPECIAL), max_size=6),
    dtype=st.sampled_from(sorted(NUMPY, key=str)),
)
def test_plain_floats_is_the_obvious_check(values: list[float | None], dtype: pa.DataType) -> None:
    null = np.array([v is None for v in values], dtype=bool)
    with np.errstate(over="ignore"):
        data = np.array([0.0 if v is None else v for v in values]).astype(NUMPY[dtype])
    arr = pa.array(data, mask=null, type=dtype)
    want = (
        dtype != pa.float16()
        and len(values) > 0
        and not null.any()
        and bool(np.all(np.isfinite(data) & (np.abs(data.astype(np.float64)) < FLOAT32_LIMIT)))
    )
    assert _plain_floats(arr) == want


@settings(max_examples=200, deadline=None)
@given(
    lists=st.lists(st.lists(st.booleans(), max_size=20), max_size=12),
    cut=st.tuples(st.integers(0, 12), st.integers(0, 12)),
)
def test_bit_row_sums_counts_the_ones_of_each_list(
    lists: list[list[bool]], cut: tuple[int, int]
) -> None:
    """On a sliced list array too (its values start mid-byte)."""
    arr = pa.array(lists, pa.large_list(pa.bool_()))
    lo = min(cut[0], len(lists))
    arr = arr.slice(lo, max(cut[1] - lo, 0))
    offsets, values = _list_parts(arr)
    want = [sum(x) for x in lists[lo : lo + len(arr)]]
    assert bit_row_sums(offsets, values).tolist() == want


def test_advantages_cli_workers_write_the_same_bytes(
    tmp_path: Path, synth_table: pa.Table, run_cli: Any
) -> None:
    paths = _many_groups(tmp_path, synth_table)
    outs = [tmp_path / f"w{n}.parquet" for n in (1, 2)]
    for n, out in zip((1, 2), outs, strict=True):
        result = run_cli("advantages", *paths, "-o", out, "--workers", str(n), "--json")
        assert result.exit_code == 0, result.output
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert run_cli("advantages", *paths, "-o", outs[0], "--workers", "0").exit_code == 2
