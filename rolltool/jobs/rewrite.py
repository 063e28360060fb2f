"""Rewrite the input Parquet files as one file with new columns appended, in bounded memory.

`append_columns` copies the input rows, in order, to one output file, dropping the columns it
replaces and appending new per-row columns (``rolltool advantages``: the computed advantages).
It reads one input row group at a time and holds at most one output row group plus the input
row group that straddles it, so memory does not grow with the input.

Output row groups (`row_group_plan`, decided from the input footers before a row is read):
each input file starts a new one; one ends after ``max_rows`` rows, or before an input row
group that would take its decoded size (`decoded_bytes`) past ``max_bytes``. Where the byte
limit never binds, the cuts fall every ``max_rows`` rows of the file, as
``write_table(whole_file, row_group_size=max_rows)`` makes them, and the output is byte for
byte what writing each whole file from memory gives. Example with ``max_rows = 4``: input row
groups of 3, 3 and 2 rows, 10 bytes each, give ``[4, 4]`` under ``max_bytes = 100`` and
``[3, 3, 2]`` under ``max_bytes = 15``.

Each output row group is built column by column as one contiguous array per column: the bytes
pyarrow writes depend on chunk boundaries (a dictionary page falls back to plain encoding at a
chunk's end), so contiguous columns make the bytes independent of the input's row groups.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq

from rolltool.errors import RolltoolError
from rolltool.input.parquet import InputFile, file_schema, footer, iter_row_groups

VALUE_BYTES = {"BOOLEAN": 1 / 8, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
"""Bytes per decoded value of a Parquet physical type (Arrow's width; booleans are bits)."""


def decoded_bytes(meta: pq.RowGroupMetaData) -> int:
    """About how many bytes a row group takes once decoded into Arrow, from its footer alone.

    Fixed-width columns count values x width (the encoded size can be far smaller: an all-ones
    ``loss_mask`` run-length encodes to almost nothing), variable-width ones their uncompressed
    size plus an 8-byte offset per value. List offsets and validity bitmaps are left out.
    """
    total = 0.0
    for j in range(meta.num_columns):
        col = meta.column(j)
        width = VALUE_BYTES.get(col.physical_type)
        if width is None:
            total += col.total_uncompressed_size + 8 * col.num_values
        else:
            total += width * col.num_values
    return int(total)


def row_group_plan(
    rows: Sequence[int], sizes: Sequence[int], *, max_rows: int, max_bytes: int
) -> list[int]:
    """Rows of each output row group of one file whose input row groups have ``rows`` rows and
    ``sizes`` decoded bytes (see the module docstring): cut every ``max_rows`` rows, and before
    an input row group that would take the open one past ``max_bytes``. A file without rows
    gives ``[]``.

    >>> row_group_plan([3, 3, 2], [10, 10, 10], max_rows=4, max_bytes=100)
    [4, 4]
    >>> row_group_plan([3, 3, 2], [10, 10, 10], max_rows=4, max_bytes=15)
    [3, 3, 2]
    """
    plan: list[int] = []
    held, held_bytes = 0, 0.0
    for n, size in zip(rows, sizes, strict=True):
        if not n:  # an empty input row group adds nothing, not even a cut
            continue
        if held and held_bytes + size > max_bytes:
            plan.append(held)
            held, held_bytes = 0, 0.0
        left = n
        while left:
            take = min(left, max_rows - held)
            held, held_bytes, left = held + take, held_bytes + size * take / n, left - take
            if held == max_rows:
                plan.append(held)
                held, held_bytes = 0, 0.0
    if held:
        plan.append(held)
    return plan


def file_plan(file: InputFile, *, max_rows: int, max_bytes: int) -> list[int]:
    """`row_group_plan` of one input file, from its footer; refuses a file whose row count is no
    longer the one the scan saw (it changed during the run)."""
    try:
        meta = footer(file.path)
    except (pa.ArrowException, OSError) as e:
        raise RolltoolError(f"{file.path}: could not be read ({e})") from None
    if meta.num_rows != file.rows:
        raise _changed(file)
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    rows = [g.num_rows for g in groups]
    sizes = [decoded_bytes(g) for g in groups]
    return row_group_plan(rows, sizes, max_rows=max_rows, max_bytes=max_bytes)


def _changed(file: InputFile) -> RolltoolError:
    return RolltoolError(
        f"{file.path}: changed during the run (it had {file.rows:,} rows when it was scanned)",
        hint="run again once nothing writes to the input",
    )


def _batch_schema(file: InputFile, rename: Mapping[str, str]) -> pa.Schema:
    """The schema of the file's tables as read: renamed, partition columns added, every field
    nullable; a file without rows keeps its own nullability."""
    schema = file_schema(file, rename)
    if file.rows == 0:
        return schema
    return pa.schema([pa.field(f.name, f.type) for f in schema])


def output_schema(
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
    metadata: Mapping[bytes, bytes],
) -> pa.Schema:
    """Every input column (types unified over the files) but the replaced ones, then ``new``."""
    schemas = []
    for file in files:
        schema = _batch_schema(file, rename)
        for name in replaced:
            if name in schema.names:
                schema = schema.remove(schema.get_field_index(name))
        schemas.append(schema)
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise RolltoolError(f"the input files have incompatible column types ({e})") from None
    for name, arr in new.items():
        schema = schema.append(pa.field(name, arr.type))
    return schema.with_metadata(dict(metadata))


def append_columns(
    target: str | os.PathLike[str] | pa.NativeFile,
    files: Sequence[InputFile],
    rename: Mapping[str, str],
    schema: pa.Schema,
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
    *,
    max_rows: int,
    max_bytes: int,
    check: Callable[[int, pa.Table], None] | None = None,
) -> None:
    """Write the input's rows, in order, with ``new``'s (one entry per input row) appended, in
    the row groups `file_plan` gives each file (zstd, as ``schema`` says).

    ``check(file_index, table)`` sees every input row group as read, before its rows are
    written (``rolltool advantages``: the row rules its deferred scan left undone); what it
    raises stops the copy.
    """
    start = 0
    with pq.ParquetWriter(target, schema, compression="zstd") as writer:
        for k, file in enumerate(files):
            plan = file_plan(file, max_rows=max_rows, max_bytes=max_bytes)
            seen = None if check is None else partial(check, k)
            for table in _regrouped(file, rename, plan, seen):
                n = table.num_rows
                cols = {name: arr.slice(start, n) for name, arr in new.items()}
                writer.write_table(_conform(table, file, schema, replaced, cols), n)
                del table  # before the next one is read: one output row group in memory
                start += n
            if not plan:  # an empty file is an empty row group, as pyarrow writes one
                writer.write_table(schema.empty_table())


def _regrouped(
    file: InputFile,
    rename: Mapping[str, str],
    plan: Sequence[int],
    check: Callable[[pa.Table], None] | None = None,
) -> Iterator[pa.Table]:
    """The file's rows as tables of ``plan`` rows each, read row group by row group: memory
    holds one output row group, the input row group it ends in and one column's copy."""
    names: list[str] = []
    chunks: dict[str, list[pa.Array]] = {}
    held, k = 0, 0
    for _, piece in iter_row_groups(file, rename):
        if check is not None:
            check(piece)
        names = piece.column_names
        for name in names:
            chunks.setdefault(name, []).extend(piece.column(name).chunks)
        held += piece.num_rows
        del piece
        while k < len(plan) and held >= plan[k]:
            yield _take_rows(names, chunks, plan[k])
            held, k = held - plan[k], k + 1
    if held or k < len(plan):  # rows the footer did not announce, or announced rows missing
        raise _changed(file)


def _take_rows(names: Sequence[str], chunks: dict[str, list[pa.Array]], rows: int) -> pa.Table:
    """The first ``rows`` rows of ``chunks``, removed from it, as one contiguous array per
    column. Copied column by column, so each input column is freed before the next is copied."""
    columns = []
    for name in names:
        head: list[pa.Array] = []
        rest: list[pa.Array] = []
        n = 0
        for c in chunks[name]:
            if n >= rows:
                rest.append(c)
            elif n + len(c) <= rows:
                head.append(c)
                n += len(c)
            else:
                head += [c.slice(0, rows - n)]
                rest += [c.slice(rows - n)]
                n = rows
        chunks[name] = rest
        columns.append(pa.concat_arrays(head))
        del head
    return pa.Table.from_arrays(columns, names=list(names))


def _conform(
    table: pa.Table,
    file: InputFile,
    schema: pa.Schema,
    replaced: Sequence[str],
    new: Mapping[str, pa.Array],
) -> pa.Table:
    """``table`` with the replaced columns dropped, ``new`` appended, columns the file lacks
    as nulls, in ``schema``'s order and types."""
    table = table.drop_columns([c for c in replaced if c in table.column_names])
    for name, arr in new.items():
        table = table.append_column(name, arr)
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise RolltoolError(
            f"{file.path}: columns do not match the other input files ({e})"
        ) from None
