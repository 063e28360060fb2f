"""`rolltool advantages` in bounded memory: the streamed output against the former in-memory job,
the output row-group plan against a row-by-row reference, and Arrow memory held during a run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import rolltool.jobs.advantages as jobs
import rolltool.jobs.rewrite as rewrite
from rolltool.errors import RolltoolError
from rolltool.input.resolve import resolve_inputs
from rolltool.jobs.advantages import ADVANTAGE_COLUMNS, run_advantages
from rolltool.jobs.rewrite import decoded_bytes, row_group_plan
from rolltool.plan.advantages import AdvantageConfig, AdvantageInput, compute_advantages
from rolltool.schema import scan
from rolltool.storage.outputs import parquet_marker


def in_memory(inputs: Sequence[Path], output: Path, config: AdvantageConfig) -> None:
    """The job as it was before it streamed: every file read whole, the advantages computed,
    each file written with the columns appended in row groups of ``ROW_GROUP`` rows."""
    files = resolve_inputs(inputs)
    tables = [pq.read_table(f.path) for f in files]
    rollouts = scan(files, {}, tables=tables, ignore=ADVANTAGE_COLUMNS)
    adv = compute_advantages(config, AdvantageInput.from_rollouts(rollouts))
    new = {
        "advantage": pa.array(adv.advantage, pa.float32()),
        "group_size": pa.array(adv.group_size, pa.int64()),
        "group_reward_mean": pa.array(adv.group_reward_mean, pa.float64()),
        "group_reward_std": pa.array(adv.group_reward_std, pa.float64()),
        "group_uniform": pa.array(adv.group_uniform, pa.bool_()),
    }
    schema = pa.unify_schemas([t.schema for t in tables], promote_options="permissive")
    schema = pa.schema([pa.field(f.name, f.type) for f in schema])
    for name, arr in new.items():
        schema = schema.append(pa.field(name, arr.type))
    schema = schema.with_metadata(parquet_marker("advantages"))
    start = 0
    with pq.ParquetWriter(output, schema, compression="zstd") as writer:
        for t in tables:
            for name, arr in new.items():
                t = t.append_column(name, arr.slice(start, t.num_rows))
            for field in schema:
                if field.name not in t.column_names:
                    t = t.append_column(field.name, pa.nulls(t.num_rows, field.type))
            t = t.select(schema.names).combine_chunks().cast(schema)
            writer.write_table(t, row_group_size=jobs.ROW_GROUP)
            start += t.num_rows


def _row_groups(path: Path) -> list[int]:
    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


@pytest.fixture
def inputs(tmp_path: Path, synth_table: pa.Table) -> Path:
    """A folder of three files (rows 0-89 in row groups of 16, an empty one, the rest with an
    extra column in one row group) in the synth table's order."""
    folder = tmp_path / "in"
    folder.mkdir()
    a, b = synth_table.slice(0, 90), synth_table.slice(90)
    pq.write_table(a, folder / "a.parquet", row_group_size=16)
    pq.write_table(a.slice(0, 0), folder / "b.parquet")
    extra = b.append_column("note", pa.array([f"row {i}" for i in range(b.num_rows)]))
    pq.write_table(extra, folder / "c.parquet")
    return folder


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_pp_baseline"])
def test_streamed_output_is_byte_for_byte_the_in_memory_one(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, estimator: str
) -> None:
    """Several files (one empty, one with a column the others lack), output row groups of 40
    rows: the same file bytes as the whole input in memory, each file starting a row group."""
    monkeypatch.setattr(jobs, "ROW_GROUP", 40)
    config = AdvantageConfig(estimator=estimator)
    in_memory([inputs], tmp_path / "ref.parquet", config)
    run_advantages([inputs], tmp_path / "out.parquet", config)
    assert _row_groups(tmp_path / "out.parquet") == [40, 40, 10, 0, 40, 16]
    assert (tmp_path / "out.parquet").read_bytes() == (tmp_path / "ref.parquet").read_bytes()


def test_a_byte_budget_cuts_row_groups_and_keeps_the_rows(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a budget of a.parquet's first two row groups the output cuts at its row groups
    (first at 32 rows, not 40), as `file_plan` says; the rows and values are the in-memory
    ones."""
    meta = pq.ParquetFile(inputs / "a.parquet").metadata
    two = decoded_bytes(meta.row_group(0)) + decoded_bytes(meta.row_group(1))
    monkeypatch.setattr(jobs, "ROW_GROUP", 40)
    monkeypatch.setattr(jobs, "ROW_GROUP_BYTES", int(two * 1.05))
    in_memory([inputs], tmp_path / "ref.parquet", AdvantageConfig())
    report = run_advantages([inputs], tmp_path / "out.parquet", AdvantageConfig())
    plan = _row_groups(tmp_path / "out.parquet")
    files = resolve_inputs([inputs])
    want = [rewrite.file_plan(f, max_rows=40, max_bytes=int(two * 1.05)) or [0] for f in files]
    assert plan == [n for p in want for n in p] and plan[0] == 32  # the budget bites
    assert pq.read_table(tmp_path / "out.parquet").equals(pq.read_table(tmp_path / "ref.parquet"))
    assert report["samples"] == sum(plan)


@given(
    rows=st.lists(st.integers(0, 9), max_size=12),
    data=st.data(),
    max_rows=st.integers(1, 12),
    max_bytes=st.integers(1, 200),
)
def test_row_group_plan_matches_a_row_by_row_reference(
    rows: list[int], data: st.DataObject, max_rows: int, max_bytes: int
) -> None:
    sizes = [data.draw(st.integers(0, 60)) for _ in rows]
    got = row_group_plan(rows, sizes, max_rows=max_rows, max_bytes=max_bytes)
    want: list[int] = []
    held, held_bytes = 0, 0.0
    for n, size in zip(rows, sizes, strict=True):
        if n and held and held_bytes + size > max_bytes:  # this input row group would not fit
            want.append(held)
            held, held_bytes = 0, 0.0
        for _ in range(n):  # one row at a time
            held, held_bytes = held + 1, held_bytes + size / n
            if held == max_rows:
                want.append(held)
                held, held_bytes = 0, 0.0
    want += [held] * (held > 0)
    assert got == want
    assert sum(got) == sum(rows) and all(0 < n <= max_rows for n in got)
    unbounded = row_group_plan(rows, sizes, max_rows=max_rows, max_bytes=10**9)
    whole = sum(rows)  # what write_table(row_group_size=max_rows) does with the whole file
    assert unbounded == [max_rows] * (whole // max_rows) + [whole % max_rows] * (
        whole % max_rows > 0
    )


def test_memory_holds_one_output_row_group_not_the_input(
    tmp_path: Path, synth_table: pa.Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input of 110 row groups under a budget of two of the largest: every read is one row
    group, and the Arrow memory held at any read or write stays a few row groups' worth (4.9 of
    the largest when written), never the input's (a third of it here)."""
    path = tmp_path / "in.parquet"
    ids = pa.array([f"{k}:{s}" for k in range(3) for s in synth_table["sample_id"].to_pylist()])
    table = pa.concat_tables([synth_table] * 3).set_column(2, "sample_id", ids)
    pq.write_table(table, path, row_group_size=4)
    meta = pq.ParquetFile(path).metadata
    sizes = [decoded_bytes(meta.row_group(i)) for i in range(meta.num_row_groups)]
    assert meta.num_row_groups == 110
    monkeypatch.setattr(jobs, "ROW_GROUP_BYTES", 2 * max(sizes))
    base = pa.total_allocated_bytes()
    held: list[int] = []
    reads: list[Any] = []
    real_read, real_write = pq.ParquetFile.read_row_group, pq.ParquetWriter.write_table

    def read(self: pq.ParquetFile, i: Any, *args: Any, **kw: Any) -> pa.Table:
        reads.append(i)
        table = real_read(self, i, *args, **kw)
        held.append(pa.total_allocated_bytes() - base)
        return table

    def write(self: pq.ParquetWriter, table: pa.Table, *args: Any, **kw: Any) -> None:
        held.append(pa.total_allocated_bytes() - base)
        real_write(self, table, *args, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", write)
    for whole in ("read", "iter_batches"):
        monkeypatch.setattr(pq.ParquetFile, whole, lambda *a, **k: pytest.fail("whole file"))
    run_advantages([path], tmp_path / "out.parquet", AdvantageConfig())
    assert all(isinstance(i, int) for i in reads) and len(reads) == 2 * 110  # scan, then copy
    out = pq.ParquetFile(tmp_path / "out.parquet").metadata
    extra = 40 * max(_row_groups(tmp_path / "out.parquet"))  # the computed columns, < 40 B/row
    assert max(decoded_bytes(out.row_group(i)) for i in range(out.num_row_groups)) <= (
        2 * max(sizes) + extra
    )
    assert len(held) > 110 and max(held) < 8 * max(sizes) < sum(sizes) / 3, (max(held), sizes)


def test_a_file_that_changes_during_the_run_is_refused(
    tmp_path: Path, synth_table: pa.Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows added between the scan and the copy: an error naming the file, and no output."""
    path = tmp_path / "in.parquet"
    pq.write_table(synth_table, path)
    real = jobs.compute_advantages

    def and_grow(*args: Any) -> Any:
        pq.write_table(pa.concat_tables([synth_table, synth_table.slice(0, 3)]), path)
        return real(*args)

    monkeypatch.setattr(jobs, "compute_advantages", and_grow)
    with pytest.raises(RolltoolError, match=r"in\.parquet: changed during the run"):
        run_advantages([path], tmp_path / "out.parquet", AdvantageConfig())
    assert not (tmp_path / "out.parquet").exists()


def test_rows_the_footer_did_not_announce_are_refused(
    tmp_path: Path, synth_table: pa.Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan short of the file's rows (as if the file grew between its footer and its rows)
    stops the copy instead of writing a row group the new columns do not cover."""
    path = tmp_path / "in.parquet"
    pq.write_table(synth_table, path)
    monkeypatch.setattr(rewrite, "file_plan", lambda *a, **k: [10])
    with pytest.raises(RolltoolError, match="changed during the run"):
        run_advantages([path], tmp_path / "out.parquet", AdvantageConfig())
    assert not (tmp_path / "out.parquet").exists()
